"""Issue 27, the request side of structured outputs: frontend/structured/request.py's structured_output_of over bodies
decoded as the server decodes them (frontend/request/decoding.py convert_body), for both completion endpoints. Each
accepted form gives its exact StructuredOutput; each refused form raises InvalidRequestError naming the field."""

from __future__ import annotations

import json

import msgspec
import pytest

from shuttle.common.errors import InvalidRequestError
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.request.decoding import convert_body
from shuttle.frontend.request.protocol import ChatCompletionRequest, CompletionRequest
from shuttle.frontend.structured.request import MAX_CHOICES, MAX_PATTERN_BYTES, MAX_SCHEMA_BYTES, structured_output_of

BASES = {CompletionRequest: {"prompt": "Hi"}, ChatCompletionRequest: {"messages": [{"role": "user", "content": "Hi"}]}}
ENDPOINTS = list(BASES)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}
SCHEMA_SPEC = ('{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"}},'
               '"required":["name","age"]}')
GRAMMAR = 'root ::= "yes" | "no"'


def structured(fields: dict, request_type: type = CompletionRequest) -> StructuredOutput | None:
    return structured_output_of(convert_body({**BASES[request_type], **fields}, request_type))


def refused(fields: dict, request_type: type = CompletionRequest) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        structured(fields, request_type)
    return info.value


def json_schema(**fields) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", **fields}}


ACCEPTED = [
    # OpenAI's response_format
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutput(kind="json_object", spec="")),
    ({"response_format": json_schema(schema=SCHEMA)}, StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"response_format": json_schema(schema=SCHEMA, strict=True, description="a person")},
     StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"response_format": json_schema(schema=SCHEMA, strict=False, description=None)},
     StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"response_format": json_schema()}, StructuredOutput(kind="json_object",
                                                          spec="")),  # schema is optional: any object
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "A-b_9" * 12 + "abcd"}}},
     StructuredOutput(kind="json_object", spec="")),  # a name of 64 characters
    # vLLM's structured_outputs
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA, indent=2)}}, StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"structured_outputs": {"json": True}}, StructuredOutput(kind="json", spec="{}")),
    ({"structured_outputs": {"json": "true"}}, StructuredOutput(kind="json", spec="{}")),
    ({"structured_outputs": {"json": {}}}, StructuredOutput(kind="json", spec="{}")),
    ({"structured_outputs": {"regex": r"\d{3}-[a-z]+"}}, StructuredOutput(kind="regex", spec=r"\d{3}-[a-z]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredOutput(kind="choice", spec='["yes","no"]')),
    ({"structured_outputs": {"choice": ["no", "yes", "no"]}}, StructuredOutput(kind="choice", spec='["no","yes"]')),
    ({"structured_outputs": {"grammar": GRAMMAR}}, StructuredOutput(kind="grammar", spec=GRAMMAR)),
    ({"structured_outputs": {"json_object": True}}, StructuredOutput(kind="json_object", spec="")),
    ({"structured_outputs": {"regex": "a+", "json": None, "choice": None, "whitespace_pattern": None,
                             "disable_any_whitespace": None}}, StructuredOutput(kind="regex",
                                                                                spec="a+")),  # nulls: not given
    # vLLM's older top-level names
    ({"guided_json": SCHEMA}, StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput(kind="json", spec=SCHEMA_SPEC)),
    ({"guided_regex": "[a-z]+"}, StructuredOutput(kind="regex", spec="[a-z]+")),
    ({"guided_choice": ["positive", "negative"]}, StructuredOutput(kind="choice", spec='["positive","negative"]')),
    ({"guided_grammar": GRAMMAR}, StructuredOutput(kind="grammar", spec=GRAMMAR)),
    ({"guided_regex": "[a-z]+", "guided_decoding_backend": "xgrammar"}, StructuredOutput(kind="regex", spec="[a-z]+")),
    ({"guided_choice": ["a"], "guided_decoding_backend": "auto"}, StructuredOutput(kind="choice", spec='["a"]')),
    ({"guided_decoding_backend": "xgrammar"}, None),  # a backend and no constraint: nothing to constrain
    # text next to a constraint is no second constraint
    ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutput(kind="regex", spec="a")),
    # nothing
    ({}, None),
    ({"response_format": None, "structured_outputs": None, "guided_json": None}, None),
]


@pytest.mark.parametrize("request_type", ENDPOINTS, ids=["completions", "chat"])
@pytest.mark.parametrize("fields, expected", ACCEPTED, ids=[json.dumps(f)[:60] for f, _ in ACCEPTED])
def test_accepted(fields, expected, request_type):
    assert structured(fields, request_type) == expected


LONG = "a" * (MAX_PATTERN_BYTES + 1)
REFUSED = [
    # response_format: the type, the shape (unknown keys inside are refused too) and the name
    ({"response_format": {"type": "json"}}, "response_format"),
    ({"response_format": {"type": "structural_tag"}}, "response_format"),
    ({"response_format": {}}, "response_format"),
    ({"response_format": "json_object"}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "response_format"),
    ({"response_format": {"type": "text", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),  # no name
    ({"response_format": {"type": "json_schema", "schema": SCHEMA, "name": "x"}}, "response_format"),  # not nested
    ({"response_format": json_schema(schema=SCHEMA, stict=True)}, "response_format"),  # a typo
    ({"response_format": {"type": "json_schema", "json_schema": {"name": ""}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "é"}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a" * 65}}}, "response_format"),
    ({"response_format": json_schema(schema=json.dumps(SCHEMA))}, "response_format"),  # OpenAI's is an object
    ({"response_format": json_schema(schema=True)}, "response_format"),
    ({"response_format": json_schema(schema=SCHEMA, strict="yes")}, "response_format"),
    # structured_outputs: exactly one constraint, of the right shape
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json": None}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "json_object": True}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs"),
    ({"structured_outputs": {"json": False}}, "structured_outputs"),
    ({"structured_outputs": {"json": "false"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "[1, 2]"}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
    ({"structured_outputs": {"json": ""}}, "structured_outputs"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs"),
    ({"structured_outputs": {"regex": LONG}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": ""}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": LONG}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": ["a", 1]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": [str(i) for i in range(MAX_CHOICES + 1)]}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "rgex": "a"}}, "structured_outputs"),  # unknown key
    ({"structured_outputs": "a+"}, "structured_outputs"),
    # structured_outputs: vLLM's options shuttle does not implement, refused by name
    ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, "structured_outputs"),
    ({"structured_outputs": {"json": SCHEMA, "disable_fallback": True}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs"),
    # the top-level names
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[]"}, "guided_json"),
    ({"guided_json": 1}, "guided_json"),
    ({"guided_json": "x" * (MAX_SCHEMA_BYTES + 1)}, "guided_json"),
    ({"guided_json": {"description": "x" * MAX_SCHEMA_BYTES}}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_regex": LONG}, "guided_regex"),
    ({"guided_regex": ["a"]}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": [""]}, "guided_choice"),
    ({"guided_choice": "yes"}, "guided_choice"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
    ({"guided_decoding_backend": "xgrammar:no-fallback", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_decoding_backend": "guidance", "guided_regex": "a"}, "guided_decoding_backend"),
    # two constraints: the second named (in the order response_format, structured_outputs, guided_*)
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": json_schema(schema=SCHEMA), "structured_outputs": {"json": SCHEMA}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": SCHEMA, "guided_grammar": GRAMMAR}, "guided_grammar"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    # combinations the constraint cannot honour
    ({"guided_regex": "a", "min_tokens": 1}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2, "max_tokens": 4}, "min_tokens"),
    ({"structured_outputs": {"choice": ["a"]}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": json_schema(schema=SCHEMA), "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize("request_type", ENDPOINTS, ids=["completions", "chat"])
@pytest.mark.parametrize("fields, param", REFUSED, ids=[json.dumps(f)[:60] for f, _ in REFUSED])
def test_refused(fields, param, request_type):
    assert refused(fields, request_type).param == param


def test_messages_say_why():
    cases = [
        ({"structured_outputs": {"json": SCHEMA, "whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern is not supported"),
        ({"structured_outputs": {"json": SCHEMA, "disable_fallback": True}},
         "structured_outputs.disable_fallback is not supported"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "regex and choice"),
        ({"structured_outputs": {"regex": "a", "rgex": "a"}}, "unknown field `rgex`"),
        ({"response_format": json_schema(schema=SCHEMA, stict=True)}, "unknown field `stict`"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b"}}}, "json_schema.name"),
        ({"guided_json": "{not json"}, "guided_json is not valid JSON"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
         "guided_regex cannot be combined with response_format"),
        ({"guided_regex": "a", "min_tokens": 1}, "min_tokens cannot be combined with guided_regex"),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos cannot be combined with guided_regex"),
        ({"guided_decoding_backend": "outlines"}, "'outlines'"),
    ]
    for fields, words in cases:
        assert words in str(refused(fields)), fields


def test_equal_constraints_have_equal_specs():
    pretty = json.dumps(SCHEMA, indent=4)
    specs = {structured(fields).spec for fields in (
        {"response_format": json_schema(schema=SCHEMA)},
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": pretty}},
        {"guided_json": SCHEMA},
        {"guided_json": json.dumps(SCHEMA, separators=(",", ":"))},
        {"guided_json": pretty},
    )}
    assert specs == {SCHEMA_SPEC}
    # the order of properties is kept: it is the order the object is written in
    reordered = {"type": "object", "properties": {"age": {"type": "integer"}, "name": {"type": "string"}}}
    assert structured({"guided_json": reordered}).spec == msgspec.json.encode(reordered).decode()
    assert structured({"guided_json": reordered}).spec != structured({"guided_json": {
        "type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}}).spec
    # the kinds meet in one key: json_object from response_format and from structured_outputs
    assert structured({"response_format": {"type": "json_object"}}).key == \
        structured({"structured_outputs": {"json_object": True}}).key
    assert structured({"guided_choice": ["a", "b"]}).key == structured({"structured_outputs": {"choice": ["a",
                                                                                                          "b"]}}).key


def test_text_is_kept_as_given():
    regex = r"^(?:[A-Z]\w+)\s{1,3}\d+$"
    grammar = 'root ::= item ("," item)*\nitem ::= [a-z]+\n'
    assert structured({"guided_regex": regex}) == StructuredOutput(kind="regex", spec=regex)
    assert structured({"structured_outputs": {"grammar": grammar}}) == StructuredOutput(kind="grammar", spec=grammar)
    unicode_choices = ["ja", "nein", "é", "日本"]
    assert json.loads(structured({"guided_choice": unicode_choices}).spec) == unicode_choices


def test_limits_are_inclusive():
    at_limit = "a" * MAX_PATTERN_BYTES
    assert structured({"guided_regex": at_limit}).spec == at_limit
    choices = [str(i) for i in range(MAX_CHOICES)]
    assert json.loads(structured({"guided_choice": choices}).spec) == choices
    big = {"description": "x" * (MAX_SCHEMA_BYTES - 40)}
    assert len(structured({"guided_json": big}).spec) <= MAX_SCHEMA_BYTES


def test_the_spec_reaches_sampling_params_intact():
    """The StructuredOutput crosses the wire to the worker (msgpack, array_like): the spec survives unchanged."""
    from shuttle.common.sampling import SamplingParams

    for fields, _ in ACCEPTED:
        found = structured(fields)
        if found is not None:
            params = SamplingParams(structured=found)
            assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams).structured == found


def test_batch_msgpack_body_with_odd_schema_values():
    """A msgpack body (the batch endpoint) may hold what JSON cannot: a non-string key is refused as a type."""
    with pytest.raises(InvalidRequestError) as info:
        structured({"guided_json": {1: "x"}})
    assert info.value.param == "guided_json"
