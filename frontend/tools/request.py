"""A chat request's tools as OpenAI (and vLLM) take them: `tools`, `tool_choice`, `parallel_tool_calls`, and the
tool calls of earlier assistant turns; resolved once per request into a ToolUse, and for tool_choice "required" or a
named function into the output constraint that forces the calls (a StructuredOutput for the worker's grammar).

    tool_choice   the output                                      parsed by (frontend/tools/calls.py)
    none          text (tools still reach the chat template)      nothing
    auto          text, tool calls in the model's own format      the server's --tool-call-parser
    required      a JSON array [{"name", "parameters"}, ...]      JsonArrayCallsParser
    named         that function's arguments object                NamedFunctionParser

As in vLLM: tools given and tool_choice absent means "auto", which needs the server started with
--enable-auto-tool-choice and --tool-call-parser.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Sequence

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.structured.request import MAX_SCHEMA_BYTES
from shuttle.frontend.structured.schema_support import MAX_SCHEMA_DEPTH, check_schema

NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names
EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function's parameters when it declares none
AUTO_NEEDS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A tool's function. `parameters`: a JSON schema of its arguments object (None: no arguments)."""

    name: Annotated[str, msgspec.Meta(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One entry of `tools`."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """tool_choice {"type": "function", "function": {"name": ...}}: call exactly this function."""

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text of an object, as the model wrote it


class MessageToolCall(msgspec.Struct, kw_only=True):
    """A call in an earlier assistant message (`messages[i].tool_calls[j]`), as responses give them."""

    id: str
    type: Literal["function"]
    function: CalledFunction


@dataclass(frozen=True)
class ToolUse:
    """A request's tools, checked.

    Attributes:
        tools: the listed tools (empty: none).
        choice: "none", "auto", "required", or "function" for a named function.
        function: the named function (choice "function" only).
        parallel: parallel_tool_calls: with false, at most one call per choice.
    """

    tools: tuple[Tool, ...] = ()
    choice: str = "none"
    function: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The output is constrained to tool calls ("required" or a named function)."""
        return self.choice in ("required", "function")


def tool_use_of(tools: list[Tool] | None, tool_choice: ToolChoice | None, parallel_tool_calls: bool,
                auto_tool_choice: bool) -> ToolUse:
    """The request's tools checked against each other and the server (`auto_tool_choice`: the server was started
    with --enable-auto-tool-choice and a --tool-call-parser).

    Raises:
        InvalidRequestError: a tool named twice, or parameters that are no valid JSON schema (param "tools");
            tool_choice other than "none" without tools, naming a function that is not listed, or "auto" on a
            server without auto tool choice (param "tool_choice").
    """
    listed = tuple(tools or ())
    names = [t.function.name for t in listed]
    repeated = sorted(name for name, count in Counter(names).items() if count > 1)
    if repeated:
        raise InvalidRequestError(f"tools must have distinct names; {', '.join(repeated)} is listed more than once",
                                  param="tools")
    for i, tool in enumerate(listed):
        _check_size(tool.function.schema, f"tools[{i}].function.parameters")
        # a valid schema whatever the choice; what the grammar engine keeps is checked where it is enforced
        check_schema(tool.function.schema, "tools", f"tools[{i}].function.parameters", enforced=False)
    if tool_choice is None:
        tool_choice = "auto" if listed else "none"
    if tool_choice == "none":
        return ToolUse(listed, "none", None, parallel_tool_calls)
    if not listed:
        raise InvalidRequestError("tool_choice needs tools: list the functions the model may call",
                                  param="tool_choice")
    if isinstance(tool_choice, NamedToolChoice):
        name = tool_choice.function.name
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not in tools",
                                      param="tool_choice")
        return ToolUse(listed, "function", name, parallel_tool_calls)
    if tool_choice == "auto" and not auto_tool_choice:
        raise InvalidRequestError(AUTO_NEEDS, param="tool_choice")
    return ToolUse(listed, tool_choice, None, parallel_tool_calls)


def tool_constraint(use: ToolUse) -> StructuredOutput | None:
    """The grammar that forces tool calls: for "required" a JSON array of at least one {"name", "parameters"}
    object (at most one without parallel_tool_calls), each naming a listed tool with arguments that match its
    schema; for a named function its arguments object; None for "none" and "auto" (the model decides).

    For "required" a tool's schema that holds references moves under the array schema's `$defs` (as `tool_<i>`),
    its local references rewritten to point there, so `$defs`/`$ref` inside a tool's parameters (every pydantic
    model's) still resolve; the others are written in place.

    Raises:
        InvalidRequestError: a forced tool's schema asks for what the grammar engine would not keep
            (frontend/structured/schema_support.py), or the constraint is over MAX_SCHEMA_BYTES (param "tools").
    """
    if use.choice == "function":
        i, tool = next((i, t) for i, t in enumerate(use.tools) if t.function.name == use.function)
        check_schema(tool.function.schema, "tools", f"tools[{i}].function.parameters")
        return _json(tool.function.schema)
    if use.choice != "required":
        return None
    calls, defs = [], {}
    for i, tool in enumerate(use.tools):
        parameters = tool.function.schema
        check_schema(parameters, "tools", f"tools[{i}].function.parameters")
        if '"$ref"' in msgspec.json.encode(parameters).decode():
            defs[f"tool_{i}"] = _rebased(parameters, f"#/$defs/tool_{i}")
            parameters = {"$ref": f"#/$defs/tool_{i}"}
        calls.append({"type": "object", "properties": {"name": {"enum": [tool.function.name]},
                                                       "parameters": parameters},
                      "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, **({} if use.parallel else {"maxItems": 1}),
              "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}
    return _json(schema)


def _json(schema: dict[str, Any]) -> StructuredOutput:
    spec = msgspec.json.encode(schema)
    if len(spec) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"the forced tool calls' schema (the tools' parameters together) is over "
                                  f"{MAX_SCHEMA_BYTES // 1024} KiB", param="tools")
    return StructuredOutput(kind="json", spec=spec.decode())


def _rebased(schema: Any, base: str) -> Any:
    """`schema` with each local `$ref` ("#", "#/...") made relative to `base` (where the schema will sit)."""
    if isinstance(schema, list):
        return [_rebased(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _rebased(value, base) for key, value in schema.items() if key != "$ref"}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = base + ref[1:]
    elif "$ref" in schema:
        out["$ref"] = ref
    return out


def _check_size(schema: dict[str, Any], where: str) -> None:
    """A tool's parameters within MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH (the template and the grammar read them).

    Raises:
        InvalidRequestError: param "tools".
    """
    stack: list[tuple[Any, int]] = [(schema, 0)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise InvalidRequestError(f"{where} is nested more than {MAX_SCHEMA_DEPTH} deep", param="tools")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    try:
        size = len(msgspec.json.encode(schema))
    except (TypeError, ValueError) as exc:
        raise InvalidRequestError(f"{where} is not a JSON value: {exc}", param="tools") from None
    if size > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"{where} is over {MAX_SCHEMA_BYTES // 1024} KiB", param="tools")


def template_tools(tools: Sequence[Tool]) -> list[dict[str, Any]] | None:
    """The tools as the chat template reads them (OpenAI's shape: {"type": "function", "function": {...}}), None
    when there are none (templates test `tools is not none`)."""
    if not tools:
        return None
    return [{"type": "function", "function": _function(t.function)} for t in tools]


def _function(f: FunctionDefinition) -> dict[str, Any]:
    out: dict[str, Any] = {"name": f.name}
    if f.description is not None:
        out["description"] = f.description
    out["parameters"] = f.schema
    if f.strict is not None:
        out["strict"] = f.strict
    return out
