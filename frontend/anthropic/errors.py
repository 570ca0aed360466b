"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, for every failure under
/v1/messages: `anthropic_errors` rewrites the OpenAI error bodies the rest of the application answers with (a
refused field, a wrong key, an unknown model, a body too large, ...), so one mapping serves every route and
middleware; the status and headers (Retry-After, x-should-retry) stay as they were."""

from __future__ import annotations

import json

from aiohttp import web

from shuttle.frontend.web.root_path import route_path

MESSAGES_PATH = "/v1/messages"  # the Messages API's routes are this path and those below it

# Anthropic's error types by HTTP status (its API answers 529 overloaded_error where shuttle answers 503)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
               503: "overloaded_error", 504: "timeout_error"}


def is_messages_path(path: str) -> bool:
    """Whether `path` is one of the Messages API's routes (or below them)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_type(status: int) -> str:
    """Anthropic's error type of an HTTP status: other 4xx are invalid_request_error, other 5xx api_error."""
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(status: int, message: str) -> dict:
    """An Anthropic error object."""
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


@web.middleware
async def anthropic_errors(request: web.Request, handler) -> web.StreamResponse:
    """Under /v1/messages, an OpenAI error body (a JSON response of status >= 400 from any handler or middleware
    inside this one) becomes Anthropic's, with its message; other paths and responses pass unchanged, and so does an
    answer already sent (a body too slow or too large is answered as it arrives)."""
    response = await handler(request)
    if not is_messages_path(route_path(request)) or response.status < 400 or not isinstance(response, web.Response) \
            or response.prepared or response.content_type != "application/json" or not isinstance(response.body, bytes):
        return response
    try:
        error = json.loads(response.body)["error"]
        message = error["message"]
    except (ValueError, KeyError, TypeError):
        return response
    response.body = json.dumps(error_body(response.status, str(message)), ensure_ascii=False).encode()
    return response
