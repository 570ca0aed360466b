"""Tokenization and incremental detokenization with Hugging Face `tokenizers` (no torch in the frontend)."""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Encoding, Tokenizer

from shuttle.common.errors import InvalidRequestError, ModelDirError
from shuttle.frontend.request.special_text import SpecialTextGuard, encode_text


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's table), reversed."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TextTokenizer:
    """The model's tokenizer.json.

    Besides encode/decode it knows each token's raw bytes when the decoder is one of the two common kinds
    (SentencePiece-style "▁" with byte fallback, or GPT-2 style ByteLevel), which lets detokenization be an
    incremental decode of bytes (`token_bytes`, None for other decoders). `byte_token_ids`: the byte-fallback
    tokens (<0xE2> ...) of a SentencePiece-style decoder, None for ByteLevel.

    Raises:
        ModelDirError: tokenizer.json is missing or unreadable.
    """

    def __init__(self, model_dir: str):
        path = Path(model_dir) / "tokenizer.json"
        try:
            self._tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelDirError(f"cannot load {path}: {exc}") from None
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.token_bytes, self.strips_leading_space, self.byte_token_ids = self._token_bytes(
            json.loads(self._tokenizer.to_str()))
        # No token stands for more characters than its vocabulary entry has (byte-level and "▁" pieces map one
        # character to at most one character), which bounds how long a text of N tokens can be.
        self.max_chars_per_token = max(len(piece) for piece in self._tokenizer.get_vocab(with_added_tokens=True))
        self.special_text = SpecialTextGuard(self._tokenizer)
        self.special_ids = frozenset(token_id for token_id, token in self._tokenizer.get_added_tokens_decoder().items()
                                     if token.special)

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None,
               param: str = "prompt") -> list[int]:
        """Token ids of `text`, with the special tokens (BOS) the tokenizer's post-processor adds, but never a second
        BOS: a text that already starts with the BOS token's text ("<s>Once upon") gets only that one.

        Tokenization holds the GIL, so a text that cannot possibly fit in `max_tokens` tokens is refused before
        it is tokenized (a 4 MB prompt would otherwise stall the event loop for seconds).

        Raises:
            InvalidRequestError: `text` has more than 2 * max_tokens * max_chars_per_token characters (the 2 allows
                for normalizers that merge characters).
        """
        self._check_length(text, max_tokens, param)
        encoding = self._tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return _one_bos(encoding.ids, encoding)

    def encode_chat(self, text: str, add_special_tokens: bool, max_tokens: int | None = None) -> list[int]:
        """Token ids of a rendered chat prompt. Message content escaped with `special_text.escape` is read as
        plain text; everything else (the template's own text) exactly as `encode` reads it.

        `max_tokens` None: any length (a count, such as /v1/messages/count_tokens; a long text is encoded with the
        GIL released, special_text.encode_text, so only the body limit bounds the work).

        Raises:
            InvalidRequestError: as `encode`, naming `messages`.
        """
        self._check_length(text, max_tokens, "messages")
        if not self.special_text.escaped(text):
            encoding = encode_text(self._tokenizer, text, add_special_tokens)
            return _one_bos(encoding.ids, encoding)
        return _one_bos(*self.special_text.encode(text, add_special_tokens))

    def _check_length(self, text: str, max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and len(text) > 2 * max_tokens * self.max_chars_per_token:
            what = "the rendered chat prompt" if param == "messages" else f"the {param}"
            raise InvalidRequestError(f"{what} is far longer than the model's maximum context of {max_tokens} "
                                      f"tokens ({len(text)} characters)", param=param)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of the vocabulary entry (or added token) spelled exactly `token`; None when there is none."""
        return self._tokenizer.token_to_id(token)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        """Each id's vocabulary entry as the tokenizer stores it (transformers' convert_ids_to_tokens: "▁Once",
        "<0x0A>", "</s>"); "" for an id outside the vocabulary."""
        return [self._tokenizer.id_to_token(token_id) or "" for token_id in token_ids]

    def is_byte_token(self, token_id: int) -> bool:
        """Whether the token is one byte of a character (a byte-fallback token such as <0xE2>)."""
        return self.byte_token_ids is not None and token_id in self.byte_token_ids

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """(display text, UTF-8 bytes) of one token, for logprobs. A byte-fallback token such as <0xE2> is
        shown as "bytes:\\xe2" (vLLM's convention) with its single byte."""
        piece = self._tokenizer.id_to_token(token_id) or ""
        if _is_byte_piece(piece):
            value = int(piece[3:5], 16)
            return f"bytes:\\x{value:02x}", [value]
        text = piece.replace("\u2581", " ")
        return text, list(text.encode())

    def _token_bytes(self, spec: dict) -> tuple[list[bytes] | None, bool, frozenset[int] | None]:
        steps = spec.get("decoder") or {}
        steps = steps.get("decoders", [steps]) if steps.get("type") == "Sequence" else [steps]
        kinds = {step.get("type") for step in steps}
        strips = any(step.get("type") == "Strip" and step.get("start", 0) > 0 for step in steps) or any(
            step.get("type") == "Metaspace" and step.get("prepend_scheme", "always") != "never" for step in steps)
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        byte_ids: set[int] | None = set()
        if kinds <= {"Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"} and (
                "ByteFallback" in kinds or "Metaspace" in kinds):
            def to_bytes(piece: str) -> bytes:
                if _is_byte_piece(piece) and "ByteFallback" in kinds:
                    return bytes([int(piece[3:5], 16)])
                return piece.replace("\u2581", " ").encode()
        elif kinds == {"ByteLevel"}:
            alphabet = _byte_level_alphabet()
            byte_ids = None

            def to_bytes(piece: str) -> bytes:
                return bytes(alphabet[ch] for ch in piece) if all(ch in alphabet for ch in piece) else piece.encode()
            strips = False
        else:
            return None, False, None
        table = []
        for token_id in range(self.vocab_size):
            piece = self._tokenizer.id_to_token(token_id)
            table.append(b"" if token_id in special or piece is None else to_bytes(piece))
            if byte_ids is not None and token_id not in special and piece and _is_byte_piece(piece) and (
                    "ByteFallback" in kinds):
                byte_ids.add(token_id)
        return table, strips, None if byte_ids is None else frozenset(byte_ids)


def _is_byte_piece(piece: str) -> bool:
    return len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">")


def _trailing_run(token_ids: list[int], table: list[bytes], byte_ids: frozenset[int]) -> bytes:
    """The bytes of the byte tokens that end `token_ids` (special tokens, which have no bytes, skipped)."""
    run = []
    for token_id in reversed(token_ids):
        if token_id in byte_ids:
            run.append(table[token_id])
        elif table[token_id]:
            break
    return b"".join(reversed(run))


def _completes_text(pending: bytearray) -> bool:
    """Whether the open bytes of a run, none of whose shorter prefixes was valid UTF-8, now are. More than 4 such
    bytes never are (the first character would have been valid on its own), which keeps each check O(1)."""
    return len(pending) <= 4 and _valid_utf8(pending)


def _valid_utf8(data: bytes | bytearray) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _one_bos(ids: list[int], encoding: Encoding) -> list[int]:
    """Drop the post-processor's BOS when the text itself starts with the same token (special_tokens_mask marks
    what the post-processor added; the text's own "<s>" is not marked)."""
    mask = encoding.special_tokens_mask
    if len(ids) > 1 and ids[0] == ids[1] and mask[0] == 1 and mask[1] == 0 and encoding.offsets[1][0] == 0:
        return ids[1:]
    return ids


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a character and that concatenate to what the
    tokenizer's own decode gives (special tokens skipped).

    With a byte table (`TextTokenizer.token_bytes`) it decodes the tokens' bytes the way the tokenizer's decoder
    does:
    - SentencePiece-style byte fallback (tokenizers' ByteFallback decoder): the bytes of a run of consecutive byte
      tokens (<0xE2> ...) go out as text as soon as they are valid UTF-8, that is with the token that completes a
      character; bytes that are no character yet wait, and when the run ends (at the next ordinary token or at the
      end) they are one U+FFFD each. Ordinary tokens go out at once. Text that is out is final, so a stop string is
      found with the token that completes it whatever follows. This is tokenizers' decode except where a run that
      it would judge invalid as a whole begins with complete characters: tokenizers' decode replaces those too
      (it sees the whole run), a stream cannot take back what it has shown.
    - GPT-2 style ByteLevel (decoded with Rust's from_utf8_lossy): an incremental UTF-8 decode; a complete character
      goes out at once, an incomplete one waits, an invalid sequence becomes one U+FFFD per maximal invalid part.
    A character whose first bytes end a token-id prompt and whose last bytes the output brings is the output's: it
    is reassembled, not shown as U+FFFD. Without a byte table it decodes a sliding window of tokens twice and
    emits the difference, holding text that ends in U+FFFD.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; if it shows no text, the first output's leading space is dropped, as the
            tokenizer's own decode does at the start of a text.
    """

    _CONTEXT_TOKENS = 6

    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._table = table = tokenizer.token_bytes
        self._byte_ids = tokenizer.byte_token_ids
        if table is None:
            self._ids = list(prompt_token_ids[-self._CONTEXT_TOKENS:])
            self._prefix_offset, self._read_offset = 0, len(self._ids)
            return
        self._strip_space = tokenizer.strips_leading_space and not any(table[t] for t in prompt_token_ids)
        if self._byte_ids is not None:
            # The bytes that end the prompt without being a character yet: the output may complete it, so they stay
            # open (they count as the prompt's if it never does).
            self._run = bytearray()
            for byte in _trailing_run(prompt_token_ids, table, self._byte_ids):
                self._run.append(byte)
                if _completes_text(self._run):
                    self._run.clear()
            self._prompt_bytes = len(self._run)
        else:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._utf8.decode(b"".join(table[t] for t in prompt_token_ids[-self._CONTEXT_TOKENS:]))
            self._prompt_pending = bool(self._utf8.getstate()[0])  # the prompt ends inside a character

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        if self._table is None:
            return self._add_by_window(new_token_ids)
        if self._byte_ids is None:
            return self._lossy(self._utf8.decode(b"".join(self._table[t] for t in new_token_ids)))
        pieces = []
        for token_id in new_token_ids:
            if token_id in self._byte_ids:
                self._run += self._table[token_id]
                if _completes_text(self._run):
                    pieces.append(self._end_run())
            elif self._table[token_id]:  # a special token has no text and does not end a run (decode skips it)
                pieces.append(self._end_run())
                pieces.append(self._table[token_id].decode())
        return self._strip("".join(pieces))

    def flush(self) -> str:
        """Text still held back at the end: bytes that are no character (U+FFFD, as the model really made them)."""
        if self._table is None:
            return self._window_delta(force=True)
        if self._byte_ids is None:
            return self._lossy(self._utf8.decode(b"", final=True))
        return self._strip(self._end_run())

    def _end_run(self) -> str:
        run, from_prompt = bytes(self._run), self._prompt_bytes
        self._run.clear()
        self._prompt_bytes = 0
        if _valid_utf8(run):
            return run.decode()
        return "\ufffd" * (len(run) - from_prompt)  # the prompt's own bytes are U+FFFD in the prompt's text already

    def _lossy(self, text: str) -> str:
        if self._prompt_pending and text:
            # The prompt's unfinished character either completed (the output's now) or broke: its U+FFFD is the
            # prompt's, shown in the prompt's own decode.
            self._prompt_pending = False
            if text.startswith("\ufffd"):
                text = text[1:]
        return text

    def _strip(self, text: str) -> str:
        if self._strip_space and text:
            self._strip_space = False
            return text[1:] if text.startswith(" ") else text
        return text

    def _add_by_window(self, new_token_ids: list[int]) -> str:
        self._ids.extend(new_token_ids)
        return self._window_delta(force=False)

    def _window_delta(self, force: bool) -> str:
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else full_text
