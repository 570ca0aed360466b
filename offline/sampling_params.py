"""vLLM's SamplingParams for the offline LLM: its constructor, its field names and defaults, turned into the engine's
own SamplingParams (common/sampling.py) per prompt. A field shuttle does not implement is refused by name when it is
given anything but its default."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Any

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.common.generation_config import SamplingDefaults
from shuttle.common.sampling import SamplingParams as EngineSampling
from shuttle.common.sampling import logprobs_limit
from shuttle.frontend.request.protocol import stop_list

# vLLM's fields shuttle does not implement, with why (each refused unless left at its default)
UNIMPLEMENTED: dict[str, str] = {
    "detokenize": "the output is always detokenized",
    "skip_special_tokens": "special tokens are always left out of the text (their ids stay in token_ids)",
    "spaces_between_special_tokens": "special tokens are always left out of the text",
    "logits_processors": "custom logits processors are not implemented",
    "truncate_prompt_tokens": "prompts are not truncated: a prompt too long for max_model_len is refused",
    "output_kind": "outputs are returned whole when every prompt has finished",
    "structured_outputs": "structured outputs are served by shuttle serve's response_format, not offline",
    "guided_decoding": "structured outputs are served by shuttle serve's response_format, not offline",
    "allowed_token_ids": "allowed_token_ids is not implemented (logit_bias can favour tokens)",
    "bad_words": "bad_words is not implemented",
    "extra_args": "extra_args is not implemented",
}
_DEFAULTS = {"detokenize": True, "skip_special_tokens": True, "spaces_between_special_tokens": True}


@dataclass
class SamplingParams:
    """How to sample each prompt's outputs: vLLM's SamplingParams (same names, order and defaults).

    Attributes:
        n: outputs per prompt (CompletionOutput.index 0..n-1); with a seed, output j samples with seed + j.
        best_of: only None or n (shuttle returns every sequence it samples).
        temperature, top_p, top_k, min_p: as common/sampling.py's fields (temperature 0: greedy; top_k 0 or -1: off).
        seed: a per-request generator's seed: the same outputs in any batch.
        stop: strings that end an output (left out of its text unless include_stop_str_in_output).
        stop_token_ids: ids that end an output besides end-of-sequence; ignore_eos: generate past end-of-sequence.
        max_tokens: most output tokens (None: up to max_model_len); min_tokens: no stop of any kind before this many.
        logprobs: the sampled token's and this many most likely tokens' log-probabilities per output token.
        prompt_logprobs: the same for every prompt token after the first (-1: the whole vocabulary, which must be
            within max_logprobs, as vLLM).
        presence_penalty, frequency_penalty, repetition_penalty, logit_bias ({token id: bias}): as OpenAI / vLLM.
        include_stop_str_in_output: keep the stop string that ended an output in its text.
        the others (UNIMPLEMENTED): refused unless left at their default.
    Raises:
        ValueError: a field of UNIMPLEMENTED set, best_of other than n, or a value out of range (naming it).
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: Any = None
    structured_outputs: Any = None
    guided_decoding: Any = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        try:  # each field's type as the server's request Struct types it: no 2.5 tokens, no True for a count
            msgspec.convert({f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, _field_types(),
                            strict=True)
        except msgspec.ValidationError as exc:
            raise ValueError(f"SamplingParams: {exc}") from None
        for name, why in UNIMPLEMENTED.items():
            if getattr(self, name) != _DEFAULTS.get(name):
                raise ValueError(f"{name}: shuttle does not implement it: {why}")
        if self.n < 1:  # an int: checked above
            raise ValueError(f"n must be at least 1, got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of: shuttle does not implement it: every sequence sampled is returned (best_of "
                             f"{self.best_of} differs from n {self.n})")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        self.stop_strings  # noqa: B018 (checked now, not when the first prompt runs)
        self.engine_params(prompt_len=0, max_model_len=2**31 - 1, vocab_size=2**31 - 1, max_logprobs=2**31 - 1)

    @property
    def stop_strings(self) -> list[str]:
        """`stop` as a list (vLLM takes one string or several). Raises ValueError as the server refuses a `stop`."""
        try:
            return stop_list(self.stop)
        except InvalidRequestError as exc:
            raise ValueError(str(exc)) from None

    def engine_params(self, prompt_len: int, max_model_len: int, vocab_size: int,
                      max_logprobs: int) -> EngineSampling:
        """The engine's SamplingParams of one prompt of `prompt_len` tokens (max_tokens None: what max_model_len
        leaves; more than that ends at max_model_len with finish_reason "length", as vLLM's offline engine does).

        Raises:
            ValueError: a value out of range for this model (naming the field).
        """
        max_tokens = self.max_tokens if self.max_tokens is not None else max(max_model_len - prompt_len, 1)
        prompt_k = _prompt_logprobs_k(self.prompt_logprobs, vocab_size, max_logprobs)
        params = EngineSampling(
            max_tokens=max_tokens, temperature=float(self.temperature), top_p=float(self.top_p),
            top_k=0 if self.top_k == -1 else self.top_k, min_p=float(self.min_p), seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            presence_penalty=float(self.presence_penalty), frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logit_bias=tuple((int(t), float(b)) for t, b in (self.logit_bias or {}).items()),
            logprobs=self.logprobs, prompt_logprobs=prompt_k)
        try:
            params.validate(vocab_size, max_logprobs)
        except InvalidRequestError as exc:
            raise ValueError(str(exc)) from None
        return params

    @staticmethod
    def from_defaults(defaults: SamplingDefaults) -> "SamplingParams":
        """vLLM's LLM.get_default_sampling_params: the model's generation_config.json values (--generation-config)
        over SamplingParams' own defaults."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{name: value for name, value in defaults.named().items() if name in fields})


@functools.cache
def _field_types() -> type[msgspec.Struct]:
    """SamplingParams' fields as a msgspec Struct of their annotated types, to check a value strictly (a bool is no
    count, 2.5 no token count); the fields of UNIMPLEMENTED take anything there and are refused by name after."""
    hints = typing.get_type_hints(SamplingParams)
    return msgspec.defstruct("SamplingParamsTypes", [(f.name, Any if f.name in UNIMPLEMENTED else hints[f.name],
                                                      f.default) for f in dataclasses.fields(SamplingParams)],
                             forbid_unknown_fields=True)


def _prompt_logprobs_k(value: int | None, vocab_size: int, max_logprobs: int) -> int | None:
    """How many alternatives per prompt token the engine lists for SamplingParams.prompt_logprobs `value` (-1: the
    whole vocabulary, vLLM's sentinel, which the server's prompt_logprobs takes too).

    Raises:
        ValueError: `value` below -1, or more alternatives than common.sampling.logprobs_limit; the message states
            the range this model and max_logprobs allow.
    """
    if value is None:
        return None
    cap = logprobs_limit(max_logprobs, vocab_size)
    k = vocab_size if value == -1 else value
    if 0 <= k <= cap:
        return k
    if cap == vocab_size:
        raise ValueError(f"prompt_logprobs must be -1 (the whole vocabulary) or in [0, {cap}], got {value}")
    raise ValueError(f"prompt_logprobs must be in [0, {cap}] (max_logprobs {max_logprobs}; -1, the whole vocabulary "
                     f"of {vocab_size} tokens, is over it), got {value}")
