"""The hermes tool-call format: JSON objects in `<tool_call>` tags, as Qwen2.5's and Qwen3's chat templates and
NousResearch's Hermes 2 Pro function-calling format document.

    I'll look that up.
    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}
    </tool_call>

gives content "I'll look that up." and two calls. The whitespace around the JSON may vary.
"""

from __future__ import annotations

from typing import ClassVar

from shuttle.frontend.tools.parsers.base import ParsedMessage
from shuttle.frontend.tools.parsers.common import (
    JsonValueScanner,
    TaggedBlocks,
    call_of,
    load_json,
    match_tag,
    parse_by_streaming,
    skip_ws,
)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks among content text.

    A block is a call when, after `<tool_call>` and whitespace, comes one JSON object (found by string- and
    nesting-aware scanning, so `</tool_call>` inside a string does not end it), then whitespace and
    `</tool_call>`, and the object has a non-empty string "name" and an object "arguments" (absent: no arguments,
    "{}"). A call's `arguments` is the canonical `json.dumps(arguments, ensure_ascii=False)`, not the model's
    spelling.

    Anything else is content: a block that breaks any of those rules (its text stays content: `<tool_call>` is
    content and the text after it is read again as content, so a later well-formed block still counts), an
    unterminated block at the end, and all text around calls. Whitespace next to a call is dropped (see `Output`).

    Streaming: content is released as it comes, holding back only an end that may be the start of `<tool_call>`
    (and a trailing whitespace run); a block is held until its `</tool_call>` arrives and then released as one
    piece, the name and the whole arguments text together (or, if it is no call, as content).
    """

    name: ClassVar[str] = "hermes"

    def parse(self, text: str) -> ParsedMessage:
        return parse_by_streaming(self.streamer(), text)

    def streamer(self) -> HermesStreamer:
        return HermesStreamer()


class HermesStreamer(TaggedBlocks):
    """One output's hermes parser (see HermesToolParser)."""

    TAG = OPEN
    FIRST_PHASE = "open"

    def __init__(self) -> None:
        super().__init__()
        self._json_start = 0
        self._json_end = 0

    def _block(self, final: bool) -> bool | None:
        """Reads on in the block: True once it is a call (released, `_pos` after `</tool_call>`), False once it
        cannot be one, None when more text is needed."""
        buf = self._buf
        if self._phase == "open":
            self._pos = skip_ws(buf, self._pos)
            if self._pos == len(buf):
                return False if final else None
            if buf[self._pos] != "{":
                return False
            self._json_start, self._phase, self._scanner = self._pos, "json", JsonValueScanner()
        if self._phase == "json":
            self._pos, done = self._scanner.advance(buf, self._pos)
            if not done:
                return False if final else None
            self._json_end, self._phase = self._pos, "close"
        self._pos = skip_ws(buf, self._pos)
        closed = match_tag(buf, self._pos, CLOSE)
        if closed is None:
            return False if final else None
        if not closed:
            return False
        call = call_of(load_json(buf[self._json_start:self._json_end]), ("arguments",), missing_ok=True)
        if call is None:
            return False
        self._pos += len(CLOSE)
        self._out.call(*call)
        return True
