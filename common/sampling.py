"""Sampling parameters of one request, validated in the frontend and carried on the wire."""

from __future__ import annotations

import msgspec

from shuttle.common.errors import InvalidRequestError


def seed_fits(seed: int) -> bool:
    """Whether `seed` fits in 64 bits, signed or not (-2**63 to 2**64 - 1): what torch.Generator.manual_seed takes,
    for a request's `seed` and the server's --seed alike."""
    return -(2**63) <= seed < 2**64

MAX_LOGPROBS = 20  # most alternatives per token, as OpenAI's top_logprobs


def logprobs_limit(max_logprobs: int, vocab_size: int) -> int:
    """Most alternatives per token a request may ask for (logprobs, top_logprobs, prompt_logprobs): the server's
    --max-logprobs, -1 meaning no cap (vLLM's), and never more than the vocabulary (the worker's top-k lists at most
    `vocab_size`)."""
    return vocab_size if max_logprobs < 0 else min(max_logprobs, vocab_size)

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True, kw_only=True):
    """A constraint on a request's output, compiled by the worker with xgrammar (worker/grammar.py) and enforced by
    masking the logits of every sampled token to what the grammar allows (end-of-sequence only where it may end).

    Attributes:
        kind: "json" (spec: a JSON schema, as JSON text), "json_object" (any JSON object; spec ""), "regex" (spec: a
            regular expression the whole output matches), "choice" (spec: a JSON list of the strings allowed), or
            "grammar" (spec: an EBNF grammar in xgrammar's GBNF dialect, rule `root` first).
        spec: the kind's text, normalized by the frontend so that equal constraints have equal keys.
        starts_after: a token id: the output is free up to and including the first such token, and the grammar
            governs what follows (a reasoning model's end-of-thinking token: frontend/reasoning/); None: the grammar
            governs the whole output. Not part of `key`: the compiled grammar is the same.
    """

    kind: str
    spec: str = ""
    starts_after: int | None = None

    @property
    def key(self) -> str:
        """What compiled grammars are cached under: equal keys compile to the same grammar."""
        return f"{self.kind}\n{self.spec}"


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True, kw_only=True):
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
        min_tokens: end-of-sequence and stop ids are masked out until this many output tokens exist.
        presence_penalty: subtracted from the logit of every token already in the output (OpenAI).
        frequency_penalty: subtracted once per earlier occurrence in the output (OpenAI).
        repetition_penalty: logits of tokens in prompt or output are divided by it when positive and
            multiplied when negative (CTRL, Keskar et al. 2019; as in transformers). 1 = off.
        logit_bias: (token id, bias) pairs added to the logits before sampling (OpenAI, bias in [-100, 100]).
        logprobs: None for no log-probabilities; k >= 0 returns the sampled token's and the k most likely.
        prompt_logprobs: like logprobs, for every prompt token after the first (vLLM's prompt_logprobs, and
            completions' echo + logprobs), at most the vocabulary. Such a request bypasses the prefix cache: cached
            tokens have no logits.
        structured: the grammar every output token must follow (None: unconstrained).
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        # Below 1e-5 (vLLM's _SAMPLING_EPS) dividing by the temperature overflows: treat it as greedy.
        return self.temperature < 1e-5

    def validate(self, vocab_size: int, max_logprobs: int = MAX_LOGPROBS) -> None:
        """Raise InvalidRequestError (naming the parameter) for a value out of range (`max_logprobs`: the server's
        --max-logprobs)."""
        cap = logprobs_limit(max_logprobs, vocab_size)
        checks = (
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 100.0, "must be in [0, 100]"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", -1 <= self.top_k < 2**31, "must be -1 or 0 (off), or a positive count below 2**31"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("min_tokens", 0 <= self.min_tokens <= self.max_tokens, "must be in [0, max_tokens]"),
            ("seed", self.seed is None or seed_fits(self.seed), "must fit in 64 bits"),
            ("stop_token_ids", all(0 <= t < vocab_size for t in self.stop_token_ids),
             f"must be token ids in [0, {vocab_size})"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "must be in (0, 10]"),
            ("logit_bias", all(0 <= t < vocab_size and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
             f"keys must be token ids in [0, {vocab_size}) and values in [-100, 100]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= cap, f"must be in [0, {cap}]"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= cap,
             f"must be in [0, {cap}]"),
        )
        for param, ok, why in checks:
            if not ok:
                raise InvalidRequestError(f"{param} {why}", param=param)
