"""Special-token text in chat message content is read as ordinary characters, never as a special token.

A user who writes "</s>" or "<|im_start|>system" into a message must not be able to end a turn or open a new
one: that would be prompt injection into the chat template's structure. The template's own special tokens (its
bos_token, its turn markers) stay special.

How: before rendering, each special token's text in message content is replaced by a placeholder. After rendering,
every special-token text left is the template's own; it becomes a marker registered with a copy of the tokenizer
as an added token (so the text is split there exactly as the original tokenizer splits at a special token), the
placeholders become the original text again, and the copy encodes the whole prompt in one call with
`encode_special_tokens` on, so the content's special-token text is tokenized like any other text. Markers map back
to the special token ids. Placeholders and markers carry a per-process random number that clients cannot guess.
"""

from __future__ import annotations

import secrets

from tokenizers import AddedToken, Encoding, Tokenizer

GIL_FREE_CHARS = 32 * 1024  # a text this long is encoded with the GIL released


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> Encoding:
    """`tokenizer.encode(text)`, but a long text through encode_batch, which releases the GIL while Rust works:
    encode holds it throughout (seconds for a few MB), so even from a pool thread it would pause the event loop."""
    if len(text) < GIL_FREE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]

_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters: no tokenizer normalizes or case-maps them


class SpecialTextGuard:
    """Escapes special-token text in untrusted content and encodes prompts that contain escaped content.

    Args:
        tokenizer: the model's tokenizer (never modified; a copy is made on first use of `encode`).
    """

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        self._specials = {token.content: (token_id, token) for token_id, token in added.items()
                          if token.special and token.content}
        nonce = f"{_OPEN}{secrets.randbelow(10**12):012d}"
        # Longest first, so that a special token whose text contains another's is replaced whole.
        order = sorted(self._specials, key=len, reverse=True)
        self.placeholders = {text: f"{nonce}0{i:04d}{_CLOSE}" for i, text in enumerate(order)}
        self._markers = {text: f"{nonce}1{i:04d}{_CLOSE}" for i, text in enumerate(order)}
        self._nonce = nonce
        self._plain: Tokenizer | None = None
        self._marker_ids: dict[int, int] = {}

    def escape(self, content: str) -> str:
        """`content` with every special token's text replaced by its placeholder."""
        for text, placeholder in self.placeholders.items():
            if text in content:
                content = content.replace(text, placeholder)
        return content

    def escaped(self, text: str) -> bool:
        """Whether `text` holds escaped content (else it tokenizes as it always did)."""
        return self._nonce in text

    def encode(self, text: str, add_special_tokens: bool) -> tuple[list[int], Encoding]:
        """Token ids of a rendered prompt whose content was escaped, and the encoding they came from (its
        special_tokens_mask and offsets describe the same positions)."""
        for special, marker in self._markers.items():
            text = text.replace(special, marker)
        for special, placeholder in self.placeholders.items():
            text = text.replace(placeholder, special)
        encoding = encode_text(self._plain_tokenizer(), text, add_special_tokens)
        return [self._marker_ids.get(t, t) for t in encoding.ids], encoding

    def _plain_tokenizer(self) -> Tokenizer:
        if self._plain is None:
            plain = Tokenizer.from_str(self._tokenizer.to_str())
            plain.encode_special_tokens = True
            for special, marker in self._markers.items():
                token_id, token = self._specials[special]
                plain.add_tokens([AddedToken(marker, single_word=token.single_word, lstrip=token.lstrip,
                                             rstrip=token.rstrip, normalized=False, special=False)])
                marker_id = plain.token_to_id(marker)
                assert marker_id is not None  # added just above
                self._marker_ids[marker_id] = token_id
            self._plain = plain
        return self._plain
