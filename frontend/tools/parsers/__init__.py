"""Tool-call parsers: a model's output text split into content and OpenAI tool calls, whole or streamed.

`PARSERS` holds the formats a user can pick with --tool-call-parser; `JsonArrayCallsParser` (tool_choice
"required") and `NamedFunctionParser` (a named tool_choice) read what shuttle's own grammar forces.
"""

from __future__ import annotations

from shuttle.frontend.tools.parsers.base import ParsedMessage, StreamPiece, ToolCall, ToolCallDelta, ToolParser
from shuttle.frontend.tools.parsers.hermes import HermesToolParser
from shuttle.frontend.tools.parsers.json_array import JsonArrayCallsParser
from shuttle.frontend.tools.parsers.llama3_json import Llama3JsonToolParser
from shuttle.frontend.tools.parsers.mistral import MistralToolParser
from shuttle.frontend.tools.parsers.named import NamedFunctionParser

PARSERS: dict[str, type] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
    MistralToolParser.name: MistralToolParser,
}


def parser_for(name: str) -> ToolParser:
    """The --tool-call-parser format `name`; ValueError naming the known ones for any other."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}") from None


__all__ = [
    "PARSERS",
    "HermesToolParser",
    "JsonArrayCallsParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedFunctionParser",
    "ParsedMessage",
    "StreamPiece",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "parser_for",
]
