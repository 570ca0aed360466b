"""POST /v1/responses, OpenAI's Responses API, on the chat machinery: ResponsesCall (a ChatCall, with the same
template, tools, tool-call parsing and structured output) shapes a chat call's one choice into the response object
(`collect()`) and the stream's events (`chunks()`: response.created ... response.completed). The request and its
conversion to a chat request are in frontend/responses/request.py. A response asked with `store` (the default) is
kept in the server's ResponseStore (frontend/responses/store.py) once it has ended; `previous_response_id` continues
a stored one.
"""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any, AsyncGenerator

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.chat_call import ChatCall
from shuttle.frontend.choices import collect, usage
from shuttle.frontend.generation import TextDelta, TextGeneration
from shuttle.frontend.request.errors import error_body
from shuttle.frontend.responses.request import (
    ResponsesRequest,
    chat_request_of,
    function_tools,
    input_items,
    new_id,
    refusals,
    responses_param,
    responses_params,
)
from shuttle.frontend.responses.store import StoredResponse
from shuttle.frontend.serving import build_generations, response_model
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tools.calls import ToolCallChoices

RESPONSES_URL = "/v1/responses"


# ---- the call ----------------------------------------------------------------------------------------------------

class ResponsesCall(ChatCall):
    """POST /v1/responses: a ChatCall of one choice whose result is a response object (`collect`) or the Responses
    stream's events (`chunks`, each a dict with its `type` and `sequence_number`).

    Args:
        previous: the stored response previous_response_id names (looked up on the event loop by the caller,
            since this may run in a conversion thread): its conversation comes before the input.

    Attributes:
        input_items: the conversation this response answers, as input items (what a later turn continues).
        stored: the response is kept in the store once it has ended (`store`, unless the store keeps nothing).
        input_size: about the bytes of `input_items` (the caller's count of the bodies; see StoredResponse.size).
        body_bytes: the bytes of this request's body (the caller's count; see StoredResponse.body_bytes).

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the Responses field).
    """

    def __init__(self, state: FrontendState, request: ResponsesRequest, previous: StoredResponse | None = None):
        refusals(request)
        if request.background and not state.responses.enabled:
            raise InvalidRequestError("background needs the response store, and this server keeps no responses "
                                      "(--responses-store-max-entries 0)", param="background")
        self.request = request
        self.function_tools = function_tools(request.tools)
        history = previous.conversation() if previous is not None else []
        with responses_params():
            super().__init__(state, chat_request_of(request, self.function_tools, history))
        self.input_items = [*history, *input_items(request.input)]
        self.stored = request.store and state.responses.enabled
        self.input_size = self.body_bytes = 0
        self.request_id = new_id("resp")
        self.output_token_ids: list[int] = []  # the choice's, once known (usage's reasoning_tokens)
        self.created_at = int(time.time())
        self.sequence_number = 0

    def build(self) -> list[TextGeneration]:
        with responses_params():
            return build_generations(self.state, self.body, [self.prompt], self.request_id,
                                     self.body.max_completion_tokens, None, prompt_param="input",
                                     max_tokens_param="max_output_tokens", structured=self.structured_output(),
                                     constraint_param=responses_param(self.constraint_param))

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
        thought, text = self.reasoning.split(choice.text) if self.reasoning is not None else (None, choice.text)
        self.output_token_ids = choice.token_ids
        if self.tool_calls is not None and text is not None:  # calls are read from the answer only (None: cut
            message, _ = self.tool_calls.message(text, finish)  # while thinking, no call begun)
            content, calls = message["content"] or "", message.get("tool_calls", [])
        else:
            content, calls = text or "", []
        items = [_reasoning_item(new_id("rs"), thought, "completed")] if thought else []
        if content or not (calls or items):
            items.append(_message_item(new_id("msg"), content, "completed"))
        items += [_call_item(new_id("fc"), new_id("call"), c["function"]["name"], c["function"]["arguments"],
                             "completed") for c in calls]
        if finish == "length":
            items[-1]["status"] = "incomplete"
        return self.remember(self.response(items, finish))

    def remember(self, response: dict) -> dict:
        """Keep the ended `response` in the store if the request asked to (a background one is there already and
        advances in place); returns it."""
        if self.stored and not self.request.background:
            self.state.responses.put(response, self.input_items, self.input_size, self.body_bytes)
        return response

    def response(self, output: list[dict], finish: str | None, status: str | None = None) -> dict:
        """The response object; `finish` None: still in progress (no usage yet), or `status` (queued)."""
        request = self.request
        if status is None:
            status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
        tool_use = self.tool_use
        tool_choice: Any = tool_use.choice
        if tool_use.choice == "function":
            tool_choice = {"type": "function", "name": tool_use.function}
        text_format = request.text.format if request.text is not None else None
        sampling = self.generations[0].request.sampling  # what was asked, defaults filled in
        out = {
            "id": self.request_id, "object": "response", "created_at": self.created_at, "status": status,
            "background": request.background, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "metadata": request.metadata or {}, "model": response_model(self.state, self.body.model), "output": output,
            "parallel_tool_calls": tool_use.parallel, "previous_response_id": request.previous_response_id,
            "reasoning": None, "store": self.stored, "temperature": sampling.temperature,
            "text": {"format": msgspec.to_builtins(text_format) if text_format is not None else {"type": "text"}},
            "tool_choice": tool_choice, "tools": msgspec.to_builtins(self.function_tools or []),
            "top_p": sampling.top_p, "truncation": "disabled", "user": request.user,
            "usage": None if finish is None else _usage(self.generations,
                                                         self.state.config.api.enable_prompt_tokens_details),
        }
        if out["usage"] is not None and self.reasoning is not None:
            out["usage"]["output_tokens_details"]["reasoning_tokens"] = \
                self.reasoning.count_tokens(self.output_token_ids)
        return out

    def event(self, kind: str, **fields) -> dict:
        """One stream event, numbered in order."""
        out = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return out

    def error_event(self, status: int, message: str) -> dict:
        """The `error` event of a failure after the stream has begun."""
        error = error_body(status, message)["error"]
        return self.event("error", code=error["type"], message=message, param=None)

    async def chunks(self) -> AsyncGenerator[dict, None]:
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
        yield self.event(kind, response=self.remember(self.response(stream.items, finish)))


class _EventStream:
    """The output items of a stream as its deltas arrive, and the events that open, extend and close them."""

    def __init__(self, call: ResponsesCall):
        self.call = call
        self.tool_calls: ToolCallChoices | None = call.tool_calls
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.calls: dict[int, int] = {}  # the chat delta's call index -> output index

    def feed(self, delta: TextDelta) -> list[dict]:
        self.call.output_token_ids.extend(delta.token_ids)
        thought, text = self.call.reasoning_delta(delta)
        message: dict[str, Any]  # the chat delta's fields: content text, tool_calls pieces
        if self.tool_calls is None or not self.call.answering(delta.index):
            message = {"content": text} if text else {}
        else:
            message, _ = self.tool_calls.delta(delta.index, text, delta.finish_reason)
        events = self._reasoning(thought) if thought else []
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
        assert self.open is not None  # the message item, open already or opened just above
        part = self.open["content"][0]
        part["text"] += text
        return events + [self.call.event("response.output_text.delta", item_id=self.open["id"],
                                         output_index=len(self.items) - 1, content_index=0, delta=text, logprobs=[])]

    def _reasoning(self, text: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close("completed")
            events += self._open(_reasoning_item(new_id("rs"), "", "in_progress"))
        assert self.open is not None  # the reasoning item, open already or opened just above
        self.open["content"][0]["text"] += text
        return events + [self.call.event("response.reasoning_text.delta", item_id=self.open["id"],
                                         output_index=len(self.items) - 1, content_index=0, delta=text)]

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
        added = dict(item, content=[]) if item["type"] in ("message", "reasoning") else dict(item)
        events = [self.call.event("response.output_item.added", output_index=index, item=added)]
        if item["type"] in ("message", "reasoning"):
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
        if item["type"] == "reasoning":
            part = item["content"][0]
            events = [event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"]),
                      event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part))]
        elif item["type"] == "message":
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


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A reasoning model's thinking as OpenAI's reasoning output item (its text in content, no summary)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _usage(generations: list[TextGeneration], input_tokens_details: bool = True) -> dict:
    """The Responses API's usage; input_tokens_details (cached_tokens) unless --no-enable-prompt-tokens-details."""
    chat = usage(generations, input_tokens_details)
    details = {"input_tokens_details": chat["prompt_tokens_details"]} if input_tokens_details else {}
    return {"input_tokens": chat["prompt_tokens"], "output_tokens": chat["completion_tokens"],
            "total_tokens": chat["total_tokens"], **details, "output_tokens_details": {"reasoning_tokens": 0}}
