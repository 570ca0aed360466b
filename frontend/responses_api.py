"""POST /v1/responses, OpenAI's Responses API, on the chat machinery: the request's Structs, its input turned into
chat messages, and the response object and stream events shaped out of a chat call's one choice.

    1. ResponsesRequest: the body; fields of the Responses schema shuttle does not implement are declared so that
       `refusals` names them (400), and anything undeclared is refused as on every endpoint
    2. chat_request_of: `instructions` as a system message first, then `input` (a string, or items: messages,
       function_call items as an assistant's tool_calls, function_call_output items as tool messages); `tools`
       from the flat Responses shape, `text.format` as response_format, max_output_tokens as the chat's
       max_completion_tokens
    3. ResponsesCall (a ChatCall): the same template, tools, tool-call parsing and structured output; `collect()`
       the response object, `chunks()` the stream's events (response.created ... response.completed)

Nothing is stored: `store` is taken and the response says false; previous_response_id, conversation and
item_reference inputs are refused, since there is nothing to refer to.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import aclosing, contextmanager
from typing import Annotated, Any, AsyncIterator, Iterator, Literal

import msgspec

from common.errors import InvalidRequestError
from frontend.choices import collect, usage
from frontend.generation import TextDelta, TextGeneration
from frontend.protocol import (
    ChatCompletionRequest, ChatMessage, JsonSchemaFormat, Refused, ResponseFormatJsonObject, ResponseFormatJsonSchema,
    error_body,
)
from frontend.serving import ChatCall, build_generations
from frontend.state import FrontendState
from frontend.tool_calls import ToolCallChoices
from frontend.tool_request import (
    NAME_PATTERN, CalledFunction, FunctionDefinition, FunctionName, MessageToolCall, NamedToolChoice, Tool,
)

RESPONSES_URL = "/v1/responses"


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
    `safety_identifier`, `prompt_cache_key` are taken and change nothing (nothing is stored).

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
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    # refused (REFUSED)
    previous_response_id: Any = None
    conversation: Any = None
    include: Any = None
    background: Any = None
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


_NOT_STORED = "responses are not stored: send the whole conversation in input"
_NOT_IMPLEMENTED = "not implemented"
REFUSED: dict[str, Refused] = {
    "previous_response_id": Refused(_NOT_STORED),
    "conversation": Refused(_NOT_STORED),
    "include": Refused("there is no extra output data to include", []),
    "background": Refused("responses run in the foreground (they are not stored to poll)", False),
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
    "background_options": Refused("responses run in the foreground"),
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


_ITEMS = {"message": _MessageItem, "function_call": _FunctionCallItem,
          "function_call_output": _FunctionCallOutputItem}
_TEXT_PARTS = ("input_text", "output_text")


def input_messages(instructions: str | None, given: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """The chat messages of `instructions` and `input`. Consecutive function_call items become one assistant
    message's tool_calls (joined to the assistant message right before them, if any).

    Raises:
        InvalidRequestError: an empty input, an item of a type not served or malformed (param "input").
    """
    messages = [ChatMessage(role="system", content=instructions)] if instructions is not None else []
    if isinstance(given, str):
        return [*messages, ChatMessage(role="user", content=given)]
    if not given:
        raise InvalidRequestError("input must not be empty", param="input")
    calls_open = False  # the last message is an assistant's that function_call items may join
    for i, data in enumerate(given):
        item = _item(i, data)
        if isinstance(item, _FunctionCallItem):
            call = MessageToolCall(id=item.call_id, type="function",
                                   function=CalledFunction(name=item.name, arguments=item.arguments))
            if calls_open:
                last = messages[-1]
                last.tool_calls = [*(last.tool_calls or []), call]
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


def _item(i: int, data: Any) -> _MessageItem | _FunctionCallItem | _FunctionCallOutputItem:
    if not isinstance(data, dict):
        raise InvalidRequestError(f"input[{i}] must be an object (an input item)", param="input")
    kind = data.get("type", "message")  # a message may leave its type out (the SDKs' "easy" input message)
    if kind == "item_reference":
        raise InvalidRequestError(f"input[{i}] is an item_reference: {_NOT_STORED}", param="input")
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


def chat_request_of(body: ResponsesRequest, tools: list[FunctionTool] | None) -> ChatCompletionRequest:
    """The chat completion request that asks for what `body` does.

    Raises:
        InvalidRequestError: the input or the text format is malformed (param names the Responses field).
    """
    choice = body.tool_choice
    if choice == "auto" and not tools:
        choice = None  # OpenAI's default, so clients send it without tools: text, as without tools
    if isinstance(choice, FunctionToolChoice):
        choice = NamedToolChoice(type="function", function=FunctionName(choice.name))
    sampling = {name: getattr(body, name) for name in ("temperature", "top_p") if getattr(body, name) is not None}
    return ChatCompletionRequest(
        messages=input_messages(body.instructions, body.input), model=body.model,
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


@contextmanager
def _responses_params() -> Iterator[None]:
    """An error of the chat machinery named by the Responses field (messages -> input, ...)."""
    try:
        yield
    except InvalidRequestError as exc:
        exc.param = _CHAT_PARAMS.get(exc.param, exc.param)
        raise


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the call ----------------------------------------------------------------------------------------------------

class ResponsesCall(ChatCall):
    """POST /v1/responses: a ChatCall of one choice whose result is a response object (`collect`) or the Responses
    stream's events (`chunks`, each a dict with its `type` and `sequence_number`).

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the Responses field).
    """

    def __init__(self, state: FrontendState, request: ResponsesRequest):
        refusals(request)
        self.request = request
        self.function_tools = function_tools(request.tools)
        with _responses_params():
            super().__init__(state, chat_request_of(request, self.function_tools))
        self.request_id = new_id("resp")
        self.created_at = int(time.time())
        self.sequence_number = 0

    def build(self) -> list[TextGeneration]:
        with _responses_params():
            return build_generations(self.state, self.body, [self.prompt], self.request_id,
                                     self.body.max_completion_tokens, None, prompt_param="input",
                                     max_tokens_param="max_output_tokens", structured=self.structured_output())

    async def collect(self) -> dict:
        """The response object.

        Raises:
            InvalidRequestError: a sampling parameter out of range.
            GenerationError: the generation failed.
        """
        if not self.generations:
            self.generations = self.build()
        [choice] = await collect(self.generations)
        finish = choice.generation.finish_reason
        if self.tool_calls is not None:
            message, _ = self.tool_calls.message(choice.text, finish)
            content, calls = message["content"] or "", message.get("tool_calls", [])
        else:
            content, calls = choice.text, []
        items = []
        if content or not calls:
            items.append(_message_item(new_id("msg"), content, "completed"))
        items += [_call_item(new_id("fc"), new_id("call"), c["function"]["name"], c["function"]["arguments"],
                             "completed") for c in calls]
        if finish == "length":
            items[-1]["status"] = "incomplete"
        return self.response(items, finish)

    def response(self, output: list[dict], finish: str | None) -> dict:
        """The response object; `finish` None: still in progress (no usage yet)."""
        request = self.request
        status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        tool_use = self.tool_use
        tool_choice: Any = tool_use.choice
        if tool_use.choice == "function":
            tool_choice = {"type": "function", "name": tool_use.function}
        text_format = request.text.format if request.text is not None else None
        sampling = self.generations[0].request.sampling  # what was asked, defaults filled in
        return {
            "id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "model": self.state.model_name, "output": output,
            "parallel_tool_calls": tool_use.parallel, "previous_response_id": None, "reasoning": None,
            "store": False, "temperature": sampling.temperature,
            "text": {"format": msgspec.to_builtins(text_format) if text_format is not None else {"type": "text"}},
            "tool_choice": tool_choice, "tools": msgspec.to_builtins(self.function_tools or []),
            "top_p": sampling.top_p, "truncation": "disabled", "user": request.user,
            "usage": None if finish is None else _usage(self.generations),
        }

    def event(self, kind: str, **fields) -> dict:
        """One stream event, numbered in order."""
        out = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    def error_event(self, status: int, message: str) -> dict:
        """The `error` event of a failure after the stream has begun."""
        error = error_body(status, message)["error"]
        return self.event("error", code=error["type"], message=message, param=None)

    async def chunks(self) -> AsyncIterator[dict]:
        """The stream's events: response.created and response.in_progress once the first text is out (so that an
        admission error is raised before any event), each output item's events, then response.completed or
        response.incomplete with the whole response.

        Raises:
            InvalidRequestError: a sampling parameter out of range.
            GenerationError: the generation failed.
        """
        stream = _EventStream(self)
        async with aclosing(self.deltas()) as deltas:
            delta = await anext(deltas, None)
            yield self.event("response.created", response=self.response([], None))
            yield self.event("response.in_progress", response=self.response([], None))
            finish = None
            while delta is not None:
                finish = delta.finish_reason or finish
                for event in stream.feed(delta):
                    yield event
                delta = await anext(deltas, None)
        for event in stream.finish(finish):
            yield event
        kind = "response.incomplete" if finish == "length" else "response.completed"
        yield self.event(kind, response=self.response(stream.items, finish))


class _EventStream:
    """The output items of a stream as its deltas arrive, and the events that open, extend and close them."""

    def __init__(self, call: ResponsesCall):
        self.call = call
        self.tool_calls: ToolCallChoices | None = call.tool_calls
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, int] = {}  # the chat delta's call index -> output index

    def feed(self, delta: TextDelta) -> list[dict]:
        if self.tool_calls is None:
            message = {"content": delta.text} if delta.text else {}
        else:
            message, _ = self.tool_calls.delta(delta.index, delta.text, delta.finish_reason)
        events = []
        if message.get("content"):
            events += self._text(message["content"])
        for piece in message.get("tool_calls", []):
            events += self._call(piece)
        return events

    def finish(self, finish: str | None) -> list[dict]:
        events = []
        if not self.items:  # no text and no calls: one empty message, as the whole response has
            events += self._open(_message_item(new_id("msg"), "", "in_progress"))
        return events + self._close("incomplete" if finish == "length" else "completed")

    def _text(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close("completed")
            events += self._open(_message_item(new_id("msg"), "", "in_progress"))
        part = self.open["content"][0]
        part["text"] += text
        return events + [self.call.event("response.output_text.delta", item_id=self.open["id"],
                                         output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[])]

    def _call(self, piece: dict) -> list[dict]:
        events = []
        function = piece["function"]
        if piece["index"] not in self.calls:
            events += self._close("completed")
            events += self._open(_call_item(new_id("fc"), new_id("call"), function["name"], "", "in_progress"))
            self.calls[piece["index"]] = len(self.items) - 1
        index = self.calls[piece["index"]]
        item = self.items[index]
        arguments = function.get("arguments") or ""
        if arguments:
            item["arguments"] += arguments
            events.append(self.call.event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=index, delta=arguments))
        return events

    def _open(self, item: dict) -> list[dict]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        added = dict(item, content=[]) if item["type"] == "message" else dict(item)
        events = [self.call.event("response.output_item.added", output_index=index, item=added)]
        if item["type"] == "message":
            events.append(self.call.event("response.content_part.added", item_id=item["id"], output_index=index,
                                          content_index=0, part=dict(item["content"][0])))
        return events

    def _close(self, status: str) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        index = self.items.index(item)
        event = self.call.event
        if item["type"] == "message":
            part = item["content"][0]
            events = [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=[]),
                      event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part))]
        else:
            events = [event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=item["name"], arguments=item["arguments"])]
        return events + [event("response.output_item.done", output_index=index, item=dict(item))]


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(generations: list[TextGeneration]) -> dict:
    chat = usage(generations)
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"], "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens_details": {"reasoning_tokens": 0}}
