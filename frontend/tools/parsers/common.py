"""What the tool-call parsers share: an incremental JSON value scanner, the output builder, parse-by-streaming.

Every parser's `parse` is its streamer fed the whole text at once and finished (`parse_by_streaming`), so the
whole-text answer and the streamed one come from the same code; the streamers' decisions depend only on the text
seen so far, never on where it was split, which is what makes any split add up to `parse`.
"""

from __future__ import annotations

import json
import re

from shuttle.frontend.tools.parsers.base import ParsedMessage, StreamPiece, ToolCall, ToolCallDelta, ToolStreamParser

JSON_WS = re.compile(r"[ \t\n\r]*")
_IN_STRING_STOP = re.compile(r'["\\]')
_STRUCTURE_STOP = re.compile(r'["{}\[\]]')
_SCALAR = re.compile(r"[^,}\] \t\n\r]*")


def match_end(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """Where the longest run of `pattern` (a starred character class, which matches anywhere, if only the empty
    string) that starts at `pos` ends."""
    match = pattern.match(text, pos)
    assert match is not None  # a pattern that matches the empty string matches at every position
    return match.end()


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-JSON-whitespace character at or after `pos` (len(text) when none)."""
    return match_end(JSON_WS, text, pos)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (what to hold back)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def match_tag(text: str, pos: int, tag: str) -> bool | None:
    """Whether `tag` is at `pos`: True, False, or None when the text ends inside what may still become it."""
    avail = text[pos:pos + len(tag)]
    if not tag.startswith(avail):
        return False
    return True if len(avail) == len(tag) else None


class JsonValueScanner:
    """Finds where one JSON value ends, in text fed in order, without parsing it.

    Tracks string and escape state and the nesting depth of objects and arrays: an object or array ends at the
    bracket that brings the depth back to 0, a string at its closing quote, a bare scalar (number, true, ...)
    before the first `,` `}` `]` or whitespace. Each character is looked at once (regular expressions jump over
    the runs that cannot change the state), so scanning a value fed in many deltas is linear in its length. It
    does not validate: mismatched brackets are the caller's json.loads to find.
    """

    def __init__(self) -> None:
        self._started = False
        self._scalar = False
        self._depth = 0
        self._in_string = False
        self._escape = False
        self.done = False  # the value has ended (advance returns at once from then on)

    def advance(self, text: str, pos: int) -> tuple[int, bool]:
        """Scan `text` from `pos` (the value's first character the first time); returns (position, done): done
        means the value ended just before that position, else all of `text` was consumed."""
        if self.done:
            return pos, True
        pos, self.done = self._advance(text, pos)
        return pos, self.done

    def _advance(self, text: str, pos: int) -> tuple[int, bool]:
        end = len(text)
        if not self._started:
            if pos >= end:
                return pos, False
            self._started = True
            self._scalar = text[pos] not in '{["'
        if self._scalar:
            stop = match_end(_SCALAR, text, pos)
            return stop, stop < end
        while pos < end:
            if self._escape:
                self._escape = False
                pos += 1
            elif self._in_string:
                found = _IN_STRING_STOP.search(text, pos)
                if found is None:
                    return end, False
                pos = found.end()
                if found.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                    if self._depth == 0:
                        return pos, True
            else:
                found = _STRUCTURE_STOP.search(text, pos)
                if found is None:
                    return end, False
                pos = found.end()
                char = found.group()
                if char == '"':
                    self._in_string = True
                elif char in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth <= 0:
                        return pos, True
        return end, False


def load_json(text: str) -> object:
    """`json.loads`, or None for text that is no JSON (or too deeply nested to parse)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def call_of(obj: object, keys: tuple[str, ...], missing_ok: bool) -> tuple[str, str] | None:
    """(name, canonical arguments) of a decoded call object `{"name": str, <key>: {...}}`, or None.

    The arguments are the first of `keys` present, which must be an object; with none present, `missing_ok` says
    whether that means no arguments ("{}"). Canonical arguments: `json.dumps(obj, ensure_ascii=False)`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    for key in keys:
        if key in obj:
            arguments = obj[key]
            return (obj["name"], json.dumps(arguments, ensure_ascii=False)) if isinstance(arguments, dict) else None
    return (obj["name"], "{}") if missing_ok else None


class Output:
    """Builds the StreamPieces of one output: content text and tool calls, released by `take`.

    Whitespace next to a call is no content: the whitespace run just before a call and the one just after it are
    dropped (so "Let me check.\\n<call>\\n<call>\\n" has content "Let me check."); all other content, whitespace
    included, is kept exactly. Streaming that rule means holding a trailing whitespace run of content until what
    follows it is known (more content: released; a call: dropped; the end: released). Pieces are gathered in
    lists and joined once per `take`, so many small deltas cost linear time.
    """

    def __init__(self) -> None:
        self._content: list[str] = []
        self._deltas: list[tuple[int, str | None, list[str]]] = []  # index, name, arguments pieces
        self._held_ws = ""
        self._after_call = False
        self.calls = 0  # calls started so far

    def content(self, text: str) -> None:
        if not text:
            return
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if body:
            self._content.append(self._held_ws + body)
            self._held_ws = text[len(body):]
        else:
            self._held_ws += text

    def start_call(self, name: str) -> None:
        """A new call (index `calls`); its arguments follow through `arguments`."""
        self._held_ws = ""
        self._after_call = True
        self._deltas.append((self.calls, name, []))
        self.calls += 1

    def arguments(self, text: str) -> None:
        """More arguments text of the call started last."""
        if not text:
            return
        if not self._deltas or self._deltas[-1][0] != self.calls - 1:
            self._deltas.append((self.calls - 1, None, []))
        self._deltas[-1][2].append(text)

    def call(self, name: str, arguments: str) -> None:
        self.start_call(name)
        self.arguments(arguments)

    def take(self) -> StreamPiece:
        piece = StreamPiece(
            content="".join(self._content),
            tool_calls=[ToolCallDelta(index, name, "".join(parts)) for index, name, parts in self._deltas],
        )
        self._content, self._deltas = [], []
        return piece

    def finish(self) -> StreamPiece:
        """Releases held trailing whitespace (nothing follows it) and what is pending."""
        self._content.append(self._held_ws)
        self._held_ws = ""
        return self.take()


class HeldText:
    """What the block-holding streamers share: `_buf`, the text held back, and `_pos`, how far a block in it has
    been read, while `_scanner` looks for the end of the block's JSON.

    Deltas that only continue a JSON value still being scanned (`_scanning()` and the scanner not done) are
    scanned as they come and kept in `_chunks`, joined to `_buf` once, when the value ends or the stream does: a
    long value held through many deltas would otherwise be copied whole on every one.
    """

    _buf: str
    _pos: int
    _scanner: JsonValueScanner
    _chunks: list[str]

    def _scanning(self) -> bool:
        """Whether the streamer is inside a block's JSON value."""
        raise NotImplementedError

    def _scan_held(self, delta: str) -> bool:
        """Adds `delta` to the held text; False when that is all there is to do (the value goes on)."""
        if not self._scanning() or self._scanner.done:
            self._buf += delta
            return True
        self._chunks.append(delta)
        stop, done = self._scanner.advance(delta, 0)
        if done:
            self._join_held()
            self._pos = len(self._buf) - len(delta) + stop
        return done

    def _join_held(self) -> None:
        if self._chunks:
            self._buf += "".join(self._chunks)
            self._chunks = []
            self._pos = len(self._buf)


class TaggedBlocks(HeldText):
    """A streamer for formats whose calls come in blocks opened by a tag (hermes `<tool_call>`, mistral
    `[TOOL_CALLS]`): content is released as it comes, holding back only an end that may be the start of TAG; a
    block is read by the subclass's `_block` and released when it is a call, or, when it is not, its TAG goes out as
    content and the text after it is read again.

    Subclasses set TAG and FIRST_PHASE (the block's phase just after TAG) and write `_block(final)`: True once the
    block's calls are released (`_pos` after them), False once it is no call, None when more text is needed. The
    phase "json" means the block's JSON value is being scanned (see HeldText).
    """

    TAG: str
    FIRST_PHASE: str

    def __init__(self) -> None:
        self._out = Output()
        self._buf = ""  # text not yet released; in a block it starts with TAG
        self._in_block = False
        self._phase = ""
        self._pos = 0  # in a block: how far into _buf it has been read
        self._scanner = JsonValueScanner()
        self._chunks: list[str] = []  # see HeldText

    def feed(self, delta: str) -> StreamPiece:
        if self._scan_held(delta):
            self._run(final=False)
        return self._out.take()

    def finish(self) -> StreamPiece:
        self._join_held()
        self._run(final=True)
        return self._out.finish()

    def _scanning(self) -> bool:
        return self._in_block and self._phase == "json"

    def _block(self, final: bool) -> bool | None:
        raise NotImplementedError

    def _run(self, final: bool) -> None:
        tag = self.TAG
        while True:
            if not self._in_block:
                start = self._buf.find(tag)
                if start < 0:
                    keep = 0 if final else partial_suffix(self._buf, tag)
                    self._out.content(self._buf[:len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    return
                self._out.content(self._buf[:start])
                self._buf = self._buf[start:]
                self._in_block, self._phase, self._pos = True, self.FIRST_PHASE, len(tag)
                continue
            verdict = self._block(final)
            if verdict is None:
                return
            if verdict:
                self._buf = self._buf[self._pos:]
            else:
                self._out.content(tag)
                self._buf = self._buf[len(tag):]
            self._in_block = False


def parse_by_streaming(streamer: ToolStreamParser, text: str) -> ParsedMessage:
    """What a streamer gives for the whole text as one delta, assembled into a ParsedMessage."""
    content: list[str] = []
    calls: list[ToolCall] = []
    for piece in (streamer.feed(text), streamer.finish()):
        content.append(piece.content)
        for delta in piece.tool_calls:
            if delta.index == len(calls):
                calls.append(ToolCall(name=delta.name or "", arguments=delta.arguments))
            else:
                calls[delta.index].arguments += delta.arguments
    return ParsedMessage(content="".join(content), tool_calls=calls)
