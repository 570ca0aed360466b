"""Cross-cutting HTTP concerns: OpenAI error bodies for every failure, API-key auth, JSON content type."""

from __future__ import annotations

import hmac
import math

from aiohttp import web

from common.errors import GenerationError, InvalidRequestError, ModelNotFoundError
from frontend.protocol import client_error, error_body
from frontend.state import STATE

OPEN_PATHS = ("/health", "/metrics")


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None) -> web.Response:
    return web.json_response(error_body(status, message, param), status=status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI error body with the right status; never a stack trace to the client."""
    try:
        return await handler(request)
    except (InvalidRequestError, ModelNotFoundError, GenerationError) as exc:
        status, param = client_error(exc)
        if isinstance(exc, InvalidRequestError):
            request.app[STATE].metrics.rejected.labels("invalid").inc()
        retry_after = max(1, math.ceil(getattr(exc, "retry_after", 0.0) or 1))  # whole seconds (RFC 9110)
        return _error(status, str(exc), param, headers={"Retry-After": str(retry_after)} if status == 503 else None)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return _error(exc.status, exc.reason, headers=allow)
    except (ConnectionResetError, GeneratorExit):
        raise
    except Exception:
        request.app.logger.exception("unhandled error serving %s %s", request.method, request.path)
        return _error(500, "internal server error")


def api_key_auth(api_key: str):
    """Requests outside OPEN_PATHS need `Authorization: Bearer <api_key>` (else 401)."""
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in OPEN_PATHS:
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return _error(401, "invalid or missing API key: send Authorization: Bearer <key>")
        return await handler(request)

    return check


@web.middleware
async def json_content_type(request: web.Request, handler) -> web.StreamResponse:
    """POST bodies must be JSON: a Content-Type other than application/json (or +json) gets 415."""
    if request.method == "POST" and request.content_type and request.headers.get("Content-Type"):
        content_type = request.content_type
        if content_type != "application/json" and not content_type.endswith("+json"):
            return _error(415, f"Content-Type must be application/json, got {content_type}")
    return await handler(request)
