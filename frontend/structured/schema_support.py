"""What the grammar engine keeps of a JSON schema or a regex, checked before anything is compiled.

xgrammar (0.2.x) compiles some constraints into a weaker grammar than the schema says, with only a warning on the
worker's stderr: `maxLength` beside `pattern` is dropped, `uniqueItems` ignored, `"required": ["a"]` without a
property "a" gives `{}`, a remote `$ref` accepts any value, `\\A` in a regex matches the letter A. Served as they
are, those outputs would break the promise that the output follows the schema. So every schema (response_format,
structured_outputs, guided_json, tool parameters) and every regex is walked here first, and each construct the
engine would not keep is refused with a 400 that names it and where it is. KEYWORDS is the table of every keyword
and how it fares; tests/unit/test_schema_support.py checks each row against the engine itself, and docs/
structured-outputs.md holds the table as `scripts/dev/schema_keyword_table.py` prints it.
"""

from __future__ import annotations

import json
from typing import Any

from shuttle.common.errors import InvalidRequestError

JSON_TYPES = ("string", "number", "integer", "boolean", "object", "array", "null")  # what `type` may name
MAX_SCHEMA_DEPTH = 64  # nested subschemas; deeper is refused before any walk or compile could recurse on it

ENFORCED, REFUSED, ANNOTATION = "enforced", "refused", "annotation (not a constraint)"
# keyword -> (how it fares, the condition or the reason)
KEYWORDS: dict[str, tuple[str, str]] = {
    "type": (ENFORCED, "one type or a non-empty list of types"),
    "enum": (ENFORCED, "a non-empty list; each value satisfying the keywords beside it, if any (the engine writes the "
                       "listed values and keeps no other keyword)"),
    "const": (ENFORCED, "satisfying the keywords beside it, if any (the engine writes it and keeps no other keyword)"),
    "properties": (ENFORCED, ""),
    "required": (ENFORCED, "each name must be one of `properties`; refused otherwise (the engine writes `{}`)"),
    "additionalProperties": (ENFORCED, ""),
    "patternProperties": (ENFORCED, ""),
    "propertyNames": (ENFORCED, ""),
    "unevaluatedProperties": (ENFORCED, ""),
    "minProperties": (ENFORCED, "refused by the engine when more than the properties it can write"),
    "maxProperties": (ENFORCED, ""),
    "items": (ENFORCED, "a schema or a boolean"),
    "prefixItems": (ENFORCED, ""),
    "unevaluatedItems": (ENFORCED, ""),
    "minItems": (ENFORCED, ""),
    "maxItems": (ENFORCED, ""),
    "minimum": (ENFORCED, "with `type` integer or number; refused without a `type`"),
    "maximum": (ENFORCED, "with `type` integer or number; refused without a `type`"),
    "exclusiveMinimum": (ENFORCED, "with `type` integer or number; refused without a `type`"),
    "exclusiveMaximum": (ENFORCED, "with `type` integer or number; refused without a `type`"),
    "multipleOf": (ENFORCED, "with `type` integer or number; refused without a `type`"),
    "minLength": (ENFORCED, "with `type` string and neither `pattern` nor `format` beside it; refused otherwise"),
    "maxLength": (ENFORCED, "with `type` string and neither `pattern` nor `format` beside it; refused otherwise"),
    "pattern": (ENFORCED, "with `type` string; the regex rules below apply"),
    "format": (ENFORCED, "email, date, time, date-time, duration, uuid, ipv4, ipv6, hostname, uri, uri-reference, "
                         "uri-template, json-pointer, relative-json-pointer; regex, iri, iri-reference, idn-email "
                         "and idn-hostname are refused; other names are annotations"),
    "anyOf": (ENFORCED, "a non-empty list"),
    "oneOf": (ENFORCED, "a non-empty list, and when its branches are disjoint: distinct types, distinct const/enum "
                        "values, or objects with a required property whose const/enum values differ (a discriminated "
                        "union); refused otherwise (the engine would allow an output that matches two branches)"),
    "allOf": (ENFORCED, "with one entry; refused with none or more"),
    "$ref": (ENFORCED, "to this schema (`#` or `#/...`); a remote reference is refused"),
    "$defs": (ENFORCED, ""),
    "definitions": (ENFORCED, ""),
    "$dynamicRef": (ENFORCED, "to this schema"),
    "$anchor": (ENFORCED, ""),
    "$dynamicAnchor": (ENFORCED, ""),
    "uniqueItems": (REFUSED, "not enforced by the engine (pydantic writes it for `set[...]`: use a list)"),
    "not": (REFUSED, "not enforced by the engine"),
    "if": (REFUSED, "not enforced by the engine"),
    "then": (REFUSED, "not enforced by the engine"),
    "else": (REFUSED, "not enforced by the engine"),
    "dependentRequired": (REFUSED, "not enforced by the engine"),
    "dependentSchemas": (REFUSED, "not enforced by the engine"),
    "dependencies": (REFUSED, "not enforced by the engine"),
    "additionalItems": (REFUSED, "the engine keeps no output under it: use `prefixItems` and `items`"),
    "contains": (REFUSED, "not enforced by the engine (it allows arrays without a matching item)"),
    "minContains": (REFUSED, "not enforced by the engine"),
    "maxContains": (REFUSED, "not enforced by the engine"),
    "$recursiveRef": (REFUSED, "not enforced by the engine: use `$ref`"),
    "title": (ANNOTATION, ""), "description": (ANNOTATION, ""), "default": (ANNOTATION, ""),
    "examples": (ANNOTATION, ""), "$comment": (ANNOTATION, ""), "$schema": (ANNOTATION, ""),
    "$id": (ANNOTATION, ""), "deprecated": (ANNOTATION, ""), "readOnly": (ANNOTATION, ""),
    "writeOnly": (ANNOTATION, ""), "contentEncoding": (ANNOTATION, ""), "contentMediaType": (ANNOTATION, ""),
    "contentSchema": (ANNOTATION, ""), "discriminator": (ANNOTATION, "OpenAPI's; `oneOf` decides"),
    "$vocabulary": (ANNOTATION, ""),
}
ENFORCED_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "uuid", "ipv4", "ipv6", "hostname",
                              "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
REFUSED_FORMATS = frozenset({"regex", "iri", "iri-reference", "idn-email", "idn-hostname"})
_NUMERIC = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_LENGTH = ("minLength", "maxLength")
_STRING = (*_LENGTH, "pattern", "format")
# subschema positions: keyword -> how its value holds subschemas
_ONE = ("additionalProperties", "items", "contains", "propertyNames", "unevaluatedProperties", "unevaluatedItems",
        "not", "if", "then", "else", "additionalItems", "contentSchema")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# Regex escapes xgrammar reads as meant: classes, control characters, and escaped punctuation (the character
# itself). An unknown letter escape (\A, \z, \Z, \G, \h, \Q...) it matches as the letter, so it is refused; \b, \B,
# \p, \k, backreferences and malformed \x / \u it refuses itself.
_REGEX_LETTER_ESCAPES = frozenset("dDwWsSntrfvae0")


def check_schema(schema: dict[str, Any], param: str, where: str, enforced: bool = True) -> None:
    """Refuse a JSON schema (already decoded, at most MAX_SCHEMA_BYTES) that is not a valid schema (an unknown
    `type`, `type` [], an empty `anyOf`/`oneOf`/`allOf`/`enum`, a subschema that is neither an object nor a boolean)
    or, when it is to be `enforced` by the grammar engine, that asks for anything the engine would not keep (see
    KEYWORDS). `enforced=False`: a schema only shown to the model (the tools of tool_choice "auto").

    Raises:
        InvalidRequestError: naming the keyword and its path (`where` then a JSON pointer), param `param`.
    """
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            _refuse(param, where, path, "a schema must be an object or a boolean")
        if depth > MAX_SCHEMA_DEPTH:
            _refuse(param, where, path, f"subschemas are nested more than {MAX_SCHEMA_DEPTH} deep")
        _check_valid(node, param, where, path)
        if enforced:
            _check_node(node, schema, param, where, path)
        for keyword, value in node.items():
            here = f"{path}/{keyword}"
            if keyword in _ONE:
                stack.append((value, here, depth + 1))
            elif keyword in _LIST and isinstance(value, list):
                stack.extend((item, f"{here}/{i}", depth + 1) for i, item in enumerate(value))
            elif keyword in _MAP and isinstance(value, dict):
                stack.extend((item, f"{here}/{_pointer(name)}", depth + 1) for name, item in value.items())


def check_regex(pattern: str, param: str, where: str) -> None:
    """Refuse a regex with a letter escape the engine would match as the letter itself (\\A, \\z, \\Z, ...), or
    with a lookahead, which the engine drops from a schema's `pattern` without a word (xgrammar 0.1's JSON schema
    converter logs "Lookahead assertion is not supported and is ignored"), so that the output could break it.

    Raises:
        InvalidRequestError: naming the escape or lookahead and its position, param `param`.
    """
    lookahead = _lookahead_at(pattern)
    if lookahead is not None:
        raise InvalidRequestError(f"{where}: the lookahead {pattern[lookahead:lookahead + 3]} at position {lookahead} "
                                  f"is not supported by the grammar engine", param=param)
    i = pattern.find("\\")
    while 0 <= i < len(pattern) - 1:
        char = pattern[i + 1]
        if char.isalpha() and char not in _REGEX_LETTER_ESCAPES and char not in "bBpPkxuc":
            raise InvalidRequestError(
                f"{where}: the escape \\{char} at position {i} is not supported by the grammar engine (it would "
                f"match the letter {char}){' (anchors: the whole output is matched already)' if char in 'AzZ' else ''}",
                param=param)
        i = pattern.find("\\", i + 2)


def _lookahead_at(pattern: str) -> int | None:
    """Where the first lookahead group, `(?=` or `(?!`, opens in `pattern` (escapes and character classes skipped),
    or None."""
    in_class, i = False, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):  # a ] first in a class is a literal
                i += 1
            continue
        elif pattern.startswith(("(?=", "(?!"), i):
            return i
        i += 1
    return None


def _check_valid(node: dict[str, Any], param: str, where: str, path: str) -> None:
    """What makes `node` no valid JSON schema, whether or not the engine enforces it."""
    types = node.get("type")
    if "type" in node and not (types in JSON_TYPES or isinstance(types, list) and all(t in JSON_TYPES for t in types)):
        # the engine refuses it only once the request is queued: a background response was answered queued first
        _refuse(param, where, f"{path}/type", f"`type` must be one of {', '.join(JSON_TYPES)} or a list of them")
    if types == []:
        _refuse(param, where, f"{path}/type", "`type` [] allows no value")
    for keyword in ("anyOf", "oneOf", "allOf", "enum"):
        if keyword in node and not (isinstance(node[keyword], list) and node[keyword]):
            _refuse(param, where, f"{path}/{keyword}", f"`{keyword}` must be a list of at least one "
                                                      f"{'value' if keyword == 'enum' else 'schema'}")


def _check_node(node: dict[str, Any], root: dict[str, Any], param: str, where: str, path: str) -> None:
    """What the engine would not keep of a valid `node` (KEYWORDS)."""
    for keyword, value in node.items():
        fate = KEYWORDS.get(keyword)
        if fate is not None and fate[0] == REFUSED and not (keyword == "uniqueItems" and value is False):
            _refuse(param, where, f"{path}/{keyword}", f"`{keyword}` is refused: {fate[1]}")
    types = _types(node) or set()
    listed = {"const": [node["const"]] if "const" in node else [], "enum": node.get("enum", [])}
    for keyword, values in listed.items():
        strays = [value for value in values if types and not _json_types(value) & types]
        if strays:  # the engine writes the listed values whatever the type says
            _refuse(param, where, f"{path}/{keyword}", f"{json.dumps(strays[0])[:100]} is not of the `type` beside "
                                                      f"it ({', '.join(sorted(types))}): the engine would write it")
    typed_values = "enum" in node or "const" in node
    if typed_values:
        _check_listed_values(node, root, listed, param, where, path)
    for keyword in _NUMERIC:
        if keyword in node and not types & {"integer", "number"} and not typed_values:
            _refuse(param, where, f"{path}/{keyword}", f"`{keyword}` needs `\"type\": \"integer\"` or `\"number\"` "
                                                      f"beside it (the engine ignores it otherwise)")
    for keyword in _STRING:
        if keyword in node and "string" not in types and not typed_values:
            _refuse(param, where, f"{path}/{keyword}", f"`{keyword}` needs `\"type\": \"string\"` beside it (the "
                                                      f"engine ignores it otherwise)")
    lengths = [k for k in _LENGTH if k in node]
    shaped = [k for k in ("pattern", "format") if k in node]
    if lengths and shaped:
        _refuse(param, where, f"{path}/{lengths[0]}", f"`{lengths[0]}` beside `{shaped[0]}` is not enforced by the "
                                                      f"engine: put the length into the pattern")
    fmt = node.get("format")
    if fmt in REFUSED_FORMATS:
        _refuse(param, where, f"{path}/format", f"format {fmt!r} is not enforced by the engine")
    if isinstance(node.get("pattern"), str):
        check_regex(node["pattern"], param, f"{where}{path}/pattern")
    for name in node.get("patternProperties") or {}:
        check_regex(name, param, f"{where}{path}/patternProperties")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        _refuse(param, where, f"{path}/$ref", f"the reference {ref[:100]!r} is not to this schema: only local "
                                              f"references (#/...) are resolved")
    required, properties = node.get("required"), node.get("properties") or {}
    if isinstance(required, list):
        missing = [name for name in required if name not in properties]
        if missing:
            _refuse(param, where, f"{path}/required", f"required property {missing[0]!r} is not in `properties` "
                                                      f"(the engine cannot write it)")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        _refuse(param, where, f"{path}/allOf", f"`allOf` with {len(all_of)} entries is not enforced by the engine: "
                                               f"merge them into one schema")
    one_of = node.get("oneOf")
    if isinstance(one_of, list) and len(one_of) > 1 and not _disjoint([_resolve(b, root) for b in one_of]):
        _refuse(param, where, f"{path}/oneOf", "`oneOf` branches that may overlap are enforced as `anyOf` by the "
                                               "engine: use `anyOf`, or make them disjoint (distinct types, or a "
                                               "required property with a distinct const in each)")


def _disjoint(branches: list[Any]) -> bool:
    """Whether no JSON value can match two of `branches` (by their types, their const/enum values, or a required
    discriminating property). A conservative reading: False when unsure."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    values = [_values(b) for b in branches]
    if _pairwise_disjoint(values):
        return True
    types = [_types(b) for b in branches]
    if _pairwise_disjoint(types):
        return True
    common = set.intersection(*(set(b.get("required") or ()) for b in branches))
    for name in common:
        tags = [_values(b.get("properties", {}).get(name)) for b in branches]
        if _pairwise_disjoint(tags):
            return True
    return False


def _json_types(value: Any) -> set[str]:
    """The JSON Schema types `value` (decoded JSON) is an instance of: an integral number is both integer and
    number (JSON Schema 2020-12, validation section 6.1.1)."""
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int) or isinstance(value, float) and value.is_integer():
        return {"integer", "number"}
    if isinstance(value, float):
        return {"number"}
    return {str: {"string"}, type(None): {"null"}, list: {"array"}, dict: {"object"}}.get(type(value), set())


def _types(branch: dict[str, Any]) -> set[str] | None:
    types = branch.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else None
    if types is not None and "number" in types:
        types.add("integer")  # every integer is a number
    return types


def _values(branch: Any) -> set[str] | None:
    """The values a branch allows (JSON text of each), when it lists them (const or enum)."""
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return {json.dumps(branch["const"], sort_keys=True)}
    if isinstance(branch.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in branch["enum"]}
    return None


def _pairwise_disjoint(sets: list[set[str] | None]) -> bool:
    """Whether no two of `sets` share a member; False when any is None (unknown)."""
    seen: set[str] = set()
    for s in sets:
        if s is None or seen & s:
            return False
        seen |= s
    return True


def _resolve(branch: Any, root: dict[str, Any]) -> Any:
    """A branch that is a local `$ref` alone, followed (once per step, at most 16 steps)."""
    for _ in range(16):
        if not (isinstance(branch, dict) and isinstance(branch.get("$ref"), str) and branch["$ref"].startswith("#/")):
            return branch
        target: Any = root
        for part in branch["$ref"][2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                return None
            target = target[part]
        branch = target
    return None


def _pointer(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")


def _check_listed_values(node: dict[str, Any], root: dict[str, Any], listed: dict[str, list], param: str, where: str,
                         path: str) -> None:
    """Where `enum` or `const` lists the values, the engine writes one of them and keeps no other keyword of the
    node: each value must then satisfy the node's other keywords (checked by the jsonschema library, formats
    included, local references resolved against `root`), else that value could be served against the schema."""
    constraining = {k: v for k, v in node.items() if KEYWORDS.get(k, ("",))[0] != ANNOTATION}
    if not set(constraining) - {"type", "enum"} or not set(constraining) - {"type", "const"}:
        return  # one list beside the type alone: checked by the caller
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    definitions = {k: v for k, v in root.items() if k in ("$defs", "definitions")}
    try:
        for keyword, values in listed.items():
            # every other keyword of the node, the other list too (`const` beside an `enum` that lacks it)
            siblings = {k: v for k, v in constraining.items() if k != keyword}
            validator = Draft202012Validator({**definitions, **siblings},
                                             format_checker=Draft202012Validator.FORMAT_CHECKER)
            for value in values:
                error = next(validator.iter_errors(value), None)
                if error is not None:
                    _refuse(param, where, f"{path}/{keyword}", f"{json.dumps(value)[:100]} breaks the keywords beside "
                                                              f"it ({error.message[:200]}): the engine would write it")
    except SchemaError as exc:  # (the walk refuses invalid schemas first; this is a last guard)
        _refuse(param, where, path, f"not a valid schema: {exc.message[:200]}")


def _refuse(param: str, where: str, path: str, message: str) -> None:
    raise InvalidRequestError(f"{where}{' at ' + path if path else ''}: {message}", param=param)
