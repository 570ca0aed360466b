"""A request body into its Struct: JSON or msgpack decoded, nulls dropped, integral floats taken as integers, and
every field shuttle does not implement refused by name (REFUSED_FIELDS)."""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import msgspec

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.request.integral_floats import integral_floats_as_ints


class Refused(NamedTuple):
    """Why a request field of OpenAI's or vLLM's schema is refused, and the one value taken all the same because it
    asks for what shuttle does anyway (None: every value is refused)."""

    why: str
    accepted: Any = None


_FUNCTIONS = 'OpenAI\'s deprecated form of tools: use tools ([{"type": "function", "function": {...}}])'
_NOT_IMPLEMENTED = "not implemented"
# Fields of OpenAI's and vLLM's request schemas that shuttle does not implement. A body holding one that its
# request Struct does not declare gets 400 naming it (so `echo` is refused on chat only), rather than being served
# as if it had not been sent: a caller must never believe its output was constrained when it was not. A field
# neither declared nor listed here is refused as unrecognized, as OpenAI's API does.
REFUSED_FIELDS: dict[str, Refused] = {
    "guided_whitespace_pattern": Refused("JSON whitespace is the grammar engine's own (xgrammar)"),
    "structural_tag": Refused("structural tags are not implemented"),
    "functions": Refused(_FUNCTIONS),
    "function_call": Refused("OpenAI's deprecated form of tool_choice: use tool_choice"),
    "chat_template": Refused("the server renders every chat with its own template (--chat-template at startup)"),
    "documents": Refused(_NOT_IMPLEMENTED),
    "use_beam_search": Refused("beam search is not implemented", False),
    "length_penalty": Refused("beam search is not implemented"),
    "echo": Refused("only /v1/completions echoes the prompt", False),
    "allowed_token_ids": Refused(_NOT_IMPLEMENTED),
    "bad_words": Refused(_NOT_IMPLEMENTED),
    "truncate_prompt_tokens": Refused("prompts are never truncated: one too long for the context gets 400"),
    "skip_special_tokens": Refused("special tokens are always left out of the text", True),
    "spaces_between_special_tokens": Refused(_NOT_IMPLEMENTED),
    "logits_processors": Refused(_NOT_IMPLEMENTED),
    "request_id": Refused("the server names each response (the x-request-id header carries a client's own id)"),
    "cache_salt": Refused(_NOT_IMPLEMENTED),
    "kv_transfer_params": Refused(_NOT_IMPLEMENTED),
    "vllm_xargs": Refused(_NOT_IMPLEMENTED),
    "mm_processor_kwargs": Refused("only text is served"),
    "prompt_embeds": Refused("only text and token id prompts are served"),
    "modalities": Refused("only text is served"),
    "audio": Refused("only text is served"),
    "prediction": Refused(_NOT_IMPLEMENTED),
    "web_search_options": Refused(_NOT_IMPLEMENTED),
    "reasoning_effort": Refused(_NOT_IMPLEMENTED),
    "verbosity": Refused(_NOT_IMPLEMENTED),
    "include_reasoning": Refused(_NOT_IMPLEMENTED),
}


def refuse_undeclared(data: dict, request_type: type[msgspec.Struct]) -> None:
    """Refuse the first field of `data` (nulls already dropped) that `request_type` does not declare, unless it is
    a REFUSED_FIELDS entry holding its accepted value (`"echo": false` on chat, `"skip_special_tokens": true`).

    Raises:
        InvalidRequestError: the field (named in `param`) is not implemented, or not a field at all.
    """
    declared = request_type.__struct_fields__
    for name, value in data.items():
        if name in declared:
            continue
        if not isinstance(name, str):  # a msgpack map (the batch endpoint) may have other keys
            raise InvalidRequestError(f"request field names must be strings, got {type(name).__name__}")
        refused = REFUSED_FIELDS.get(name)
        if refused is None:
            raise InvalidRequestError(f"Unrecognized request argument supplied: {name}", param=name)
        accepted = refused.accepted
        if accepted is not None and type(value) is type(accepted) and value == accepted:
            continue
        what = f"supported only as {json.dumps(accepted)}" if accepted is not None else "not supported"
        raise InvalidRequestError(f"{name} is {what}: {refused.why}", param=name)


# A \uD800-\uDBFF escape not followed by a \uDC00-\uDFFF one: msgspec says "Input data was truncated" for it
_LONE_HIGH_SURROGATE = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
LONE_SURROGATE = ("it escapes a lone UTF-16 surrogate (\\ud800-\\udfff outside a high-low pair), which is no "
                  "Unicode character")


def json_error(body: bytes, exc: msgspec.DecodeError) -> str:
    """Why `body` is not JSON, from msgspec's DecodeError `exc`, naming a lone surrogate escape as one (msgspec
    calls a lone high one "Input data was truncated", which points the client at the wrong fault)."""
    why = str(exc)
    if "surrogate" in why or (why == "Input data was truncated" and _LONE_HIGH_SURROGATE.search(body)):
        return LONE_SURROGATE
    return why


_DECODE_PATH = re.compile(r"(?:at|in) `\$\.([A-Za-z_]\w*)")  # "at `$.n`", "at `key` in `$.logit_bias`"
_MISSING_FIELD = re.compile(r"missing required field `([A-Za-z_]\w*)`")


def decode_body(body: bytes, request_type: type[msgspec.Struct]) -> Any:
    """Decode a JSON body into `request_type` (see convert_body).

    Raises:
        InvalidRequestError: not JSON, not an object, or a field of the wrong type (named in `param`).
    """
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"request body is not valid JSON: {json_error(body, exc)}") from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply") from None
    return convert_body(data, request_type)


def convert_body(data: Any, request_type: type[msgspec.Struct]) -> Any:
    """Convert an already parsed body (from JSON or msgpack) into `request_type`.

    An explicit `null` for a top-level field means the same as leaving the field out: OpenAI's schema makes its
    optional fields nullable, and clients send null for "default" (the official Python client with
    `temperature=None`). So every default lives in one place, the Struct's field declaration. A field typed as an
    integer takes an integral float (`"n": 1.0`, as OpenAI does; frontend/request/integral_floats.py), never 1.5 or "1".
    A field `request_type` does not declare is refused (refuse_undeclared), whatever the transport.

    Raises:
        InvalidRequestError: not an object, a field of the wrong type, not implemented or unknown (named in `param`).
    """
    if isinstance(data, dict):
        data = {name: value for name, value in data.items() if value is not None}
        refuse_undeclared(data, request_type)
    try:
        return msgspec.convert(integral_floats_as_ints(data, request_type), type=request_type)
    except msgspec.ValidationError as exc:
        match = _DECODE_PATH.search(str(exc)) or _MISSING_FIELD.search(str(exc))
        raise InvalidRequestError(f"invalid request body: {exc}", param=match.group(1) if match else None) from None
    except RecursionError:
        raise InvalidRequestError("request body is nested too deeply") from None
