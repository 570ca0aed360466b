"""A named tool_choice: the server's grammar forces the arguments object of that one function.

With tool_choice {"type": "function", "function": {"name": "get_weather"}} the output is, e.g.,

    {"city": "Paris"}

and the message is one call, get_weather with those arguments, and no content.
"""

from __future__ import annotations

from typing import ClassVar

from shuttle.frontend.tools.parsers.base import ParsedMessage, StreamPiece
from shuttle.frontend.tools.parsers.common import Output, parse_by_streaming


class NamedFunctionParser:
    """The whole output is the arguments of `name_of_function`: one call, arguments = the text as written, with
    surrounding whitespace stripped (str.strip), content "". Not selectable with --tool-call-parser.

    Streaming: the name on the first piece (the first `feed`, or `finish` when nothing was fed), then the text as
    it arrives, without leading whitespace and holding back a trailing whitespace run until more text follows it.
    """

    name: ClassVar[str] = "named"

    def __init__(self, name_of_function: str):
        self.name_of_function = name_of_function

    def parse(self, text: str) -> ParsedMessage:
        return parse_by_streaming(self.streamer(), text)

    def streamer(self) -> NamedFunctionStreamer:
        return NamedFunctionStreamer(self.name_of_function)


class NamedFunctionStreamer:
    """One output's named-function parser (see NamedFunctionParser)."""

    def __init__(self, name_of_function: str):
        self._name = name_of_function
        self._out = Output()
        self._started = False
        self._seen_text = False  # whether a non-whitespace character has come
        self._held_ws = ""

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._out.start_call(self._name)

    def feed(self, delta: str) -> StreamPiece:
        self._start()
        if not self._seen_text:
            delta = delta.lstrip()
            self._seen_text = bool(delta)
        body = delta.rstrip()
        if body:
            self._out.arguments(self._held_ws + body)
            self._held_ws = delta[len(body):]
        else:
            self._held_ws += delta
        return self._out.take()

    def finish(self) -> StreamPiece:
        self._start()
        return self._out.finish()
