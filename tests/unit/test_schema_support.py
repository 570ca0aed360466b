"""frontend/structured/schema_support.py against the grammar engine itself: every keyword KEYWORDS calls enforced is
enforced by xgrammar (a valid instance accepted, an invalid one refused, through the same compile options the
worker uses), every refused one is refused by check_schema naming it, and docs/structured-outputs.md holds the
table as scripts/dev/schema_keyword_table.py prints it."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.structured.schema_support import (
    ANNOTATION,
    ENFORCED,
    KEYWORDS,
    REFUSED,
    check_regex,
    check_schema,
)
from shuttle.frontend.tools.request import Tool, ToolUse, tool_constraint

REPO = Path(__file__).resolve().parents[2]
OBJ = {"type": "object"}

# keyword -> (schema, valid instance, invalid instance): the engine must accept the first and refuse the second
ENFORCED_CASES = {
    "type": ({"type": ["integer", "null"]}, "null", '"x"'),
    "enum": ({"enum": [1, "a"]}, "1", "2"),
    "const": ({"const": "x"}, '"x"', '"y"'),
    "properties": ({**OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', '{"a": "x"}'),
    "required": ({**OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]}, '{"a": 1}', "{}"),
    "additionalProperties": ({**OBJ, "properties": {"a": {}}, "additionalProperties": False}, '{"a": 1}',
                             '{"b":1}'),
    "patternProperties": ({**OBJ, "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
                          '{"x": 1}', '{"y": 1}'),
    "propertyNames": ({**OBJ, "propertyNames": {"type": "string", "maxLength": 1}}, '{"a": 1}', '{"ab": 1}'),
    "unevaluatedProperties": ({**OBJ, "properties": {"a": {}}, "unevaluatedProperties": False}, '{"a": 1}',
                              '{"b":1}'),
    "minProperties": ({**OBJ, "properties": {"a": {}, "b": {}}, "minProperties": 1}, '{"a": 1}', "{}"),
    "maxProperties": ({**OBJ, "maxProperties": 1}, "{}", '{"a": 1, "b": 2}'),
    "items": ({"type": "array", "items": {"type": "integer"}}, "[1]", '["a"]'),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, "[1]", '["a"]'),
    "unevaluatedItems": ({"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": False},
                         "[1]", "[1, 2]"),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 1}, "[1]", "[]"),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, "[1]", "[1, 2]"),
    "minimum": ({"type": "number", "minimum": 1.5}, "2.0", "1.0"),
    "maximum": ({"type": "integer", "maximum": 3}, "3", "4"),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, "4", "3"),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 2}, "1.5", "2"),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, "6", "4"),
    "minLength": ({"type": "string", "minLength": 2}, '"ab"', '"a"'),
    "maxLength": ({"type": "string", "maxLength": 3}, '"ab"', '"abcdef"'),
    "pattern": ({"type": "string", "pattern": "^[a-z]+$"}, '"ab"', '"A1"'),
    "format": ({"type": "string", "format": "date"}, '"2024-01-01"', '"hello"'),
    "anyOf": ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "1", "true"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, '"a"', "true"),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}]}, "4", "1"),
    "$ref": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "1", '"a"'),
    "$defs": ({"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"}, "1", '"a"'),
    "definitions": ({"definitions": {"x": {"type": "integer"}}, "$ref": "#/definitions/x"}, "1", '"a"'),
    "$dynamicRef": ({"$dynamicAnchor": "x", "$dynamicRef": "#x", "type": "integer"}, "1", '"a"'),
    "$anchor": ({"$anchor": "x", "type": "integer"}, "1", '"a"'),
    "$dynamicAnchor": ({"$dynamicAnchor": "x", "type": "integer"}, "1", '"a"'),
}
# keyword -> a schema check_schema refuses naming that keyword
REFUSED_CASES = {
    "uniqueItems": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if": {"if": {"type": "string"}, "then": {"type": "string", "maxLength": 1}},
    "then": {"then": {"type": "string"}},
    "else": {"else": {"type": "string"}},
    "dependentRequired": {**OBJ, "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
    "dependentSchemas": {**OBJ, "dependentSchemas": {"a": {"required": []}}},
    "dependencies": {**OBJ, "dependencies": {"a": ["b"]}},
    "additionalItems": {"type": "array", "prefixItems": [{"type": "integer"}], "additionalItems": {"type": "string"}},
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}},
    "minContains": {"type": "array", "minContains": 2},
    "maxContains": {"type": "array", "maxContains": 2},
    "$recursiveRef": {"$recursiveRef": "#"},
}
# the conditional refusals of enforced keywords: (schema, the keyword named, why the engine would not keep it)
CONDITIONAL_REFUSALS = [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "maxLength", '"abcdef"'),
    ({"type": "string", "format": "email", "maxLength": 5}, "maxLength", None),
    ({**OBJ, "required": ["a"]}, "required", None),
    ({"minimum": 3}, "minimum", "1"),
    ({"maxLength": 2}, "maxLength", '"abc"'),
    ({"$ref": "https://example.com/s.json"}, "$ref", '"anything"'),
    ({"allOf": [{"type": "integer"}, {"minimum": 3}]}, "allOf", None),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf", "1"),
    ({"type": "string", "format": "regex"}, "format", '" !!"'),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}}, "contains", "[2]"),
    ({"type": "integer", "const": "a"}, "const", '"a"'),
    ({"type": "string", "enum": ["b", 1]}, "enum", "1"),
    ({"type": ["string", "null"], "enum": [None, 2.5]}, "enum", "2.5"),
    ({"type": []}, "type", "true"),
    ({"anyOf": []}, "anyOf", None),
    ({"oneOf": []}, "oneOf", None),
    ({"allOf": []}, "allOf", None),
    ({"enum": []}, "enum", None),
    ({"anyOf": {"type": "string"}}, "anyOf", None),
]


def grammar(schema: dict) -> xgr.Grammar:
    return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)  # as worker/grammar.py compiles


def test_every_keyword_has_a_case_here():
    cased = set(ENFORCED_CASES) | set(REFUSED_CASES)
    assert {k for k, (fate, _) in KEYWORDS.items() if fate != ANNOTATION} == cased
    assert {k for k, (fate, _) in KEYWORDS.items() if fate == ENFORCED} == set(ENFORCED_CASES)
    assert {k for k, (fate, _) in KEYWORDS.items() if fate == REFUSED} == set(REFUSED_CASES)


@pytest.mark.parametrize("keyword", sorted(ENFORCED_CASES))
def test_an_enforced_keyword_passes_the_check_and_the_engine_enforces_it(keyword):
    schema, valid, invalid = ENFORCED_CASES[keyword]
    check_schema(schema, "response_format", "schema")
    compiled = grammar(schema)
    assert accepts(compiled, valid) and not accepts(compiled, invalid)


@pytest.mark.parametrize("keyword", sorted(REFUSED_CASES))
def test_a_refused_keyword_is_a_400_naming_it(keyword):
    with pytest.raises(InvalidRequestError) as raised:
        check_schema({**OBJ, "properties": {"x": REFUSED_CASES[keyword]}, "required": ["x"]}, "tools", "params")
    assert raised.value.param == "tools" and f"/properties/x/{keyword}" in str(raised.value)


@pytest.mark.parametrize("schema, keyword, weakened", CONDITIONAL_REFUSALS)
def test_what_the_engine_would_weaken_is_refused_naming_the_keyword(schema, keyword, weakened):
    """`weakened`: an invalid instance the engine's own grammar accepts, the reason for the refusal."""
    with pytest.raises(InvalidRequestError, match=f"at /{keyword.replace('$', '[$]')}"):
        check_schema(schema, "response_format", "schema")
    if weakened is not None:
        assert accepts(grammar(schema), weakened)


@pytest.mark.parametrize("schema", [
    {"type": "number", "const": 1}, {"type": "integer", "const": 2.0}, {"type": "integer", "enum": [1, 2]},
    {"type": ["string", "null"], "enum": ["a", None]}, {"enum": [1, "a", None, True, [1], {"a": 1}]},
    {"type": "object", "const": {"a": 1}}, {"type": "boolean", "enum": [True]}])
def test_const_and_enum_values_of_the_type_beside_them_pass(schema):
    check_schema(schema, "response_format", "schema")


@pytest.mark.parametrize("schema, keyword, instance", [
    ({"type": "string", "pattern": "^a$", "enum": ["b"]}, "enum", '"b"'),
    ({"type": "integer", "minimum": 5, "enum": [1, 2]}, "enum", "2"),
    ({"type": "integer", "maximum": 1, "const": 3}, "const", "3"),
    ({"type": "integer", "multipleOf": 2, "const": 3}, "const", "3"),
    ({"type": "string", "maxLength": 2, "enum": ["hello"]}, "enum", '"hello"'),
    ({"type": "string", "format": "date", "enum": ["not-a-date"]}, "enum", '"not-a-date"'),
    ({"type": "array", "maxItems": 1, "enum": [[1, 2, 3]]}, "enum", "[1,2,3]"),  # listed values: compact
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "const": {"b": 1}}, "const",
     '{"b":1}'),
    ({"$defs": {"u": {"type": "string", "maxLength": 3}}, "type": "object",
      "properties": {"x": {"$ref": "#/$defs/u", "enum": ["abcd"]}}}, "properties/x/enum", None),
    ({"const": "x", "enum": ["y"]}, "const", None), ({"const": False, "enum": [0]}, "const", None),
    ({"const": 1, "enum": [True]}, "const", None)])
def test_listed_values_that_break_the_keywords_beside_them_are_refused(schema, keyword, instance):
    """The engine writes a listed value and keeps no other keyword of its node (`instance`: what its own grammar
    takes against the schema, where that is the node itself)."""
    with pytest.raises(InvalidRequestError, match=f"at /{keyword}: .* breaks the keywords beside it"):
        check_schema(schema, "response_format", "schema")
    if instance is not None:
        assert accepts(grammar(schema), instance)


@pytest.mark.parametrize("schema", [
    {"type": "string", "enum": ["a", "b"], "description": "x"}, {"type": "integer", "minimum": 0, "enum": [1, 2]},
    {"type": "string", "format": "date", "enum": ["2024-01-02"]},
    {"$defs": {"u": {"type": "string", "maxLength": 3}}, "type": "object",
     "properties": {"x": {"$ref": "#/$defs/u", "enum": ["ab"]}}}])
def test_listed_values_within_the_keywords_beside_them_pass(schema):
    check_schema(schema, "response_format", "schema")


def test_a_pydantic_discriminated_union_passes_and_overlapping_one_of_does_not():
    cat = {**OBJ, "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}, "required": ["kind"]}
    dog = {**OBJ, "properties": {"kind": {"const": "dog"}}, "required": ["kind"]}
    union = {"$defs": {"Cat": cat, "Dog": dog}, "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}
    check_schema(union, "response_format", "schema")
    loose = {**union, "$defs": {"Cat": {**cat, "required": []}, "Dog": dog}}
    with pytest.raises(InvalidRequestError, match="oneOf"):
        check_schema(loose, "response_format", "schema")


@pytest.mark.parametrize("pattern", [r"\A[0-9]{2}\z", r"[0-9]\Z", r"\Gab", r"\Qa\E"])
def test_a_letter_escape_the_engine_reads_as_the_letter_is_refused(pattern):
    with pytest.raises(InvalidRequestError, match=r"escape \\"):
        check_regex(pattern, "structured_outputs", "structured_outputs.regex")


@pytest.mark.parametrize("pattern, at", [("^(?!a)[ab]{3}$", 1), ("a(?=b)b", 1), (r"[\]](?!x)", 4)])
def test_a_lookahead_the_engine_would_drop_from_a_schema_is_refused(pattern, at):
    """A trial: xgrammar ignored `(?!a)` in a schema's pattern and the output "abb" broke it."""
    with pytest.raises(InvalidRequestError, match=re.escape(f"lookahead {pattern[at:at + 3]} at position {at}")):
        check_regex(pattern, "response_format", "response_format.json_schema.schema/pattern")


def test_the_engine_still_drops_a_schemas_lookahead():
    """Why the refusal above exists; should the engine ever enforce lookaheads, this fails and the refusal can go."""
    grammar = xgr.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": "^(?!a)[ab]{3}$"}))
    assert accepts(grammar, '"abb"')


@pytest.mark.parametrize("pattern", [r"\(?!x", "[(?!]x", "[^](?=]x", "a(?:b)c"])
def test_what_only_looks_like_a_lookahead_passes(pattern):
    check_regex(pattern, "guided_regex", "guided_regex")


def test_escapes_the_engine_reads_as_meant_pass():
    pattern = r"\d\D\w\W\s\S\t\n\r\f\v\.\*\+\?\(\)\[\]\{\}\|\^\$\\\/\-"
    check_regex(pattern, "guided_regex", "guided_regex")
    assert accepts(xgr.Grammar.from_regex(r"\d\.\w"), "1.a") and not accepts(xgr.Grammar.from_regex(r"\d\.\w"), "1xa")


def test_schemas_nested_past_the_bound_are_refused_without_recursion():
    schema: dict = {"type": "integer"}
    for _ in range(300):
        schema = {"type": "array", "items": schema}
    with pytest.raises(InvalidRequestError, match="nested more than 64") as raised:
        check_schema(schema, "tools", "tools[0].function.parameters")
    assert raised.value.param == "tools"


def test_required_tool_calls_keep_each_tools_own_references():
    """A pydantic tool's parameters hold `$defs` and `$ref`: under tool_choice required they move with the tool."""
    opts = {"$defs": {"Opts": {**OBJ, "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
            **OBJ, "properties": {"opts": {"$ref": "#/$defs/Opts"}}, "required": ["opts"]}
    tools = tuple(Tool.__struct_fields__ and __import__("msgspec").convert(
        {"type": "function", "function": {"name": name, "parameters": params}}, Tool)
        for name, params in (("f", opts), ("g", {**OBJ, "properties": {}})))
    spec = tool_constraint(ToolUse(tools, "required", None, True))
    compiled = xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False)
    assert accepts(compiled, '[{"name": "f", "parameters": {"opts": {"n": 1}}}]')
    assert not accepts(compiled, '[{"name": "f", "parameters": {"opts": {"n": "x"}}}]')


def test_the_docs_hold_the_keyword_table_as_printed():
    table = subprocess.run([sys.executable, "scripts/dev/schema_keyword_table.py"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout
    assert table.strip() in (REPO / "docs/structured-outputs.md").read_text()


@pytest.mark.parametrize("field, value, named", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "w", "schema": {
        "type": "object", "properties": {"w": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}},
        "required": ["w"]}}}, "/properties/w/maxLength"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}, "/uniqueItems"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "r", "schema": {
        "type": "object", "required": ["a"]}}}, "/required"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "ref", "schema": {
        "$ref": "https://example.com/schema.json"}}}, "/$ref"),
    ("structured_outputs", {"regex": r"\A[0-9]{2}\z"}, r"escape \A"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "la", "schema": {
        "type": "string", "pattern": "^(?!a)[ab]{3}$"}}}, "/pattern: the lookahead (?! at position 1"),
])
async def test_weakened_constraints_are_400_naming_the_field_and_keyword(field, value, named):
    from tests.api.test_api_details import USER, post, served

    async with served() as (client, engine):
        status, body = await post(client, "/v1/chat/completions", {"messages": USER, field: value})
    assert status == 400 and body["error"]["param"] == field and named in body["error"]["message"], body
    assert engine.submitted == []


async def test_a_forced_tool_whose_parameters_are_too_large_or_weakened_is_a_400_on_tools():
    from tests.api.test_api_details import USER, post, served

    huge = {"type": "object", "properties": {"k": {"enum": [f"value-{i}" for i in range(40_000)]}}}
    unique = {"type": "object", "properties": {"k": {"type": "array", "uniqueItems": True}}}
    async with served() as (client, engine):
        for params, named in ((huge, "over 256 KiB"), (unique, "uniqueItems")):
            tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
            for choice in ("required", {"type": "function", "function": {"name": "f"}}):
                status, body = await post(client, "/v1/chat/completions",
                                          {"messages": USER, "tools": tools, "tool_choice": choice})
                assert status == 400 and body["error"]["param"] == "tools" and named in body["error"]["message"]
    assert engine.submitted == []


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"structured_outputs": {"regex": "[a-z]+"}}, "structured_outputs"),
    ("/v1/chat/completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"tool_choice": "required", "response_format": {"type": "json_object"}, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/responses", {"text": {"format": {"type": "json_object"}}}, "text"),
])
async def test_the_engines_refusal_of_a_constraint_names_the_field_it_came_from(path, body, param):
    from tests.api.test_api_details import USER, post, served
    from tests.fake_engine import FakeEngine

    engine = FakeEngine(error=(400, "the json constraint does not compile: no"))
    prompt = {"input": "Hi"} if path == "/v1/responses" else {"prompt": "Hi"} if "/completions" == path[3:] \
        else {"messages": USER}
    async with served(engine) as (client, _):
        status, answer = await post(client, path, {**prompt, **body})
    assert (status, answer["error"]["param"]) == (400, param), answer


async def test_a_prompt_and_max_tokens_no_cache_holds_names_max_tokens():
    from tests.api.test_api_details import USER, post, served
    from tests.fake_engine import FakeEngine

    engine = FakeEngine(error=(400, "prompt + max_tokens needs 900 tokens of KV cache; the whole cache holds 320"))
    async with served(engine) as (client, _):
        chat = await post(client, "/v1/chat/completions", {"messages": USER, "max_completion_tokens": 800})
        responses = await post(client, "/v1/responses", {"input": "Hi", "max_output_tokens": 800})
    assert [(s, a["error"]["param"]) for s, a in (chat, responses)] == [(400, "max_completion_tokens"),
                                                                          (400, "max_output_tokens")]


async def test_tool_parameters_nested_past_the_bound_are_a_400_on_tools_whatever_the_choice():
    """Nested 300 deep they were a recursion error in the chat template, answered as a 400 on `messages`."""
    from tests.api.test_api_details import USER, post, served

    schema: dict = {"type": "integer"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "deep", "parameters": schema}}]
    async with served() as (client, engine):
        for choice in ("none", "required"):
            status, body = await post(client, "/v1/chat/completions",
                                      {"messages": USER, "tools": tools, "tool_choice": choice})
            assert (status, body["error"]["param"]) == (400, "tools") and "nested more than 64" in \
                body["error"]["message"], body
    assert engine.submitted == []


async def test_tool_parameters_that_are_no_valid_schema_are_a_400_on_tools_whatever_the_choice():
    """A schema only shown to the model ("none"; "auto" on a server that parses tool calls) must still be a schema;
    what the grammar engine would not keep is refused only where the engine enforces it."""
    from tests.api.test_api_details import USER, post, served

    def tools(parameters: dict) -> list[dict]:
        return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    async with served() as (client, engine):
        for parameters, named in (({"type": "bogus"}, "/type"), ({"anyOf": []}, "/anyOf"), ({"type": []}, "/type")):
            for choice in ("none", "required"):
                status, body = await post(client, "/v1/chat/completions",
                                          {"messages": USER, "tools": tools(parameters), "tool_choice": choice})
                assert (status, body["error"]["param"]) == (400, "tools") and f"at {named}" in \
                    body["error"]["message"], (parameters, choice, body)
        assert engine.submitted == []
        weakened = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}  # valid, not enforceable
        status, body = await post(client, "/v1/chat/completions",
                                  {"messages": USER, "tools": tools(weakened), "tool_choice": "none"})
        assert status == 200, body
        status, body = await post(client, "/v1/chat/completions",
                                  {"messages": USER, "tools": tools(weakened), "tool_choice": "required"})
        assert (status, body["error"]["param"]) == (400, "tools") and "`not` is refused" in body["error"]["message"]
