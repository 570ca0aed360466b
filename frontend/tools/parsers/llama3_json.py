"""Llama 3.1/3.2 JSON tool calls, as Meta's Llama 3.1 model card (JSON-based tool calling) and the Llama 3.2
prompt format describe: the whole output is the call, a JSON object, optionally after `<|python_tag|>`.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

gives two calls and no content; several calls are separated by `;`.
"""

from __future__ import annotations

from typing import ClassVar

from shuttle.frontend.tools.parsers.base import ParsedMessage, StreamPiece
from shuttle.frontend.tools.parsers.common import (
    HeldText,
    JsonValueScanner,
    Output,
    call_of,
    load_json,
    parse_by_streaming,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser:
    """`{"name": ..., "parameters": {...}}` objects (also "arguments" for the key), separated by `;`.

    After optional leading whitespace and an optional `<|python_tag|>` (and whitespace), the output must begin
    with `{`, else all of it is content, exactly as written. Then come call objects, each with a non-empty string
    "name" and an object "parameters" or "arguments" (required: a bare `{"name": "Alice"}` is an answer, not a
    call), separated by whitespace, `;`, whitespace. Where that stops (an object that is no call, is no JSON or is
    cut off, or other text after a call): if the first object already fails, the whole output is content as
    written; otherwise the calls so far stand and the text after the last call is content (the whitespace
    next to the call dropped, see `Output`), e.g. `{call}\\n\\nDone.` gives one call and content "Done.". A
    call's `arguments` is the canonical `json.dumps(parameters, ensure_ascii=False)`.

    Streaming: the leading whitespace and tag are held until the first other character says call or content;
    content is then released as it comes. Each call object is held until its closing brace and released whole
    (name and arguments in one piece). Until the first call is complete everything is held, since its failure
    makes all of it content.
    """

    name: ClassVar[str] = "llama3_json"

    def parse(self, text: str) -> ParsedMessage:
        return parse_by_streaming(self.streamer(), text)

    def streamer(self) -> Llama3JsonStreamer:
        return Llama3JsonStreamer()


class Llama3JsonStreamer(HeldText):
    """One output's llama3_json parser (see Llama3JsonToolParser)."""

    def __init__(self) -> None:
        self._out = Output()
        self._buf = ""  # unreleased text: from the start of the output, or from the end of the last call
        self._state = "start"  # "start", "object", "between" (after a call), "content" (the rest is content)
        self._pos = 0
        self._object_start = 0
        self._scanner = JsonValueScanner()
        self._chunks: list[str] = []  # see HeldText

    def feed(self, delta: str) -> StreamPiece:
        if self._state == "content":
            self._out.content(delta)
        elif self._scan_held(delta):
            self._run(final=False)
        return self._out.take()

    def finish(self) -> StreamPiece:
        self._join_held()
        if self._state != "content":
            self._run(final=True)
        return self._out.finish()

    def _scanning(self) -> bool:
        return self._state == "object"

    def _to_content(self) -> None:
        self._out.content(self._buf)
        self._buf, self._state = "", "content"

    def _run(self, final: bool) -> None:
        buf = self._buf
        if self._state == "start":
            pos = skip_ws(buf, 0)
            rest = buf[pos:pos + len(PYTHON_TAG)]
            if rest == PYTHON_TAG:
                pos = skip_ws(buf, pos + len(PYTHON_TAG))
            elif PYTHON_TAG.startswith(rest) and not final:
                return  # "" or a part of the tag: wait
            if pos == len(buf):
                if final:
                    self._to_content()
                return
            if buf[pos] != "{":
                self._to_content()
                return
            self._state, self._object_start, self._pos, self._scanner = "object", pos, pos, JsonValueScanner()
        while True:
            if self._state == "object":
                self._pos, done = self._scanner.advance(buf, self._pos)
                if not done:
                    if final:
                        self._to_content()
                    return
                call = call_of(load_json(buf[self._object_start:self._pos]), ("parameters", "arguments"), False)
                if call is None:
                    self._to_content()
                    return
                self._out.call(*call)
                buf = self._buf = buf[self._pos:]
                self._state, self._pos = "between", 0
            pos = skip_ws(buf, 0)
            if pos < len(buf) and buf[pos] == ";":
                pos = skip_ws(buf, pos + 1)
                if pos < len(buf) and buf[pos] == "{":
                    self._state, self._object_start, self._pos = "object", pos, pos
                    self._scanner = JsonValueScanner()
                    continue
                if pos < len(buf):
                    self._to_content()
                elif final:
                    self._to_content()
                return
            if pos < len(buf) or final:
                self._to_content()
            return
