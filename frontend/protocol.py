"""OpenAI request bodies as msgspec Structs, their validation, and OpenAI-style error bodies."""

from __future__ import annotations

import re
from typing import Any

import msgspec

from common.errors import InvalidRequestError
from common.sampling import SamplingParams


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class CompletionRequest(msgspec.Struct, kw_only=True):
    """Body of POST /v1/completions (and of a WebSocket `generate` message).

    Unknown fields are ignored, as OpenAI and vLLM do. `return_token_ids` (a vLLM extension) adds
    `prompt_token_ids` and `token_ids` to each choice. `priority` is vLLM's: lower runs sooner. `timeout`
    (seconds from arrival) ends the request with an error if it has not finished by then.
    """

    prompt: Any = None
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    priority: int = 0
    timeout: float | None = None
    return_token_ids: bool = False
    user: str | None = None


_DECODE_PATH = re.compile(r"at `\$\.([A-Za-z_]\w*)")


def decode_body(body: bytes, request_type: type) -> Any:
    """Decode a JSON body into `request_type`.

    Raises:
        InvalidRequestError: not JSON, not an object, or a field of the wrong type (named in `param`).
    """
    try:
        return msgspec.json.decode(body, type=request_type)
    except msgspec.ValidationError as exc:
        match = _DECODE_PATH.search(str(exc))
        raise InvalidRequestError(f"invalid request body: {exc}", param=match.group(1) if match else None) from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None


def prompt_token_ids(prompt: Any, encode, vocab_size: int) -> list[int]:
    """Token ids of a single prompt: a string or a list of token ids.

    Raises:
        InvalidRequestError: missing, empty, of the wrong type, or holding ids outside the vocabulary.
    """
    if prompt is None:
        raise InvalidRequestError("prompt is required", param="prompt")
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
        ids = list(prompt)
    else:
        raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
    if not ids:
        raise InvalidRequestError("prompt is empty", param="prompt")
    return ids


def sampling_params(request: CompletionRequest, num_prompt_tokens: int, max_model_len: int,
                    vocab_size: int) -> SamplingParams:
    """SamplingParams of a completion request; max_tokens defaults to what is left of max_model_len.

    Raises:
        InvalidRequestError: a parameter out of range, or prompt + max_tokens over max_model_len.
    """
    if request.timeout is not None and not 0 < request.timeout <= 86400:
        raise InvalidRequestError("timeout must be in (0, 86400] seconds", param="timeout")
    if request.n != 1:
        raise InvalidRequestError("only n=1 is supported", param="n")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens; the prompt has {num_prompt_tokens} "
            f"tokens, which leaves no room for output", param="prompt")
    max_tokens = room if request.max_tokens is None else request.max_tokens
    if max_tokens > room:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the "
            f"completion)", param="max_tokens")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p,
        top_k=0 if request.top_k == -1 else request.top_k, min_p=request.min_p, seed=request.seed,
        stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
        min_tokens=request.min_tokens)
    params.validate(vocab_size)
    return params


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               408: "timeout_error", 413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}
