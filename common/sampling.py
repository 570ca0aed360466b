"""Sampling parameters of one request, validated in the frontend and carried on the wire."""

from __future__ import annotations

import msgspec

from common.errors import InvalidRequestError


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """How to pick each next token of a request.

    Attributes:
        max_tokens: most output tokens to generate.
        temperature: 0 means greedy (argmax); otherwise logits are divided by it.
        top_p: keep the smallest set of tokens whose probability sums to at least top_p (1 = off).
        top_k: keep the k most likely tokens (0 = off).
        min_p: drop tokens whose probability is below min_p times the top token's (0 = off).
        seed: seeds a per-request generator so the request samples the same tokens in any batch.
        stop_token_ids: ids that end the request besides the model's end-of-sequence ids.
        ignore_eos: keep generating past end-of-sequence ids.
        min_tokens: end-of-sequence and stop ids are not honoured before this many output tokens.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError (naming the parameter) for a value out of range."""
        checks = (
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0 or self.top_k == -1, "must be -1, 0 (off) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**64, "must fit in 64 bits"),
            ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids),
             f"must be token ids in [0, {vocab_size})"),
        )
        for param, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {why}", param=param)
