"""OpenAI request bodies as msgspec Structs: what each endpoint takes, with its defaults (validation is
frontend/request/decoding.py and params.py; error bodies frontend/request/errors.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.tools.request import MessageToolCall, Tool, ToolChoice

MAX_N = 16  # most choices per request
MAX_STOP_STRINGS = 16


def stop_list(stop: str | list[str] | None) -> list[str]:
    """A request's `stop` (one string, several, or none) as a list.

    Raises:
        InvalidRequestError: an empty string, or more than MAX_STOP_STRINGS (param "stop").
    """
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise InvalidRequestError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                                  param="stop")
    return stops
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
    include_stop_str_in_output, return_token_ids (adds prompt_token_ids and token_ids to each choice),
    prompt_logprobs (k, or -1 for the whole vocabulary: each prompt token's logprob and the k most likely;
    frontend/completions/prompt_logprobs.py), return_tokens_as_token_ids (logprobs name tokens "token_id:ID"; unset:
    as --return-tokens-as-token-ids says).
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
    return_tokens_as_token_ids: bool | None = None
    prompt_logprobs: int | None = None
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
        return stop_list(self.stop)


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
    error names the message). A `tool` message answers the call named by `tool_call_id`. `reasoning` (vLLM's) or
    `reasoning_content` (DeepSeek's): an earlier answer's thinking, as a reasoning model's response had it, handed to
    the template under both names (Qwen3's renders it for the turns after the last user message)."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


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
    include_reasoning: bool = True  # vLLM's: false leaves a reasoning model's thinking out of the response


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
