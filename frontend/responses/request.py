"""The request side of POST /v1/responses (frontend/responses/api.py): its Structs, the fields refused by name, and
the request as a chat request: `instructions` as a system message first, then `input` (a string, or items: messages,
function_call items as an assistant's tool_calls, function_call_output items as tool messages); `tools` from the
flat Responses shape, `text.format` as response_format, max_output_tokens as the chat's max_completion_tokens.

`previous_response_id` continues a stored response (frontend/responses/store.py): its conversation's items come
before `input` (`history` below); conversation and item_reference inputs are refused.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.request.chat_template import arguments_object
from shuttle.frontend.request.decoding import Refused
from shuttle.frontend.request.field_names import told_as
from shuttle.frontend.request.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormatJsonObject,
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

class FunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A `tools` entry in the Responses shape: the function's fields beside `type`, not under `function`."""

    type: Literal["function"]
    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """tool_choice {"type": "function", "name": ...}: call exactly this function."""

    type: Literal["function"]
    name: str


class TextFormatText(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    """`{"type": "text"}`: no constraint (the default)."""


class TextFormatJsonObject(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    """`{"type": "json_object"}`: the output is one JSON object."""


class TextFormatJsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True,
                           forbid_unknown_fields=True):
    """`{"type": "json_schema", "name", "schema", "strict", "description"}`: the output follows the schema (the
    chat API's response_format.json_schema, flattened). `strict` and `description` change nothing."""

    name: str
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


TextFormat = TextFormatText | TextFormatJsonObject | TextFormatJsonSchema


class TextConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    format: TextFormat | None = None
    verbosity: Any = None  # refused unless null (see refusals)


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """Body of POST /v1/responses. `input`: a string (one user message) or a list of input items. `seed` is ours
    (the Responses schema has none), as in the chat API. `metadata`, `user`, `store`, `service_tier`,
    `safety_identifier`, `prompt_cache_key` are taken and change nothing. `store` (the default): the response is
    kept for GET and previous_response_id; `background`: answered at once, run on (frontend/responses/background.py).

    The fields after `parallel_tool_calls` are in the Responses schema and not implemented: a request that sets
    one (to anything but the value in REFUSED, which asks for what shuttle does anyway) gets 400 naming it.
    """

    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    # refused (REFUSED)
    conversation: Any = None
    include: Any = None
    truncation: Any = None
    reasoning: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: Any = None
    stream_options: Any = None
    context_management: Any = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None


_USE_PREVIOUS = "conversations are not implemented: continue a stored response with previous_response_id"
_NOT_IMPLEMENTED = "not implemented"
REFUSED: dict[str, Refused] = {
    "conversation": Refused(_USE_PREVIOUS),
    "include": Refused("there is no extra output data to include", []),
    "truncation": Refused("the input is never truncated: one too long for the context gets 400", "disabled"),
    "reasoning": Refused("reasoning models' options are not implemented"),
    "prompt": Refused("stored prompt templates are not implemented: send the text in instructions and input"),
    "max_tool_calls": Refused("built-in tools are not implemented"),
    "top_logprobs": Refused("logprobs are not implemented here (use /v1/chat/completions)"),
    "stream_options": Refused(_NOT_IMPLEMENTED),
    "context_management": Refused(_NOT_IMPLEMENTED),
    "prompt_cache_retention": Refused("the prefix cache is the server's own"),
    "prompt_cache_options": Refused("the prefix cache is the server's own"),
    "moderation": Refused(_NOT_IMPLEMENTED),
    "image": Refused("only text is served"),
    "access_programs": Refused(_NOT_IMPLEMENTED),
    "background_options": Refused(_NOT_IMPLEMENTED),
}


def refusals(body: ResponsesRequest) -> None:
    """Raises InvalidRequestError naming the first field of REFUSED the body sets to other than its accepted value."""
    for name, refused in REFUSED.items():
        value = getattr(body, name)
        if value is None:
            continue
        accepted = refused.accepted
        if accepted is not None and type(value) is type(accepted) and value == accepted:
            continue
        what = f"supported only as {json.dumps(accepted)}" if accepted is not None else "not supported"
        raise InvalidRequestError(f"{name} is {what}: {refused.why}", param=name)
    if body.text is not None and body.text.verbosity is not None:
        raise InvalidRequestError("text.verbosity is not supported: not implemented", param="text")
    if body.background and not body.store:
        raise InvalidRequestError("background needs store: true (a background response is read back with "
                                  "GET /v1/responses/{id})", param="background")
    if body.background and body.stream:
        raise InvalidRequestError("stream is not supported with background: true (poll GET /v1/responses/{id})",
                                  param="stream")


# ---- input items to chat messages --------------------------------------------------------------------------------

class _MessageItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]
    type: Literal["message"] = "message"
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class _FunctionCallItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class _FunctionCallOutputItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[dict[str, Any]]
    id: str | None = None
    status: str | None = None


class _ReasoningItem(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A reasoning model's earlier thinking (an output item sent back, as the Agents SDK does): taken and left out
    of the prompt, as the reasoning models' own chat templates leave earlier turns' thinking out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = []
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


_ITEMS = {"message": _MessageItem, "function_call": _FunctionCallItem,
          "function_call_output": _FunctionCallOutputItem, "reasoning": _ReasoningItem}
_TEXT_PARTS = ("input_text", "output_text")


def input_items(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as a list of input items (a string is one user message)."""
    return [{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given


def input_messages(instructions: str | None, given: str | list[dict[str, Any]],
                   history: list[dict[str, Any]] | None = None) -> list[ChatMessage]:
    """The chat messages of `instructions`, then `history` (a stored conversation's input items, already checked),
    then `input`. Consecutive function_call items become one assistant message's tool_calls (joined to the
    assistant message right before them, if any). An "incomplete" function_call whose arguments are no JSON object
    (a response's call cut off by max_output_tokens, as the response gave it) is left out.

    Raises:
        InvalidRequestError: an empty input, an item of a type not served or malformed (param "input"; the index
            is the item's in `input`).
    """
    messages = [ChatMessage(role="system", content=instructions)] if instructions is not None else []
    if isinstance(given, str) and not history:
        return [*messages, ChatMessage(role="user", content=given)]
    if isinstance(given, list) and not given:
        raise InvalidRequestError("input must not be empty", param="input")
    history = history or []
    calls_open = False  # the last message is an assistant's that function_call items may join
    for i, data in enumerate([*history, *input_items(given)], start=-len(history)):
        item = _item(i, data)
        if isinstance(item, _ReasoningItem):
            continue
        if isinstance(item, _FunctionCallItem):
            if arguments_object(item.arguments) is None:
                if item.status == "incomplete":  # a response's call cut off by max_output_tokens, stored or sent
                    continue  # back: never a call anyone could answer, nor one a chat template can render
                raise InvalidRequestError(f"input[{i}].arguments must be a JSON object as text", param="input")
            call = MessageToolCall(id=item.call_id, type="function",
                                   function=CalledFunction(name=item.name, arguments=item.arguments))
            if calls_open:
                last = messages[-1]
                if last.tool_calls is None:
                    last.tool_calls = []
                last.tool_calls.append(call)  # in place: a copy per call made 40,000 calls quadratic
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            calls_open = True
        elif isinstance(item, _FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=_text(i, item.output), tool_call_id=item.call_id))
            calls_open = False
        else:
            messages.append(ChatMessage(role=item.role, content=_text(i, item.content)))
            calls_open = item.role == "assistant"
    return messages


def _item(i: int, data: Any) -> _MessageItem | _FunctionCallItem | _FunctionCallOutputItem | _ReasoningItem:
    if not isinstance(data, dict):
        raise InvalidRequestError(f"input[{i}] must be an object (an input item)", param="input")
    kind = data.get("type", "message")  # a message may leave its type out (the SDKs' "easy" input message)
    if kind == "item_reference":
        raise InvalidRequestError(f"input[{i}] is an item_reference: item references are not implemented (continue a "
                                  f"stored response with previous_response_id)", param="input")
    shape = _ITEMS.get(kind)
    if shape is None:
        raise InvalidRequestError(f"input[{i}] is of type {kind!r}; the input items served are "
                                  f"{', '.join(_ITEMS)}", param="input")
    try:
        return msgspec.convert({k: v for k, v in data.items() if v is not None}, shape)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"input[{i}] is not a valid {kind} item: {exc}", param="input") from None


def _text(i: int, content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidRequestError(f"input[{i}] has a content part of type {kind!r}: only text is served "
                                      f"(input_text and output_text parts)", param="input")
        texts.append(part["text"])
    return "".join(texts)


# ---- the request as a chat request -------------------------------------------------------------------------------

def function_tools(tools: list[dict[str, Any]] | None) -> list[FunctionTool] | None:
    """The request's tools, each a function in the flat Responses shape.

    Raises:
        InvalidRequestError: a built-in tool (web_search, file_search, ...) or a malformed function (param "tools").
    """
    if tools is None:
        return None
    out = []
    for i, data in enumerate(tools):
        kind = data.get("type") if isinstance(data, dict) else None
        if kind != "function":
            raise InvalidRequestError(f"tools[{i}] is of type {kind!r}: only function tools are served (built-in "
                                      f"tools are not implemented)", param="tools")
        try:
            out.append(msgspec.convert(data, FunctionTool))
        except msgspec.ValidationError as exc:
            raise InvalidRequestError(f"tools[{i}] is not a valid function tool: {exc}", param="tools") from None
    return out


def chat_request_of(body: ResponsesRequest, tools: list[FunctionTool] | None,
                    history: list[dict[str, Any]] | None = None) -> ChatCompletionRequest:
    """The chat completion request that asks for what `body` does, continuing `history` (the input items of the
    stored conversation previous_response_id names, if any).

    Raises:
        InvalidRequestError: the input or the text format is malformed (param names the Responses field).
    """
    choice: ToolChoice | None
    if isinstance(body.tool_choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(body.tool_choice.name))
    elif body.tool_choice == "auto" and not tools:
        choice = None  # OpenAI's default, so clients send it without tools: text, as without tools
    else:
        choice = body.tool_choice
    sampling = {name: getattr(body, name) for name in ("temperature", "top_p") if getattr(body, name) is not None}
    return ChatCompletionRequest(
        messages=input_messages(body.instructions, body.input, history), model=body.model,
        max_completion_tokens=body.max_output_tokens, seed=body.seed, stream=body.stream, **sampling, user=body.user,
        response_format=_response_format(body.text),
        tools=None if tools is None else [Tool(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in tools],
        tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls)


def _response_format(text: TextConfig | None):
    form = text.format if text is not None else None
    if form is None or isinstance(form, TextFormatText):
        return None
    if isinstance(form, TextFormatJsonObject):
        return ResponseFormatJsonObject()
    if not 1 <= len(form.name) <= 64 or not all(c.isascii() and (c.isalnum() or c in "_-") for c in form.name):
        raise InvalidRequestError("text.format.name must be 1 to 64 letters, digits, underscores or dashes",
                                  param="text")
    return ResponseFormatJsonSchema(JsonSchemaFormat(name=form.name, schema=form.schema, strict=form.strict,
                                                     description=form.description))


_CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text"}


def responses_param(param: str | None) -> str | None:
    """The Responses field of a chat field's name (messages -> input, ...)."""
    return _CHAT_PARAMS.get(param, param) if param is not None else None


# the chat paths of the fields a Responses request sets, in the words of its own (tools hold function tools only)
_CHAT_PATHS = ((r"\bresponse_format\.json_schema\.schema\b", "text.format.schema"),
               (r"\bresponse_format\.json_schema\.", "text.format."),
               (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."))


def responses_params():
    """An error of the chat machinery named by the Responses field (messages -> input, ...), param and message."""
    return told_as(_CHAT_PARAMS, _CHAT_PATHS)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"
