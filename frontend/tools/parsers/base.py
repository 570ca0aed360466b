"""What every tool-call parser returns: a model's text split into content and tool calls, whole or streamed.

A parser reads the text a model wrote in its own tool-call format (hermes `<tool_call>{...}</tool_call>`, Llama 3
JSON, Mistral `[TOOL_CALLS]`, or the JSON array shuttle's grammar forces for tool_choice "required") and returns
OpenAI's shape. The streaming form holds back only what might still turn out to be part of a call, and for any
split of the same text its pieces add up to what `parse` returns: the contents concatenated equal
`ParsedMessage.content`, and call i's `arguments` pieces concatenated equal `tool_calls[i].arguments`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol


@dataclass
class ToolCall:
    """One call: the function's name and its arguments as JSON text (an object), as the model wrote them."""

    name: str
    arguments: str


@dataclass
class ParsedMessage:
    """A whole output: the text outside tool calls ("" when none) and the calls, in order."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """The next piece of call `index` (0-based, in order): `name` on the call's first piece only, then pieces of
    its arguments text."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class StreamPiece:
    """What one fed text delta released: content text and tool-call pieces (either may be empty)."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolStreamParser(Protocol):
    """One output's incremental parser: `feed` every text delta in order, then `finish` once."""

    def feed(self, delta: str) -> StreamPiece: ...

    def finish(self) -> StreamPiece:
        """Release what was held back (the stream ended)."""
        ...


class ToolParser(Protocol):
    """A tool-call format, named for --tool-call-parser."""

    name: ClassVar[str]

    def parse(self, text: str) -> ParsedMessage: ...

    def streamer(self) -> ToolStreamParser: ...
