"""A request's output constraint (response_format, vLLM's structured_outputs and guided_* fields) as one
StructuredOutput for the worker's grammar engine.

Only the request side: the frontend checks the shapes and sizes and normalizes the spec (so equal constraints have
equal cache keys); it never compiles anything (no xgrammar here), and a schema or grammar the engine cannot compile
comes back from the engine as a 400.

Accepted (one per request; a second one is refused naming its field, in the order of SOURCES):
    response_format        {"type": "text"} (no constraint), {"type": "json_object"},
                           {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
    structured_outputs     exactly one of json (a schema object, or its JSON text), regex, choice, grammar,
                           json_object (true)
    guided_json, guided_regex, guided_choice, guided_grammar  vLLM's older top-level names of the same
    guided_decoding_backend  "xgrammar" or "auto" (the one engine there is), with or without a constraint
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.structured.schema_support import check_regex, check_schema

MAX_CHOICES = 1024  # most entries of a choice list
MAX_PATTERN_BYTES = 64 * 1024  # a regex or a grammar, UTF-8
MAX_SCHEMA_BYTES = 256 * 1024  # a JSON schema, as given in text and as normalized
BACKENDS = ("xgrammar", "auto")  # what guided_decoding_backend may name

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# vLLM's StructuredOutputsParams options (and its older GuidedDecodingParams') that shuttle does not implement
REFUSED_KEYS = {
    "structural_tag": "structural tags are not implemented",
    "whitespace_pattern": "JSON whitespace is the grammar engine's own (xgrammar)",
    "disable_any_whitespace": "JSON whitespace is the grammar engine's own (xgrammar)",
    "disable_additional_properties": 'the schema is compiled as written: put "additionalProperties": false in it',
    "disable_fallback": "there is one grammar engine (xgrammar) and no fallback",
    "backend": "there is one grammar engine (xgrammar); it is not chosen per request",
}
# structured_outputs' constraint keys -> StructuredOutput kind, in the order a second one is named
_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}
SOURCES = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar")


def structured_output_of(body) -> StructuredOutput | None:
    """The constraint `body` (a SamplingFields) asks for, or None.

    Raises:
        InvalidRequestError: a malformed constraint, or more than one (param names the field).
    """
    backend = body.guided_decoding_backend
    if backend is not None and backend not in BACKENDS:
        raise InvalidRequestError(f"guided_decoding_backend must be one of {', '.join(map(repr, BACKENDS))}: the "
                                  f"grammar engine is xgrammar, got {backend!r}", param="guided_decoding_backend")
    found: StructuredOutput | None = None
    first = None
    for source in SOURCES:
        value = getattr(body, source)
        if value is None:
            continue
        constraint = _READERS[source](value)
        if constraint is None:  # response_format text
            continue
        if found is not None:
            raise InvalidRequestError(f"{source} cannot be combined with {first}: at most one output constraint "
                                      f"per request", param=source)
        found, first = constraint, source
    if found is None:
        return None
    if body.min_tokens > 0:
        raise InvalidRequestError(f"min_tokens cannot be combined with {first}: the constraint may allow nothing "
                                  f"but the end of the output", param="min_tokens")
    if body.ignore_eos:
        raise InvalidRequestError(f"ignore_eos cannot be combined with {first}: the output ends where the "
                                  f"constraint is complete", param="ignore_eos")
    return found


def constraint_source(body) -> str | None:
    """The field of `body` that holds its output constraint (checked by structured_output_of), or None."""
    return next((source for source in SOURCES if getattr(body, source) is not None), None)


def _response_format(value) -> StructuredOutput | None:
    kind = value.__struct_config__.tag
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object")
    spec = value.json_schema
    if not _NAME.fullmatch(spec.name):
        raise InvalidRequestError("response_format.json_schema.name must be 1 to 64 letters, digits, underscores "
                                  "or dashes", param="response_format")
    if spec.schema is None:  # optional in OpenAI's reference: a JSON object, with nothing more said of it
        return StructuredOutput(kind="json_object")
    return StructuredOutput(kind="json", spec=_schema_spec(spec.schema, "response_format",
                                                           "response_format.json_schema.schema"))


def _structured_outputs(value) -> StructuredOutput:
    param = "structured_outputs"
    for key, why in REFUSED_KEYS.items():
        if getattr(value, key) is not None:
            raise InvalidRequestError(f"structured_outputs.{key} is not supported: {why}", param=param)
    given = [key for key in _KEYS if getattr(value, key) is not None]
    if not given:
        raise InvalidRequestError(f"structured_outputs must hold one of {', '.join(_KEYS)}", param=param)
    if len(given) > 1:
        raise InvalidRequestError(f"structured_outputs holds {' and '.join(given)}: exactly one of "
                                  f"{', '.join(_KEYS)} is allowed", param=param)
    key = given[0]
    where = f"structured_outputs.{key}"
    item = getattr(value, key)
    if key == "json":
        return StructuredOutput(kind="json", spec=_schema_spec(item, param, where))
    if key == "json_object":
        if item is not True:
            raise InvalidRequestError("structured_outputs.json_object must be true", param=param)
        return StructuredOutput(kind="json_object")
    if key == "choice":
        return StructuredOutput(kind="choice", spec=_choice_spec(item, param, where))
    if key == "regex":
        return StructuredOutput(kind=key, spec=_regex_spec(item, param, where))
    return StructuredOutput(kind=key, spec=_text_spec(item, param, where))


def _schema_spec(schema: Any, param: str, where: str) -> str:
    """A JSON schema (an object, `true`, or the JSON text of one) as compact JSON text, its keys in the order given
    (property order is the order the output is written in)."""
    if isinstance(schema, str):
        if len(schema.encode()) > MAX_SCHEMA_BYTES:
            raise InvalidRequestError(f"{where} is over {MAX_SCHEMA_BYTES // 1024} KiB", param=param)
        try:
            schema = msgspec.json.decode(schema)
        except msgspec.DecodeError as exc:
            raise InvalidRequestError(f"{where} is not valid JSON: {exc}", param=param) from None
        except RecursionError:
            raise InvalidRequestError(f"{where} is nested too deeply", param=param) from None
    if schema is True:
        schema = {}  # the schema that allows any JSON value, written as the object
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{where} must be a JSON Schema object (or true)", param=param)
    try:
        spec = msgspec.json.encode(schema)
    except (TypeError, ValueError) as exc:  # a msgpack body (the batch endpoint) may hold values JSON has not
        raise InvalidRequestError(f"{where} is not a JSON value: {exc}", param=param) from None
    except RecursionError:
        raise InvalidRequestError(f"{where} is nested too deeply", param=param) from None
    if len(spec) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"{where} is over {MAX_SCHEMA_BYTES // 1024} KiB", param=param)
    check_schema(schema, param, where)
    return spec.decode()


def _choice_spec(choices: list[str], param: str, where: str) -> str:
    """The choices as a JSON list, duplicates dropped (the first kept, the order given)."""
    if not choices or len(choices) > MAX_CHOICES:
        raise InvalidRequestError(f"{where} must be a list of 1 to {MAX_CHOICES} strings", param=param)
    if not all(choices):
        raise InvalidRequestError(f"{where} entries must be non-empty strings", param=param)
    unique = list(dict.fromkeys(choices))
    spec = msgspec.json.encode(unique)
    if len(spec) > MAX_SCHEMA_BYTES:
        raise InvalidRequestError(f"{where} is over {MAX_SCHEMA_BYTES // 1024} KiB", param=param)
    return spec.decode()


def _text_spec(text: str, param: str, where: str) -> str:
    """A regex or a grammar, as given (any rewriting could change what it means)."""
    if not text:
        raise InvalidRequestError(f"{where} must not be empty", param=param)
    if len(text.encode()) > MAX_PATTERN_BYTES:
        raise InvalidRequestError(f"{where} is over {MAX_PATTERN_BYTES // 1024} KiB", param=param)
    return text


def _regex_spec(text: str, param: str, where: str) -> str:
    spec = _text_spec(text, param, where)
    check_regex(spec, param, where)
    return spec


_READERS = {
    "response_format": _response_format,
    "structured_outputs": _structured_outputs,
    "guided_json": lambda value: StructuredOutput(kind="json", spec=_schema_spec(value, "guided_json", "guided_json")),
    "guided_regex": lambda value: StructuredOutput(kind="regex", spec=_regex_spec(value, "guided_regex",
                                                                                  "guided_regex")),
    "guided_choice": lambda value: StructuredOutput(kind="choice", spec=_choice_spec(value, "guided_choice",
                                                                                     "guided_choice")),
    "guided_grammar": lambda value: StructuredOutput(kind="grammar", spec=_text_spec(value, "guided_grammar",
                                                                           "guided_grammar")),
}
