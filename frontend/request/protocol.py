"""OpenAI request bodies as msgspec Structs, their validation, and OpenAI-style error bodies."""

from __future__ import annotations

import json
import math
import re
from typing import Any, NamedTuple, overload

import msgspec

from shuttle.common.errors import GenerationError, InvalidRequestError, ModelNotFoundError
from shuttle.common.generation_config import SamplingDefaults
from shuttle.common.sampling import MAX_LOGPROBS, SamplingParams, StructuredOutput
from shuttle.frontend.request.integral_floats import integral_floats_as_ints
from shuttle.frontend.tools.request import MessageToolCall, Tool, ToolChoice

MAX_N = 16  # most choices per request
MAX_PROMPTS = 64  # most prompts in one completions request


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """`include_usage`: a last chunk with the usage; vLLM's `continuous_usage_stats` (with include_usage): the usage
    so far on every chunk too."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format.json_schema`: `name` ([a-zA-Z0-9_-]{1,64}) is required; `schema` (a JSON Schema
    object) is optional, as in OpenAI's reference, and without it the output is any JSON object. `strict` and
    `description` are taken and change nothing: the output always follows the schema exactly, and the description
    is not put into the prompt."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class ResponseFormatText(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """`{"type": "text"}`: no constraint (OpenAI's default)."""


class ResponseFormatJsonObject(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    """`{"type": "json_object"}`: the output is one JSON object (OpenAI's JSON mode)."""


class ResponseFormatJsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", forbid_unknown_fields=True):
    """`{"type": "json_schema", "json_schema": {...}}`: the output follows the schema (OpenAI's Structured Outputs)."""

    json_schema: JsonSchemaFormat


ResponseFormat = ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema


class StructuredOutputsFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` object: exactly one of `json` (a JSON Schema, as an object or as JSON text),
    `regex`, `choice` (a list of strings), `grammar` (EBNF in xgrammar's GBNF dialect) or `json_object` (true).

    The other keys of vLLM's StructuredOutputsParams (and of its older GuidedDecodingParams) are declared so that a
    request naming one is refused with the reason (frontend/structured/request.py) rather than as unknown; any
    value but null is refused."""

    json: str | dict[str, Any] | bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_any_whitespace: Any = None
    disable_additional_properties: Any = None
    disable_fallback: Any = None
    backend: Any = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields both completion endpoints share. A field no request Struct declares is refused (see REFUSED_FIELDS).

    vLLM extensions: top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, min_tokens, priority,
    include_stop_str_in_output, return_token_ids (adds prompt_token_ids and token_ids to each choice).
    Structured outputs (frontend/structured/request.py, at most one per request): OpenAI's `response_format`
    (text, json_object, json_schema), vLLM's `structured_outputs` object and its older top-level `guided_json`,
    `guided_regex`, `guided_choice`, `guided_grammar` (`guided_decoding_backend`: "xgrammar" or "auto" only).
    temperature, top_p, top_k, min_p, repetition_penalty and max_tokens left unset (or null) take the model's
    generation_config.json default (common/generation_config.py, --generation-config), else SamplingParams' own.
    `timeout` (seconds from arrival) ends the request with an error (HTTP 408) if it has not finished by then.
    `ttft_slo_ms` is the request's own TTFT objective: refused at once (HTTP 503) when predicted to be missed.
    OpenAI's metadata-only fields (`user`, `metadata`, `store`, `service_tier`, `safety_identifier`,
    `prompt_cache_key`) are accepted and change nothing (nothing is stored).
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    timeout: float | None = None
    ttft_slo_ms: float | None = None
    return_token_ids: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool = False
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 16 or any(not s for s in stops):
            raise InvalidRequestError("stop must be a non-empty string or a list of at most 16 of them", param="stop")
        return stops


class CompletionRequest(SamplingFields, kw_only=True):
    """Body of POST /v1/completions (and of a WebSocket `generate` message).

    `prompt`: a string, a list of strings, a list of token ids, or a list of lists of token ids.
    `logprobs`: an integer k, the sampled token's logprob plus the k most likely; `echo` prepends the prompt.
    `add_special_tokens` (vLLM): whether the tokenizer adds its special tokens (BOS) to a text prompt.
    """

    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(msgspec.Struct, kw_only=True):
    """One message; `content` is required but beside an assistant's `tool_calls` (checked when rendering, so that the
    error names the message). A `tool` message answers the call named by `tool_call_id`."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """Body of POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name for max_tokens.

    vLLM extensions for the prompt (also taken by POST /tokenize with messages): add_generation_prompt,
    continue_final_message, chat_template_kwargs (see ChatTemplate.render), add_special_tokens (false: the chat
    template writes the special tokens it wants). Ours: parse_special_tokens_in_content (false: special-token text
    in message content is ordinary text; see frontend/request/special_text.py).
    """

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    parse_special_tokens_in_content: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """Body of POST /tokenize: `prompt` or `messages` (with the chat prompt fields of ChatCompletionRequest).
    `add_special_tokens` defaults to true for a prompt and false for messages, as in vLLM; `tools` reach the chat
    template as in a chat request; `return_token_strs` adds each token's vocabulary entry (vLLM's `token_strs`)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    parse_special_tokens_in_content: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


class Refused(NamedTuple):
    """Why a request field of OpenAI's or vLLM's schema is refused, and the one value taken all the same because it
    asks for what shuttle does anyway (None: every value is refused)."""

    why: str
    accepted: Any = None


_FUNCTIONS = 'OpenAI\'s deprecated form of tools: use tools ([{"type": "function", "function": {...}}])'
_NOT_IMPLEMENTED = "not implemented"
# Fields of OpenAI's and vLLM's request schemas that shuttle does not implement. A body holding one that its
# request Struct does not declare gets 400 naming it (so `echo` is refused on chat only), rather than being served
# as if it had not been sent: a caller must never believe its output was constrained when it was not. A field
# neither declared nor listed here is refused as unrecognized, as OpenAI's API does.
REFUSED_FIELDS: dict[str, Refused] = {
    "guided_whitespace_pattern": Refused("JSON whitespace is the grammar engine's own (xgrammar)"),
    "structural_tag": Refused("structural tags are not implemented"),
    "functions": Refused(_FUNCTIONS),
    "function_call": Refused("OpenAI's deprecated form of tool_choice: use tool_choice"),
    "chat_template": Refused("the server renders every chat with its own template (--chat-template at startup)"),
    "documents": Refused(_NOT_IMPLEMENTED),
    "use_beam_search": Refused("beam search is not implemented", False),
    "length_penalty": Refused("beam search is not implemented"),
    "echo": Refused("only /v1/completions echoes the prompt", False),
    "prompt_logprobs": Refused("prompt logprobs come from /v1/completions with echo and logprobs"),
    "allowed_token_ids": Refused(_NOT_IMPLEMENTED),
    "bad_words": Refused(_NOT_IMPLEMENTED),
    "truncate_prompt_tokens": Refused("prompts are never truncated: one too long for the context gets 400"),
    "skip_special_tokens": Refused("special tokens are always left out of the text", True),
    "spaces_between_special_tokens": Refused(_NOT_IMPLEMENTED),
    "return_tokens_as_token_ids": Refused("return_token_ids lists the token ids"),
    "logits_processors": Refused(_NOT_IMPLEMENTED),
    "request_id": Refused("the server names each response (the x-request-id header carries a client's own id)"),
    "cache_salt": Refused(_NOT_IMPLEMENTED),
    "kv_transfer_params": Refused(_NOT_IMPLEMENTED),
    "vllm_xargs": Refused(_NOT_IMPLEMENTED),
    "mm_processor_kwargs": Refused("only text is served"),
    "prompt_embeds": Refused("only text and token id prompts are served"),
    "modalities": Refused("only text is served"),
    "audio": Refused("only text is served"),
    "prediction": Refused(_NOT_IMPLEMENTED),
    "web_search_options": Refused(_NOT_IMPLEMENTED),
    "reasoning_effort": Refused(_NOT_IMPLEMENTED),
    "verbosity": Refused(_NOT_IMPLEMENTED),
    "include_reasoning": Refused(_NOT_IMPLEMENTED),
}


def refuse_undeclared(data: dict, request_type: type[msgspec.Struct]) -> None:
    """Refuse the first field of `data` (nulls already dropped) that `request_type` does not declare, unless it is
    a REFUSED_FIELDS entry holding its accepted value (`"echo": false` on chat, `"skip_special_tokens": true`).

    Raises:
        InvalidRequestError: the field (named in `param`) is not implemented, or not a field at all.
    """
    declared = request_type.__struct_fields__
    for name, value in data.items():
        if name in declared:
            continue
        if not isinstance(name, str):  # a msgpack map (the batch endpoint) may have other keys
            raise InvalidRequestError(f"request field names must be strings, got {type(name).__name__}")
        refused = REFUSED_FIELDS.get(name)
        if refused is None:
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name}", param=name)
        accepted = refused.accepted
        if accepted is not None and type(value) is type(accepted) and value == accepted:
            continue
        what = f"supported only as {json.dumps(accepted)}" if accepted is not None else "not supported"
        raise InvalidRequestError(f"{name} is {what}: {refused.why}", param=name)


_DECODE_PATH = re.compile(r"(?:at|in) `\$\.([A-Za-z_]\w*)")  # "at `$.n`", "at `key` in `$.logit_bias`"
_MISSING_FIELD = re.compile(r"missing required field `([A-Za-z_]\w*)`")


def decode_body(body: bytes, request_type: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into `request_type` (see convert_body).

    Raises:
        InvalidRequestError: not JSON, not an object, or a field of the wrong type (named in `param`).
    """
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply") from None
    return convert_body(data, request_type)


def convert_body(data: Any, request_type: type[msgspec.Struct]) -> Any:
    """Convert an already parsed body (from JSON or msgpack) into `request_type`.

    An explicit `null` for a top-level field means the same as leaving the field out: OpenAI's schema makes its
    optional fields nullable, and clients send null for "default" (the official Python client with
    `temperature=None`). So every default lives in one place, the Struct's field declaration. A field typed as an
    integer takes an integral float (`"n": 1.0`, as OpenAI does; frontend/request/integral_floats.py), never 1.5 or "1".
    A field `request_type` does not declare is refused (refuse_undeclared), whatever the transport.

    Raises:
        InvalidRequestError: not an object, a field of the wrong type, not implemented or unknown (named in `param`).
    """
    if isinstance(data, dict):
        data = {name: value for name, value in data.items() if value is not None}
        refuse_undeclared(data, request_type)
    try:
        return msgspec.convert(integral_floats_as_ints(data, request_type), type=request_type)
    except msgspec.ValidationError as exc:
        match = _DECODE_PATH.search(str(exc)) or _MISSING_FIELD.search(str(exc))
        raise InvalidRequestError(f"invalid request body: {exc}", param=match.group(1) if match else None) from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply") from None


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t,
                                                                                                 bool) for t in value)


def _integral_ids(prompt: Any) -> Any:
    """A prompt of token ids (or of lists of them, the two shapes that hold ids) with integral floats made ints,
    as every integer field takes them; deeper lists are left for completion_prompts to refuse."""
    def ints(values: list) -> list:
        if float not in map(type, values):
            return values  # the common case: one pass at C speed, no copy
        return [int(v) if type(v) is float and v.is_integer() else v for v in values]

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
                    defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
    """SamplingParams of one prompt of a request; max_tokens defaults to what is left of max_model_len (at most
    `defaults.max_tokens`). `defaults`: the model's generation_config.json values for the fields the request leaves
    unset; a field neither sets keeps SamplingParams' default.
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
    """`value` unless it is outside [0, limit] (the server's --max-logprobs). Raises InvalidRequestError."""
    if value is not None and not 0 <= value <= limit:
        raise InvalidRequestError(f"{param} must be in [0, {limit}]", param=param)
    return value


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
               503: "service_unavailable_error"}


@overload
def client_error(exc: InvalidRequestError | ModelNotFoundError | GenerationError) -> tuple[int, str | None]: ...
@overload
def client_error(exc: BaseException) -> tuple[int, str | None] | None: ...
def client_error(exc: BaseException) -> tuple[int, str | None] | None:
    """(HTTP status, param) for an error that is the client's to see, or None for an internal failure.

    The one mapping shared by HTTP, the WebSocket and the batch endpoint.
    """
    if isinstance(exc, InvalidRequestError):
        return 400, exc.param
    if isinstance(exc, ModelNotFoundError):
        return 404, "model"
    if isinstance(exc, GenerationError):
        return exc.status, exc.param
    return None


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}
