"""The calls shuttle's grammar forces for tool_choice "required": the whole output is one JSON array of calls.

    [{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

(xgrammar writes it compactly, with ", " and ": " separators; any JSON whitespace is accepted). Not selectable
with --tool-call-parser: the server uses it itself whenever it constrained the output to this shape.
"""

from __future__ import annotations

from typing import ClassVar

from shuttle.frontend.tools.parsers.base import ParsedMessage, StreamPiece
from shuttle.frontend.tools.parsers.common import JsonValueScanner, Output, load_json, parse_by_streaming, skip_ws

_NO_VALUE_START = ",:]}"


class JsonArrayCallsParser:
    """`[{"name": "fn", "parameters": {...}}, ...]`: calls with the raw text of each "parameters" value.

    A call's `arguments` is the "parameters" value exactly as the model wrote it (from its first character to its
    last, not re-serialized), its `name` the decoded "name" string; the keys may come in either order, other keys
    are skipped. Content is "". Leniencies, for an output the grammar did not shape: an output whose first
    non-whitespace character is not `[` is all content, as written; a call object without "name" is dropped; one
    without "parameters" gets "{}" (but "" when the output is cut off before them); where the text stops being the
    expected shape (or after the closing `]`) the rest of it is content, from its first non-whitespace character; an
    output cut off inside a call keeps that call with the arguments text so far (a name cut off: the call is
    dropped, and an output cut off before any call's name was complete has no call and no content: the grammar's
    wrapper so far, `[{"name": "ge`, says nothing, as vLLM's content "" for such an output).

    Streaming is character-level: a call's name is released as soon as its string is closed, then its
    "parameters" text piece by piece as it arrives (held until the name is known when "parameters" comes first).
    Each character is read once (an incremental scanner tracks strings, escapes and nesting), so a long output
    costs time linear in its length.
    """

    name: ClassVar[str] = "json_array"

    def parse(self, text: str) -> ParsedMessage:
        return parse_by_streaming(self.streamer(), text)

    def streamer(self) -> JsonArrayStreamer:
        return JsonArrayStreamer()


class JsonArrayStreamer:
    """One output's json_array parser (see JsonArrayCallsParser).

    States: "start" (before the `[`), "element" (after `[` or `,`: an object or `]`), "after_element" (`,` or
    `]`), "key" (before a key: a string or `}`), "key_string", "colon", "value" (before a value),
    "value_string"/"parameters"/"skip" (inside the "name" string, the "parameters" value, another value),
    "after_value" (`,` or `}`), "end" (after `]`), "content" (the rest is content).
    """

    def __init__(self) -> None:
        self._out = Output()
        self._state = "start"
        self._lead = ""  # whitespace before the first character, held
        self._token: list[str] = []  # the key or name string read so far
        self._key = ""
        self._scanner = JsonValueScanner()
        self._name: str | None = None  # this call's name, once known
        self._started = False  # whether this call has been started on the output
        self._held: list[str] = []  # this call's parameters text while its name is unknown
        self._had_parameters = False

    def feed(self, delta: str) -> StreamPiece:
        self._run(delta)
        return self._out.take()

    def finish(self) -> StreamPiece:
        if self._state == "start":
            self._out.content(self._lead)
        self._end_call(cut=True)
        return self._out.finish()

    def _new_call(self) -> None:
        self._name, self._started, self._held, self._had_parameters = None, False, [], False

    def _parameters(self, text: str) -> None:
        if self._started:
            self._out.arguments(text)
        else:
            self._held.append(text)

    def _run(self, text: str) -> None:
        pos, end = 0, len(text)
        while pos < end:
            state = self._state
            if state == "content":
                self._out.content(text[pos:])
                return
            if state in ("key_string", "value_string", "parameters", "skip"):
                stop, done = self._scanner.advance(text, pos)
                piece = text[pos:stop]
                pos = stop
                if state == "parameters":
                    self._parameters(piece)
                elif state != "skip":
                    self._token.append(piece)
                if done:
                    self._value_done(state)
                continue
            skipped = skip_ws(text, pos)
            if state == "start":
                self._lead += text[pos:skipped]
            pos = skipped
            if pos == end:
                return
            char = text[pos]
            if state == "start":
                if char == "[":
                    self._state = "element"
                    pos += 1
                else:
                    self._out.content(self._lead)
                    self._state = "content"
            elif state == "element" and char in "{]" or state == "after_element" and char in ",]":
                if char == "{":
                    self._new_call()
                    self._state = "key"
                else:
                    self._state = "element" if char == "," else "end"
                pos += 1
            elif state == "key" and char in '"}' or state == "after_value" and char in ",}":
                if char == '"':
                    self._state, self._token, self._scanner = "key_string", [], JsonValueScanner()
                elif char == ",":
                    self._state = "key"
                    pos += 1
                else:
                    self._end_call()
                    self._state = "after_element"
                    pos += 1
            elif state == "colon" and char == ":":
                self._state = "value"
                pos += 1
            elif state == "value" and char not in _NO_VALUE_START:
                self._scanner = JsonValueScanner()
                if self._key == "name" and char == '"' and self._name is None:
                    self._state, self._token = "value_string", []
                elif self._key == "parameters" and not self._had_parameters:
                    self._state, self._had_parameters = "parameters", True
                else:
                    self._state = "skip"
            else:
                self._end_call()
                self._state = "content"

    def _value_done(self, state: str) -> None:
        if state == "key_string":
            key = load_json("".join(self._token))
            self._key = key if isinstance(key, str) else ""
            self._state = "colon"
            return
        if state == "value_string":
            name = load_json("".join(self._token))
            if isinstance(name, str) and name:
                self._name = name
                self._started = True
                self._out.start_call(name)
                for piece in self._held:
                    self._out.arguments(piece)
                self._held = []
        self._state = "after_value"

    def _end_call(self, cut: bool = False) -> None:
        """The call object is left (closed or broken off): a named call that had no "parameters" gets "{}". One the
        output cut off (`cut`, max_tokens) keeps the arguments written so far, none: nothing is made up."""
        if self._started and not self._had_parameters and not cut:
            self._out.arguments("{}")
        self._started = self._had_parameters = False

