"""GET /openapi.json: an OpenAPI 3.1 document whose request bodies are generated from the request Structs
(msgspec's JSON Schema), so it cannot drift from what the server decodes, then narrowed by what the code checks
beyond the types (frontend/web/schema_constraints.py). Each route lists every status it can answer
(scripts/dev/fuzz_schema.py checks the running server against it); success bodies are described by their top-level
shape, the details being OpenAI's and documented in docs/."""

from __future__ import annotations

import functools
import re
from typing import Any

import msgspec

from shuttle.common.messages import BatchRequest, BatchResponse
from shuttle.common.sampling import MAX_LOGPROBS
from shuttle.frontend.anthropic.errors import is_messages_path
from shuttle.frontend.anthropic.request import CountTokensRequest, MessagesRequest
from shuttle.frontend.request.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from shuttle.frontend.responses.request import ResponsesRequest
from shuttle.frontend.web.middleware import OPEN_PATHS
from shuttle.frontend.web.schema_constraints import constrain

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}
ANTHROPIC_ERROR = {  # the Messages API's (frontend/anthropic/errors.py)
    "type": "object",
    "required": ["type", "error"],
    "properties": {"type": {"const": "error"}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}},
}
STATUSES = {  # every error status a route may answer -> its description
    "400": "invalid request (a field, the JSON, or the body's encoding)",
    "401": "missing or wrong API key (only when the server has one)",
    "403": "a browser origin that is not allowed",
    "404": "unknown model",
    "408": "request timed out (the body, or the request's own timeout)",
    "413": "body too large (as sent, or once decoded from its Content-Encoding)",
    "415": "Content-Type not JSON, or a Content-Encoding not supported",
    "426": "not a WebSocket handshake",
    "500": "internal error",
    "503": "at capacity, draining or restarting (see Retry-After)",
}
POST_ERRORS = ("400", "401", "404", "408", "413", "415", "500", "503")


def _object(required: dict[str, dict]) -> dict:
    return {"type": "object", "required": list(required), "properties": required}


_INT, _STR, _ARRAY = {"type": "integer"}, {"type": "string"}, {"type": "array"}
_COMPLETION = _object({"id": _STR, "object": _STR, "created": _INT, "model": _STR, "choices": _ARRAY,
                       "usage": {"type": "object"}})
_RESPONSE = _object({"id": _STR, "object": _STR, "created_at": _INT, "status": _STR, "model": _STR,
                     "output": _ARRAY})
_MESSAGE = _object({"id": _STR, "type": _STR, "role": _STR, "model": _STR, "content": _ARRAY,
                    "stop_reason": {"type": ["string", "null"]}, "usage": {"type": "object"}})
_MODEL = _object({"id": _STR, "object": _STR, "created": _INT, "owned_by": _STR})
POSTS = {  # path -> (request Struct, summary, success body schema, streams, error statuses)
    "/v1/completions": (CompletionRequest, "OpenAI completions; Server-Sent Events with stream: true",
                        _COMPLETION, True, POST_ERRORS),
    "/v1/chat/completions": (ChatCompletionRequest, "OpenAI chat completions; Server-Sent Events with stream: true",
                             _COMPLETION, True, POST_ERRORS),
    "/v1/responses": (ResponsesRequest, "OpenAI Responses API (kept for GET and previous_response_id unless store: "
                      "false; background: true answers at once); named Server-Sent Events with stream: true",
                      _RESPONSE, True, POST_ERRORS),
    "/v1/messages": (MessagesRequest, "Anthropic's Messages API (errors in Anthropic's shape); named Server-Sent "
                     "Events with stream: true", _MESSAGE, True, POST_ERRORS),
    "/v1/messages/count_tokens": (CountTokensRequest, "the prompt's token count of a Messages request (errors in "
                                  "Anthropic's shape)", _object({"input_tokens": _INT}), False,
                                  tuple(s for s in POST_ERRORS if s != "503")),
    "/tokenize": (TokenizeRequest, "text or chat messages to token ids",
                  _object({"tokens": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT,
                           "token_strs": {"type": ["array", "null"], "items": _STR}}),
                  False, tuple(s for s in POST_ERRORS if s != "503")),
    "/detokenize": (DetokenizeRequest, "token ids to text", _object({"prompt": _STR}), False,
                    tuple(s for s in POST_ERRORS if s != "503")),
}
_JSON_OBJECT = {"application/json": {"schema": {"type": "object"}}}
GETS = {  # path -> (summary, success status, its content, error statuses)
    "/v1/models": ("the served model", "200", {"application/json": {"schema": _object(
        {"object": _STR, "data": {"type": "array", "items": _MODEL}})}}, ("401", "500")),
    "/v1/models/{model_id}": ("the served model's object (404 for any other id)", "200",
                              {"application/json": {"schema": _MODEL}}, ("401", "404", "500")),
    "/v1/responses/{response_id}": ("a stored response (404 once evicted; POST .../cancel cancels a background one, "
                                    "DELETE forgets it)", "200", {"application/json": {"schema": _RESPONSE}},
                                    ("400", "401", "404", "500")),
    "/health": ("200 while serving; 503 while draining or while the engine restarts", "200", _JSON_OBJECT,
                ("500", "503")),
    "/metrics": ("Prometheus metrics (text)", "200", {"text/plain": {"schema": _STR}}, ("500",)),
    "/openapi.json": ("this document", "200", _JSON_OBJECT, ("401", "500")),
    "/version": ("shuttle's version, {\"version\": \"0.1.0\"}", "200", _JSON_OBJECT, ("401", "500")),
    "/v1/ws": ("WebSocket streaming; frames described in the README", "101", None,
               ("400", "401", "403", "426", "500")),
    "/ping": ("SageMaker's health route: /health's answer (POST too)", "200", _JSON_OBJECT, ("500", "503")),
    "/load": ("{\"server_load\": requests being served} (0 without --enable-server-load-tracking)", "200",
              {"application/json": {"schema": _object({"server_load": _INT})}}, ("500",)),
}
# the stored responses' other operations: (method, path, summary, error statuses)
STORED_RESPONSE_OPS = [
    ("delete", "/v1/responses/{response_id}", "forget a stored response (a background one still running is "
                                              "cancelled)", ("401", "404", "500")),
    ("post", "/v1/responses/{response_id}/cancel", "cancel a background response (400 for one that is not, or that "
                                                   "has ended otherwise)", ("400", "401", "404", "500")),
]
TOKENIZER_INFO = ("the tokenizer's configuration and chat template (--enable-tokenizer-info-endpoint)", "200",
                  {"application/json": {"schema": _object({"tokenizer_class": _STR})}}, ("401", "500"))


def _errors(statuses: tuple[str, ...], schema: str = "Error") -> dict:
    error = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}
    return {status: {"description": STATUSES[status], "content": error} for status in statuses}


def _get(path: str, summary: str, status: str, content: dict | None, errors: tuple[str, ...]) -> dict:
    success: dict[str, Any] = {"description": "switching to the WebSocket protocol" if status == "101" else summary}
    if content is not None:
        success["content"] = content
    operation = {"summary": summary, "responses": {status: success, **_errors(errors)}}
    names = re.findall(r"\{(\w+)\}", path)
    if names:
        operation["parameters"] = [{"name": name, "in": "path", "required": True, "schema": _STR} for name in names]
    if path in OPEN_PATHS:
        operation["security"] = []
    return {"get": operation}


@functools.cache
def openapi_document(model_name: str, vocab_size: int, tokenizer_info: bool = False, root_path: str = "",
                     lora: bool = False, logprobs_cap: int = MAX_LOGPROBS) -> dict:
    """The whole document (built once per served model name and vocabulary size, which bound request fields):
    with GET /tokenizer_info when `tokenizer_info`, and `root_path` (--root-path, normalized) as its server URL;
    under `lora` (--enable-lora) a request's model is any string, the adapters changing at run time;
    `logprobs_cap` bounds logprobs, top_logprobs and prompt_logprobs (common.sampling.logprobs_limit)."""
    structs = [struct for struct, *_ in POSTS.values()] + [BatchRequest, BatchResponse]
    refs, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    constrain(components, model_name, vocab_size, any_model=lora, logprobs_cap=logprobs_cap)
    components["Error"] = ERROR
    components["AnthropicError"] = ANTHROPIC_ERROR
    paths: dict[str, dict] = {}
    for (path, (_, summary, success, streams, errors)), ref in zip(POSTS.items(), refs):
        content = {"application/json": {"schema": success}}
        if streams:  # each event: a chunk object as JSON text, the last one "[DONE]"
            content["text/event-stream"] = {"schema": _object({"data": _STR})}
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {"200": {"description": "success", "content": content},
                          **_errors(errors, "AnthropicError" if is_messages_path(path) else "Error")},
        }}
    for path, get in (GETS | ({"/tokenizer_info": TOKENIZER_INFO} if tokenizer_info else {})).items():
        paths[path] = _get(path, *get)
    for method, path, summary, errors in STORED_RESPONSE_OPS:
        paths.setdefault(path, {})[method] = _get(path, summary, "200", _JSON_OBJECT, errors)["get"]
    paths["/ping"]["post"] = paths["/ping"]["get"]
    bodies = [refs[list(POSTS).index(path)] for path in ("/v1/chat/completions", "/v1/completions")]
    paths["/invocations"] = {"post": {
        **paths["/v1/chat/completions"]["post"],
        "summary": "SageMaker's inference route: a body with messages is a chat completion, else one with prompt a "
                   "completion (400 for one with neither)",
        "requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": bodies}}}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"shuttle serving {model_name}", "version": "1",
                 "description": "BatchRequest and BatchResponse are the ZeroMQ batch endpoint's messages (msgpack "
                                "maps). Request bodies may be sent gzip or deflate encoded (Content-Encoding)."},
        "paths": paths,
        **({"servers": [{"url": root_path}]} if root_path else {}),
        "security": [{"bearer": []}],  # when the server has an API key; OPEN_PATHS never need one
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
