"""The request side of POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API): the bodies as
Structs, the fields refused by name, and the request as the chat request that asks for the same:

    system (a string or text blocks)         a system message first
    messages[i] text blocks                  that turn's content (text parts, joined as chat joins them)
    an assistant's tool_use blocks           its tool_calls (input as the arguments' JSON text)
    an assistant's thinking blocks           left out (reasoning models' templates drop earlier thinking)
    a user's tool_result blocks              tool messages answering tool_use_id, in order, before its text
    a last assistant message (prefill)       continued: continue_final_message, no generation prompt
    tools (name, description, input_schema)  function tools
    tool_choice auto / any / tool / none     "auto" / "required" / the named function / "none"
    disable_parallel_tool_use                parallel_tool_calls false
    stop_sequences, max_tokens, temperature, top_p, top_k    the chat fields of the same meaning
    output_config.format (json_schema)       response_format json_schema

`metadata` (`user_id` only), `service_tier` (auto, standard_only), `user_profile_id`, `workspace_id` and
`cache_control` (top-level, on blocks and tools) are taken and change nothing (the prefix cache is automatic). A text
block must hold text, as Anthropic's API has it. Content shuttle does not serve (images, documents,
server tools, ...) and the `thinking` option are refused by name.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.request.decoding import Refused
from shuttle.frontend.request.field_names import told_as
from shuttle.frontend.request.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormatJsonSchema,
)
from shuttle.frontend.tools.request import (
    NAME_PATTERN,
    CalledFunction,
    FunctionDefinition,
    FunctionName,
    MessageToolCall,
    NamedToolChoice,
    Tool,
    ToolChoice,
)

# ---- the request -------------------------------------------------------------------------------------------------

class ToolChoiceParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`tool_choice`: {"type": "auto" | "any" | "tool" | "none", "name" (type "tool" only),
    "disable_parallel_tool_use"}."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class OutputFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`output_config.format`: the answer is JSON following `schema`."""

    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: OutputFormat | None = None
    effort: Any = None  # refused unless null (a reasoning model's option)


class MessageParam(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One turn: `content` a string or a list of content blocks (checked when converted, to name the block)."""

    role: Literal["user", "assistant"]
    content: str | list[Any]


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """Body of POST /v1/messages/count_tokens: the prompt side of a Messages request. `cache_control`,
    `user_profile_id` and `workspace_id` are taken and change nothing (the prefix cache is automatic).

    The fields after `workspace_id` are in Anthropic's schema and not implemented: a body that sets one (to anything
    but the value in REFUSED, which asks for what shuttle does anyway) gets 400 naming it.
    """

    model: str
    messages: list[MessageParam]
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: ToolChoiceParam | None = None
    cache_control: dict[str, Any] | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # refused (REFUSED)
    thinking: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    container: Any = None
    output_format: Any = None
    speed: Any = None
    inference_geo: Any = None
    diagnostics: Any = None


class Metadata(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Anthropic's request metadata: an opaque id of the end user (taken, changes nothing)."""

    user_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """Body of POST /v1/messages. `max_tokens` is required, as in Anthropic's API; `model` must name the served
    model. `metadata` and `service_tier` are taken and change nothing."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None  # Anthropic's range, not OpenAI's 0-2
    top_p: float | None = None
    top_k: int | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None


_NOT_IMPLEMENTED = "not implemented"
REFUSED: dict[str, Refused] = {
    "thinking": Refused("extended thinking is not implemented"),
    "mcp_servers": Refused("MCP connectors are not implemented: list the functions in tools"),
    "context_management": Refused(_NOT_IMPLEMENTED),
    "container": Refused("code execution containers are not implemented"),
    "output_format": Refused("use output_config.format"),
    "speed": Refused("there is one speed", "standard"),
    "inference_geo": Refused("inference runs on this server"),
    "diagnostics": Refused(_NOT_IMPLEMENTED),
}


def refusals(body: CountTokensRequest) -> None:
    """Raises InvalidRequestError naming the first field of REFUSED that `body` sets to other than its accepted
    value, or output_config.effort."""
    for name, refused in REFUSED.items():
        value = getattr(body, name)
        if value is None or (refused.accepted is not None and value == refused.accepted):
            continue
        what = f"supported only as {json.dumps(refused.accepted)}" if refused.accepted is not None else \
            "not supported"
        raise InvalidRequestError(f"{name} is {what}: {refused.why}", param=name)
    config = getattr(body, "output_config", None)
    if config is not None and config.effort is not None:
        raise InvalidRequestError("output_config.effort is not supported: reasoning effort is not implemented",
                                  param="output_config")


# ---- content blocks to chat messages -----------------------------------------------------------------------------

class _TextBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text"]
    text: Annotated[str, msgspec.Meta(min_length=1)]  # Anthropic refuses an empty text block
    cache_control: Any = None
    citations: None = None  # citations of documents: none are served, so only null


class _ToolUseBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Any = None


class _ToolResultBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Any] = ""
    is_error: bool = False  # the chat template sees the result's text only
    cache_control: Any = None


class _ThinkingBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["thinking"]
    thinking: str
    signature: str = ""


class _RedactedThinkingBlock(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["redacted_thinking"]
    data: str


_BLOCKS: dict[str, type[msgspec.Struct]] = {"text": _TextBlock, "tool_use": _ToolUseBlock,
                                            "tool_result": _ToolResultBlock, "thinking": _ThinkingBlock,
                                            "redacted_thinking": _RedactedThinkingBlock}
_SERVED_IN = {"user": ("text", "tool_result"), "system": ("text",),
              "assistant": ("text", "tool_use", "thinking", "redacted_thinking")}


def _block(where: str, data: Any, role: str) -> Any:
    """Content block `data` at `where` (e.g. "messages[1].content[0]") of a `role` turn, as its Struct.

    Raises:
        InvalidRequestError: not an object, of a type not served (in this role) or malformed (param "messages", or
            "system" for the system blocks).
    """
    param = "system" if role == "system" else "messages"
    if not isinstance(data, dict):
        raise InvalidRequestError(f"{where} must be a content block (an object with a type)", param=param)
    kind = data.get("type")
    served = _SERVED_IN[role]
    if kind not in served:
        what = f"{', '.join(served[:-1])} and {served[-1]}" if len(served) > 1 else served[0]
        raise InvalidRequestError(f"{where} is of type {kind!r}: in {'an' if role == 'assistant' else 'a'} {role} "
                                  f"{'prompt' if role == 'system' else 'turn'}"
                                  f" only {what} blocks are served (images, documents and server tools are not "
                                  f"implemented)", param=param)
    try:
        return msgspec.convert({k: v for k, v in data.items() if v is not None}, _BLOCKS[kind])
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"{where} is not a valid {kind} block: {exc}", param=param) from None


def _text_parts(where: str, content: str | list[Any], role: str) -> str | list[dict[str, Any]]:
    """A text-only content (system, a tool result) as chat content: the string, or its blocks as text parts."""
    if isinstance(content, str):
        return content
    blocks = [_block(f"{where}[{j}]", data, role if role == "system" else "user") for j, data in enumerate(content)]
    for j, block in enumerate(blocks):
        if not isinstance(block, _TextBlock):
            raise InvalidRequestError(f"{where}[{j}] is of type {block.type!r}: only text blocks are served here",
                                      param="system" if role == "system" else "messages")
    return [{"type": "text", "text": block.text} for block in blocks]


def chat_messages(system: str | list[Any] | None, messages: list[MessageParam]) -> list[ChatMessage]:
    """The chat messages of `system` and `messages` (see the module's table).

    Raises:
        InvalidRequestError: no messages, empty content (but in a final assistant turn), a block of a type not
            served or malformed, a tool_use with arguments that are not JSON text, a tool_result answering no earlier
            tool_use (param "messages" or "system").
    """
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    out: list[ChatMessage] = []
    if system is not None:  # its blocks run on, as vLLM's Messages endpoint joins them (a chat's parts: by "\n")
        blocks = _text_parts("system", system, "system")
        out.append(ChatMessage(role="system", content=blocks if isinstance(blocks, str) else
                               "".join(block["text"] for block in blocks)))
    tool_use_ids: set[str] = set()
    for i, message in enumerate(messages):
        if not message.content and not (message.role == "assistant" and i == len(messages) - 1):
            # Anthropic's rule: only a final assistant turn (a prefill the answer continues) may be empty
            raise InvalidRequestError(f"messages[{i}].content must not be empty (only the final assistant message "
                                      f"may be)", param="messages")
        if isinstance(message.content, str):
            out.append(ChatMessage(role=message.role, content=message.content))
            continue
        parts: list[dict[str, Any]] = []
        calls: list[MessageToolCall] = []
        for j, data in enumerate(message.content):
            where = f"messages[{i}].content[{j}]"
            block = _block(where, data, message.role)
            if isinstance(block, _TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, (_ThinkingBlock, _RedactedThinkingBlock)):
                pass  # an earlier answer's thinking: left out of the prompt, as reasoning models' templates do
            elif isinstance(block, _ToolUseBlock):
                if block.id in tool_use_ids:  # a tool_result could not tell them apart (Anthropic refuses it too)
                    raise InvalidRequestError(f"{where}.id {block.id!r} is the id of an earlier tool_use block; "
                                              f"tool_use ids must be unique", param="messages")
                tool_use_ids.add(block.id)
                calls.append(MessageToolCall(id=block.id, type="function", function=CalledFunction(
                    name=block.name, arguments=json.dumps(block.input, ensure_ascii=False))))
            else:
                if block.tool_use_id not in tool_use_ids:
                    raise InvalidRequestError(f"{where}.tool_use_id {block.tool_use_id!r} answers no tool_use block "
                                              f"of an earlier assistant message", param="messages")
                if parts:  # text before a result: its own turn, so the order is kept
                    out.append(ChatMessage(role="user", content=parts))
                    parts = []
                out.append(ChatMessage(role="tool", content=_text_parts(f"{where}.content", block.content, "user"),
                                       tool_call_id=block.tool_use_id))
        if parts or calls or not message.content:
            out.append(ChatMessage(role=message.role, content=parts if parts or not calls else None,
                                   tool_calls=calls or None))
    return out


# ---- the request as a chat request -------------------------------------------------------------------------------

class _CustomTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] = "custom"
    cache_control: Any = None
    strict: bool | None = None


# the chat fields a Messages request sets, in its own words (tools and the chat's tools are one to one)
_CHAT_PARAMS = {"response_format": "output_config", "max_completion_tokens": "max_tokens", "stop": "stop_sequences"}
_CHAT_PATHS = ((r"\bresponse_format\.json_schema\.schema\b", "output_config.format.schema"),
               (r"\btools\[(\d+)\]\.function\.parameters\b", r"tools[\1].input_schema"),
               (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."))


def messages_fields():
    """An error of the chat machinery told in the Messages API's fields (response_format -> output_config, ...)."""
    return told_as(_CHAT_PARAMS, _CHAT_PATHS)


def chat_tools(tools: list[Any] | None) -> list[Tool] | None:
    """The request's custom tools as chat function tools.

    Raises:
        InvalidRequestError: a server tool (web_search, bash, ...) or a malformed tool (param "tools").
    """
    if tools is None:
        return None
    out = []
    for i, data in enumerate(tools):
        kind = data.get("type", "custom") if isinstance(data, dict) else None
        if kind != "custom":
            raise InvalidRequestError(f"tools[{i}] is of type {kind!r}: only custom tools (name, description, "
                                      f"input_schema) are served; server tools are not implemented", param="tools")
        try:
            tool = msgspec.convert({k: v for k, v in data.items() if v is not None}, _CustomTool)
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"tools[{i}] is not a valid tool: {exc}", param="tools") from None
        out.append(Tool(type="function", function=FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.input_schema, strict=tool.strict)))
    return out


def _tool_choice(choice: ToolChoiceParam | None) -> ToolChoice | None:
    """Raises InvalidRequestError: type "tool" without a name, or a name with another type."""
    if choice is None:
        return None
    if (choice.type == "tool") != (choice.name is not None):
        raise InvalidRequestError('tool_choice.name is required with type "tool" and only with it',
                                  param="tool_choice")
    if choice.type == "tool":
        assert choice.name is not None
        return NamedToolChoice(type="function", function=FunctionName(choice.name))
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]  # type: ignore[return-value]


def check_stop_sequences(stops: list[str] | None) -> None:
    """Raises InvalidRequestError: an empty stop sequence, or more than 16 (param "stop_sequences")."""
    if stops is not None and (len(stops) > 16 or any(not s for s in stops)):
        raise InvalidRequestError("stop_sequences must be at most 16 non-empty strings", param="stop_sequences")


def chat_request_of(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request that asks for what `body` does (for a CountTokensRequest, its prompt only).

    Raises:
        InvalidRequestError: a refused field, or content, tools or tool_choice malformed or not served (param
            names the Messages field).
    """
    refusals(body)
    messages = chat_messages(body.system, body.messages)
    # the answer continues a final assistant turn: the one in the prompt (a turn of thinking alone is left out, and
    # then the prompt ends with the user's turn, which must not be continued)
    prefill = messages[-1].role == "assistant" and not messages[-1].tool_calls
    choice = body.tool_choice
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        check_stop_sequences(body.stop_sequences)
        fields = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k") if getattr(body, name)
                  is not None}
        config = body.output_config
        if config is not None and config.format is not None:
            fields["response_format"] = ResponseFormatJsonSchema(JsonSchemaFormat(name="output",
                                                                                  schema=config.format.schema))
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, stream=body.stream)
    return ChatCompletionRequest(
        messages=messages, model=body.model, tools=chat_tools(body.tools), tool_choice=_tool_choice(choice),
        parallel_tool_calls=choice is None or not choice.disable_parallel_tool_use,
        add_generation_prompt=not prefill, continue_final_message=prefill, **fields)
