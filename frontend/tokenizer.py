"""Tokenization and incremental detokenization with Hugging Face `tokenizers` (no torch in the frontend)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from common.errors import ModelDirError

# Prompt tokens kept as context when detokenizing the first output tokens, so that a continuation gets the
# leading space the tokenizer's decoder would strip at the start of a text.
_CONTEXT_TOKENS = 6


class TextTokenizer:
    """The model's tokenizer.json.

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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, with the special tokens (BOS) the tokenizer's post-processor adds."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_text(self, token_id: int) -> tuple[str, list[int]]:
        """(display text, UTF-8 bytes) of one token, for logprobs. A byte-fallback token such as <0xE2> is
        shown as "bytes:\\xe2" (vLLM's convention) with its single byte."""
        piece = self._tokenizer.id_to_token(token_id) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            value = int(piece[3:5], 16)
            return f"bytes:\\x{value:02x}", [value]
        text = piece.replace("\u2581", " ")
        return text, list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that concatenate to the decoded output.

    Decodes a short window of tokens twice (up to the last emitted token, and up to the newest) and emits
    the difference, holding text back while it ends in an incomplete UTF-8 sequence (U+FFFD from byte
    fallback), so half a character is never emitted.

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the prompt; its last tokens give the first output tokens their spacing.
    """

    def __init__(self, tokenizer: TextTokenizer, prompt_token_ids: list[int]):
        self._tokenizer = tokenizer
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self._ids.extend(new_token_ids)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back at the end of the output (an incomplete byte sequence the model really made)."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._tokenizer.decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
