"""OpenAI-style error bodies, and which errors are the client's to see (one mapping for HTTP, the WebSocket and the
batch endpoint)."""

from __future__ import annotations

from typing import overload

from shuttle.common.errors import GenerationError, InvalidRequestError, ModelNotFoundError

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error",
               415: "invalid_request_error", 429: "rate_limit_error", 500: "internal_server_error",
               503: "service_unavailable_error"}


@overload
def client_error(exc: InvalidRequestError | ModelNotFoundError | GenerationError) -> tuple[int, str | None]: ...
@overload
def client_error(exc: BaseException) -> tuple[int, str | None] | None: ...
def client_error(exc: BaseException) -> tuple[int, str | None] | None:
    """(HTTP status, param) for an error that is the client's to see, or None for an internal failure.

    The one mapping shared by HTTP, the WebSocket and the batch endpoint.
    """
    if isinstance(exc, InvalidRequestError):
        return 400, exc.param
    if isinstance(exc, ModelNotFoundError):
        return 404, "model"
    if isinstance(exc, GenerationError):
        return exc.status, exc.param
    return None


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """An OpenAI error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}
