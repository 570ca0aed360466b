"""Tool calls out of a chat response's choices: which parser reads the output (by tool_choice), and the OpenAI
message, stream delta and finish_reason each choice then gets (frontend/chat_call.py's ChatCall asks this module).

    whole:    {"role": "assistant", "content": text or null, "tool_calls": [{"id", "type": "function",
               "function": {"name", "arguments"}}]}  (no tool_calls key when there are none)
    streamed: {"content": ...} as text is released, and per call `{"tool_calls": [{"index", "id", "type",
               "function": {"name", "arguments"}}]}` on its first piece, then `[{"index", "function": {"arguments"}}]`

A choice that made calls and ended by itself (not cut by length, nor by a stop string or stop token the request
set) finishes with "tool_calls". With
parallel_tool_calls false only a choice's first call is kept (the grammar of "required" allows only one anyway).
"""

from __future__ import annotations

import uuid

from shuttle.frontend.tools.parsers import parser_for
from shuttle.frontend.tools.parsers.base import StreamPiece, ToolParser, ToolStreamParser
from shuttle.frontend.tools.parsers.json_array import JsonArrayCallsParser
from shuttle.frontend.tools.parsers.named import NamedFunctionParser
from shuttle.frontend.tools.request import ToolUse


def tool_parser_of(use: ToolUse, server_parser: str | None) -> ToolParser | None:
    """The parser of a request's output: the forced formats' own, the server's --tool-call-parser under "auto",
    None when no calls can come (tool_choice "none", no tools)."""
    if use.choice == "required":
        return JsonArrayCallsParser()
    if use.choice == "function":
        assert use.function is not None  # tool_use_of names the function of every "function" choice
        return NamedFunctionParser(use.function)
    if use.choice == "auto" and server_parser is not None:
        return parser_for(server_parser)
    return None


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def finish_reason(finish: str | None, called: bool, cut: bool = False) -> str | None:
    """The choice's finish_reason: "tool_calls" where calls were made and the output ended by itself (`cut`: a stop
    the request set ended it, so its last call may be unfinished: "stop" stays)."""
    return "tool_calls" if called and finish == "stop" and not cut else finish


class ToolCallChoices:
    """One response's tool-call parsing: whole choices (`message`), or each streamed choice's parser and call ids
    (`delta`, fed every text delta of a choice in order, its last one with the finish reason)."""

    def __init__(self, parser: ToolParser, parallel: bool = True):
        self.parser = parser
        self.parallel = parallel
        self._streams: dict[int, _ChoiceStream] = {}

    def message(self, text: str, finish: str | None, cut: bool = False) -> tuple[dict, str | None]:
        """A whole choice's message and finish_reason (`cut`: Generation.stopped_by_request)."""
        parsed = self.parser.parse(text)
        calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        message: dict = {"role": "assistant", "content": parsed.content or None}
        if calls:
            message["tool_calls"] = [{"id": new_call_id(), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in calls]
        return message, finish_reason(finish, bool(calls), cut)

    def delta(self, index: int, text: str, finish: str | None, cut: bool = False) -> tuple[dict, str | None]:
        """Choice `index`'s stream delta for its next text (the parser's held-back rest flushed with the last, the
        one with a finish reason) and the finish_reason to send with it (`cut`: Generation.stopped_by_request)."""
        stream = self._streams.get(index)
        if stream is None:
            stream = self._streams[index] = _ChoiceStream(self.parser.streamer(), self.parallel)
        out = stream.delta(text, finish is not None)
        return out, finish_reason(finish, bool(stream.ids), cut)


class _ChoiceStream:
    def __init__(self, streamer: ToolStreamParser, parallel: bool):
        self.streamer = streamer
        self.parallel = parallel
        self.ids: dict[int, str] = {}  # call index -> its id, from the call's first piece

    def delta(self, text: str, last: bool) -> dict:
        pieces = [self.streamer.feed(text)] if text else []
        if last:
            pieces.append(self.streamer.finish())
        content = "".join(p.content for p in pieces)
        calls = [self._call(d) for p in pieces for d in self._kept(p)]
        out: dict = {}
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def _kept(self, piece: StreamPiece):
        return piece.tool_calls if self.parallel else [d for d in piece.tool_calls if d.index == 0]

    def _call(self, d) -> dict:
        if d.index in self.ids:
            return {"index": d.index, "function": {"arguments": d.arguments}}
        self.ids[d.index] = new_call_id()
        return {"index": d.index, "id": self.ids[d.index], "type": "function",
                "function": {"name": d.name, "arguments": d.arguments}}
