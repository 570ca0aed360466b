"""Mistral tool calls after the `[TOOL_CALLS]` token, in the two forms mistral-common's tokenizers write:

    Checking.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]

(tokenizers up to v7: Mistral 7B Instruct v0.3, Mixtral 8x22B, Mistral Nemo; the objects may carry an "id"), and

    Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}

(v11 and later: Mistral Small 3.1+, Magistral, Devstral; one `[TOOL_CALLS]name[ARGS]{...}` per call, with an
optional `[CALL_ID]id` before `[ARGS]`). Both give content "Checking." and two calls.
"""

from __future__ import annotations

import re
from typing import ClassVar

from shuttle.frontend.tools.parsers.base import ParsedMessage
from shuttle.frontend.tools.parsers.common import (
    JsonValueScanner,
    TaggedBlocks,
    call_of,
    load_json,
    match_end,
    match_tag,
    parse_by_streaming,
    skip_ws,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"
_NAME = re.compile(r"[\w.:\-]*")
_ID = re.compile(r"[A-Za-z0-9_\-]*")


class MistralToolParser:
    """`[TOOL_CALLS]` then a JSON array of calls, or `[TOOL_CALLS]name[ARGS]{...}` per call; text before is content.

    After `[TOOL_CALLS]` (and whitespace): a `[` starts the array form, which must be a JSON array of objects each
    with a non-empty string "name" and an object "arguments" (or "parameters"; absent: "{}"); anything else is the
    v11 form: a name of word characters, `.`, `:` or `-`, optionally `[CALL_ID]` and an id, then `[ARGS]`,
    whitespace, and one JSON object (found by string- and nesting-aware scanning). Arguments are the canonical
    `json.dumps(arguments, ensure_ascii=False)`. Where the text breaks the form (or is cut off), `[TOOL_CALLS]` and
    what follows is content: the token's text is kept as content and what comes after it is read again as
    content, so a later well-formed `[TOOL_CALLS]` still counts. Text between and after calls is content too,
    with the whitespace next to a call dropped (see `Output`).

    Streaming: content is released as it comes, holding back only an end that may be the start of `[TOOL_CALLS]`
    (and a trailing whitespace run). A `[TOOL_CALLS]` block is held until its JSON array or arguments object is
    closed, then its calls are released whole (name and arguments in one piece each).
    """

    name: ClassVar[str] = "mistral"

    def parse(self, text: str) -> ParsedMessage:
        return parse_by_streaming(self.streamer(), text)

    def streamer(self) -> MistralStreamer:
        return MistralStreamer()


class MistralStreamer(TaggedBlocks):
    """One output's mistral parser (see MistralToolParser)."""

    TAG = TOOL_CALLS
    FIRST_PHASE = "start"

    def __init__(self) -> None:
        super().__init__()
        self._name_start = self._name_end = self._json_start = 0
        self._array = False

    def _block(self, final: bool) -> bool | None:
        """Reads on in the block: True once its calls are released (`_pos` after them), False once it is no
        call, None when more text is needed."""
        buf = self._buf
        wait = False if final else None
        if self._phase == "start":
            self._pos = skip_ws(buf, self._pos)
            if self._pos == len(buf):
                return wait
            self._array = buf[self._pos] == "["
            self._phase = "open" if self._array else "name"
            self._name_start = self._pos
        if self._phase == "name":
            self._pos = match_end(_NAME, buf, self._pos)
            if self._pos == len(buf):
                return wait
            self._name_end = self._pos
            if self._name_end == self._name_start:
                return False
            self._phase = "id_or_args"
        if self._phase == "id_or_args":
            is_id = match_tag(buf, self._pos, CALL_ID)
            is_args = match_tag(buf, self._pos, ARGS)
            if is_id:
                self._pos += len(CALL_ID)
                self._phase = "id"
            elif is_args:
                self._pos += len(ARGS)
                self._phase = "open"
            elif is_id is None or is_args is None:
                return wait
            else:
                return False
        if self._phase == "id":
            self._pos = match_end(_ID, buf, self._pos)
            is_args = match_tag(buf, self._pos, ARGS)
            if is_args is None:
                return wait
            if not is_args:
                return False
            self._pos += len(ARGS)
            self._phase = "open"
        if self._phase == "open":
            self._pos = skip_ws(buf, self._pos)
            if self._pos == len(buf):
                return wait
            if buf[self._pos] != ("[" if self._array else "{"):
                return False
            self._json_start, self._phase, self._scanner = self._pos, "json", JsonValueScanner()
        self._pos, done = self._scanner.advance(buf, self._pos)
        if not done:
            return wait
        value = load_json(buf[self._json_start:self._pos])
        if self._array:
            if not isinstance(value, list) or not value:
                return False
            calls = [call_of(item, ("arguments", "parameters"), missing_ok=True) for item in value]
            if any(call is None for call in calls):
                return False
        else:
            if not isinstance(value, dict):
                return False
            calls = [call_of({"name": buf[self._name_start:self._name_end], "arguments": value}, ("arguments",), False)]
        for call in calls:
            assert call is not None  # checked above (an array's), or a non-empty name and object arguments
            self._out.call(*call)
        return True
