"""A decoded request into what the engine runs: each completions prompt as token ids, and the SamplingParams of a
prompt, with every range checked and the model's generation defaults applied."""

from __future__ import annotations

import math
from typing import Any

from shuttle.common.errors import InvalidRequestError
from shuttle.common.generation_config import SamplingDefaults
from shuttle.common.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput
from shuttle.frontend.request.integral_floats import integral
from shuttle.frontend.request.protocol import MAX_N, MAX_PROMPTS, SamplingFields


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and \
        all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _integral_ids(prompt: Any) -> Any:
    """A prompt of token ids (or of lists of them, the two shapes that hold ids) with integral floats made ints,
    as every integer field takes them; deeper lists are left for completion_prompts to refuse."""
    def ints(values: list) -> list:
        if float not in map(type, values):
            return values  # the common case: one pass at C speed, no copy
        return [int(v) if type(v) is float and integral(v) else v for v in values]

    if not isinstance(prompt, list):
        return prompt
    return [ints(p) if isinstance(p, list) else p for p in ints(prompt)]


def completion_prompts(prompt: Any, tokenizer, max_model_len: int, add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each prompt of a completions request (`add_special_tokens` applies to text prompts only).

    Raises:
        InvalidRequestError: missing, empty, of the wrong type, too many, or holding ids outside the vocabulary.
    """
    if prompt is None:
        raise InvalidRequestError("prompt is required", param="prompt")
    prompt = _integral_ids(prompt)
    if isinstance(prompt, str) or _is_token_list(prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_token_list(p) for p in prompt):
        prompts = prompt
    else:
        raise InvalidRequestError("prompt must be a string, a list of strings, a list of token ids or a list of "
                                  "lists of token ids (no list empty)", param="prompt")
    if len(prompts) > MAX_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
    result = []
    for p in prompts:
        ids = tokenizer.encode(p, add_special_tokens, max_model_len) if isinstance(p, str) else list(p)
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if not all(0 <= t < tokenizer.vocab_size for t in ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {tokenizer.vocab_size})", param="prompt")
        result.append(ids)
    return result


def sampling_params(request: SamplingFields, num_prompt_tokens: int, max_model_len: int, vocab_size: int,
                    max_tokens: int | None, logprobs: int | None, prompt_param: str = "prompt",
                    prompt_logprobs: int | None = None, max_tokens_param: str = "max_tokens",
                    max_logprobs: int = MAX_LOGPROBS, structured: StructuredOutput | None = None,
                    defaults: SamplingDefaults = SamplingDefaults(), kv_tokens: int | None = None) -> SamplingParams:
    """SamplingParams of one prompt of a request; max_tokens defaults to what is left of max_model_len (at most
    `defaults.max_tokens`, and of `kv_tokens`, the whole KV cache, where that is smaller: a server started with less
    cache than max_model_len would refuse a default no request could fit). `defaults`: the model's
    generation_config.json values for the fields the request leaves unset; a field neither sets keeps
    SamplingParams' default.
    `max_tokens_param` is the field the request gave it in (chat's max_completion_tokens), for errors.
    `structured`: the output constraint (frontend/structured/request.py, or the tools' for tool_choice).

    Raises:
        InvalidRequestError: a parameter out of range, or prompt + max_tokens over max_model_len.
    """
    if request.timeout is not None and not 0 < request.timeout <= 86400:
        raise InvalidRequestError("timeout must be in (0, 86400] seconds", param="timeout")
    if request.ttft_slo_ms is not None and not 0 < request.ttft_slo_ms <= 86_400_000:
        raise InvalidRequestError("ttft_slo_ms must be in (0, 86400000] milliseconds", param="ttft_slo_ms")
    if not -(2**31) <= request.priority < 2**31:
        raise InvalidRequestError("priority must fit in 32 bits", param="priority")
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options is only allowed with stream: true", param="stream_options")
    if request.stream_options is not None and request.stream_options.continuous_usage_stats and \
            not request.stream_options.include_usage:
        raise InvalidRequestError("stream_options.continuous_usage_stats needs include_usage: true (as in vLLM)",
                                  param="stream_options")
    if not 1 <= request.n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}]", param="n")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        if getattr(request, name) is not None and not math.isfinite(getattr(request, name)):
            raise InvalidRequestError(f"{name} must be a finite number", param=name)
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens} "
            f"tokens, which leaves no room for output", param=prompt_param)
    if max_tokens is None:
        if kv_tokens is not None and 1 <= kv_tokens - num_prompt_tokens < room:
            room = kv_tokens - num_prompt_tokens
        max_tokens = min(room, defaults.max_tokens or room)
    elif max_tokens < 1:
        raise InvalidRequestError(f"{max_tokens_param} must be at least 1", param=max_tokens_param)
    elif max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion)", param=max_tokens_param)
    # each field: the request's value, else the model's default, else (left out) SamplingParams'
    given = {name: getattr(request, name) for name in DEFAULTED if getattr(request, name) is not None}
    chosen = {name: value for name, value in defaults.named().items() if name in DEFAULTED} | given
    if chosen.get("top_k") == -1:
        chosen["top_k"] = 0
    params = SamplingParams(
        max_tokens=max_tokens, **chosen, seed=request.seed,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logit_bias=_logit_bias(request.logit_bias), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        structured=structured)
    params.validate(vocab_size, max_logprobs)
    return params


# the request fields whose default a generation_config.json may set (max_tokens aside: it caps the room left)
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    if not all(token.isascii() and token.isdigit() and str(int(token)) == token for token in bias):
        raise InvalidRequestError("logit_bias keys must be token ids written as plain decimal numbers",
                                  param="logit_bias")
    pairs = tuple((int(token), float(value)) for token, value in bias.items())
    if not all(math.isfinite(v) for _, v in pairs):
        raise InvalidRequestError("logit_bias values must be finite", param="logit_bias")
    return pairs


def check_logprobs(value: int | None, param: str, limit: int = MAX_LOGPROBS) -> int | None:
    """`value` unless it is outside [0, limit] (common.sampling.logprobs_limit: the server's --max-logprobs within
    the vocabulary). Raises InvalidRequestError."""
    if value is not None and not 0 <= value <= limit:
        raise InvalidRequestError(f"{param} must be in [0, {limit}]", param=param)
    return value
