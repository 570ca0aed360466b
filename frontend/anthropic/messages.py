"""POST /v1/messages on the chat machinery: MessagesCall (a ChatCall, with the same template, tools, tool-call
parsing and structured output) shapes a chat call's one choice into Anthropic's message object (`collect()`) and its
stream's events (`chunks()`); POST /v1/messages/count_tokens is `count_tokens`. The request and its conversion to a
chat request are in frontend/anthropic/request.py.

    finish        stop_reason
    stop          end_turn, or stop_sequence (with `stop_sequence` the string) when a stop sequence ended it
    length        max_tokens
    tool_calls    tool_use (the text made calls)

Under --reasoning-parser the thinking is a `thinking` block first (its `signature` empty); text and tool calls are
read from the answer after it. `usage.input_tokens` is the whole prompt's token count (cached tokens included, as in
the chat API's prompt_tokens).
"""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import Any, AsyncGenerator

import jiter

from shuttle.frontend.anthropic.request import CountTokensRequest, MessagesRequest, chat_request_of, messages_fields
from shuttle.frontend.chat_call import ChatCall, chat_prompt_ids
from shuttle.frontend.choices import collect
from shuttle.frontend.generation import TextGeneration
from shuttle.frontend.serving import check_model, response_model
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tools.request import tool_use_of

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def count_tokens(state: FrontendState, body: CountTokensRequest) -> dict:
    """POST /v1/messages/count_tokens: {"input_tokens": the prompt's token count}, the prompt being the one a
    Messages request with these messages, system and tools would be served. A prompt of any length is counted (the
    body limit bounds it): a count says how far over the context a prompt is, where a Messages request refuses it.

    Raises:
        InvalidRequestError: as a Messages request's prompt (param names the field).
        ModelNotFoundError: `model` is not the served model.
    """
    check_model(state, body.model)
    chat = chat_request_of(body)
    with messages_fields():
        # the tools and tool_choice checked as a Messages request checks them, but for the server's parser of
        # "auto" calls: counting a prompt parses no output
        tool_use_of(chat.tools, chat.tool_choice, chat.parallel_tool_calls, auto_tool_choice=True)
        return {"input_tokens": len(chat_prompt_ids(state, chat, chat.add_special_tokens, any_length=True))}


class MessagesCall(ChatCall):
    """POST /v1/messages: a ChatCall of one choice whose result is a message object (`collect`) or Anthropic's
    stream events (`chunks`, each a dict with its `type`).

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """

    def __init__(self, state: FrontendState, request: MessagesRequest):
        with messages_fields():
            super().__init__(state, chat_request_of(request))
        self.request_id = new_id("msg")  # before build(): the engine's requests are named after it

    def build(self) -> list[TextGeneration]:
        with messages_fields():
            return super().build()

    def message(self, content: list[dict], finish: str | None, output_tokens: int) -> dict:
        """The message object; `finish` None: still being written (no stop_reason yet)."""
        [generation] = self.generations
        stop = STOP_REASONS.get(finish) if finish is not None else None
        stop_string = generation.stop_string if finish == "stop" else None
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "model": response_model(self.state, self.body.model),
                "content": content, "stop_reason": "stop_sequence" if stop_string is not None else stop,
                "stop_sequence": stop_string,
                "usage": {"input_tokens": len(generation.prompt_token_ids), "output_tokens": output_tokens}}

    async def collect(self) -> dict:
        """The message object.

        Raises:
            InvalidRequestError: a sampling parameter out of range.
            GenerationError: the generation failed.
        """
        if not self.generations:
            self.generations = self.build()
        [choice] = await collect(self.generations)
        finish = choice.generation.finish_reason
        thought, answer = self.split_reasoning(choice.text)  # tool calls are read from the answer only
        text, calls = answer or "", []
        if self.tool_calls is not None and answer is not None:  # None: cut while thinking, no call begun
            message, finish = self.tool_calls.message(text, finish, choice.generation.stopped_by_request)
            text, calls = message["content"] or "", message.get("tool_calls", [])
        content = [_thinking_block(thought["reasoning"])] if thought.get("reasoning") else []
        content += [_text_block(text)] if text else []
        content += [_tool_use_block(c["function"]["name"], _input(c["function"]["arguments"])) for c in calls]
        return self.message(content, finish, choice.generation.num_output_tokens)

    async def chunks(self) -> AsyncGenerator[dict, None]:
        """The stream's events: message_start and a ping once the first text is out (so that an admission error is
        raised before any event), each content block's content_block_start, its deltas (thinking_delta,
        text_delta, input_json_delta) and content_block_stop, then message_delta (stop_reason, stop_sequence, usage) and
        message_stop.

        Raises:
            InvalidRequestError: a sampling parameter out of range.
            GenerationError: the generation failed.
        """
        blocks = _Blocks()
        async with aclosing(self.deltas()) as deltas:  # deltas() builds the generation
            [generation] = self.generations
            delta = await anext(deltas, None)
            yield {"type": "message_start", "message": self.message([], None, generation.num_output_tokens)}
            yield {"type": "ping"}
            finish = None
            while delta is not None:
                thought, text = self.reasoning_delta(delta)
                message, reason = {"content": text} if text else {}, delta.finish_reason
                if self.tool_calls is not None and self.answering(delta.index):
                    message, reason = self.tool_calls.delta(delta.index, text, delta.finish_reason, self.cut(delta))
                finish = reason or finish
                for event in blocks.feed(thought, message):
                    yield event
                delta = await anext(deltas, None)
        for event in blocks.close():
            yield event
        whole = self.message([], finish, generation.num_output_tokens)
        yield {"type": "message_delta", "delta": {"stop_reason": whole["stop_reason"],
                                                  "stop_sequence": whole["stop_sequence"]}, "usage": whole["usage"]}
        yield {"type": "message_stop"}


class _Blocks:
    """The content blocks of a stream as its chat deltas arrive, and the events that open, extend and close them."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened
        self.open: str | None = None  # the kind of the block being written: "thinking", "text", or "call <index>"

    def feed(self, thought: str, message: dict[str, Any]) -> list[dict]:
        """The events of one delta's thinking and chat fields (content text, tool_calls pieces)."""
        events = []
        if thought:
            if self.open != "thinking":
                events += self._start(_thinking_block(""), "thinking")
            events.append(self._delta({"type": "thinking_delta", "thinking": thought}))
        if message.get("content"):
            if self.open != "text":
                events += self._start(_text_block(""), "text")
            events.append(self._delta({"type": "text_delta", "text": message["content"]}))
        for piece in message.get("tool_calls", []):
            kind = f"call {piece['index']}"
            if self.open != kind:
                events += self._start(_tool_use_block(piece["function"]["name"], {}), kind)
            arguments = piece["function"].get("arguments") or ""
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.count - 1}]

    def _start(self, block: dict, kind: str) -> list[dict]:
        events = self.close()
        self.open = kind
        self.count += 1
        return events + [{"type": "content_block_start", "index": self.count - 1, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.count - 1, "delta": delta}


def _thinking_block(thinking: str) -> dict:
    # no signature: nothing signs a local model's thinking (the field is there, empty, for clients that read it)
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def _text_block(text: str) -> dict:
    return {"type": "text", "text": text}


def _tool_use_block(name: str, tool_input: dict) -> dict:
    return {"type": "tool_use", "id": new_id("toolu"), "name": name, "input": tool_input}


def _input(arguments: str) -> dict:
    """A call's arguments text as tool_use's `input`. A call cut by max_tokens before its arguments object closed
    has what its complete values make, read as the official client reads the same text streamed as input_json_delta
    pieces (jiter in partial mode: a value cut off, a string included, is left out), so a message streamed and the
    same message whole agree; {} when not even that is an object."""
    try:
        value = jiter.from_json(arguments.encode(), partial_mode=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

