"""GET /openapi.json: an OpenAPI 3.1 document whose request bodies are generated from the request Structs
(msgspec's JSON Schema), so it cannot drift from what the server decodes. Responses are described loosely:
their shapes are OpenAI's and are documented in the README."""

from __future__ import annotations

import functools

import msgspec

from common.messages import BatchRequest, BatchResponse
from frontend.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

REQUEST_BODIES = {  # path -> (Struct, summary)
    "/v1/completions": (CompletionRequest, "OpenAI completions; Server-Sent Events with stream: true"),
    "/v1/chat/completions": (ChatCompletionRequest, "OpenAI chat completions; Server-Sent Events with stream: true"),
    "/tokenize": (TokenizeRequest, "text or chat messages to token ids"),
    "/detokenize": (DetokenizeRequest, "token ids to text"),
}
GETS = {
    "/v1/models": "the served model",
    "/health": "200 while serving; 503 while draining or while the engine restarts",
    "/metrics": "Prometheus metrics (text)",
    "/openapi.json": "this document",
    "/v1/ws": "WebSocket streaming (upgrade); frames described in the README",
}
ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {"error": {
        "type": "object",
        "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": "integer"}}}},
}


def _error_responses() -> dict:
    described = {"400": "invalid request", "401": "missing or wrong API key", "404": "unknown model or route",
                 "408": "request timed out", "413": "body too large", "415": "body is not JSON",
                 "503": "at capacity, draining or restarting (see Retry-After)"}
    return {code: {"description": text, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
            for code, text in described.items()}


@functools.cache
def openapi_document(model_name: str) -> dict:
    """The whole document (built once per served model name)."""
    structs = [struct for struct, _ in REQUEST_BODIES.values()] + [BatchRequest, BatchResponse]
    refs, components = msgspec.json.schema_components(structs, ref_template="#/components/schemas/{name}")
    components["Error"] = ERROR
    paths: dict[str, dict] = {}
    for (path, (struct, summary)), ref in zip(REQUEST_BODIES.items(), refs):
        paths[path] = {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {"200": {"description": "success", "content": {
                "application/json": {"schema": {"type": "object"}},
                **({"text/event-stream": {"schema": {"type": "string"}}} if "completions" in path else {})}},
                **_error_responses()},
        }}
    for path, summary in GETS.items():
        paths[path] = {"get": {"summary": summary, "responses": {"200": {"description": summary}}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": f"shuttle serving {model_name}", "version": "1",
                 "description": "BatchRequest and BatchResponse are the ZeroMQ batch endpoint's messages (msgpack maps)."},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
