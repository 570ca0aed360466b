"""Cross-cutting HTTP concerns: OpenAI error bodies for every failure, API-key auth, JSON content type,
the x-request-id header."""

from __future__ import annotations

import hmac
import re
import uuid

from aiohttp import web

from shuttle.common.errors import GenerationError, InvalidRequestError, ModelNotFoundError
from shuttle.frontend.anthropic.errors import is_messages_path
from shuttle.frontend.engine.backpressure import refusal_headers
from shuttle.frontend.request.errors import client_error, error_body
from shuttle.frontend.state import RESPONSE_ID, STATE
from shuttle.frontend.web.root_path import route_path

# probes (SageMaker's /ping is /health; /load a count, as /metrics has) and the dashboard page, which holds no data
# (its feed needs the key)
OPEN_PATHS = ("/health", "/ping", "/load", "/metrics", "/dashboard")
# A client's x-request-id is echoed when it is a plain printable ASCII string of reasonable length
_ECHOABLE_ID = re.compile(r"^[\x21-\x7e]{1,256}$")


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None,
           retry_after: float | None = None, going_away: bool = False) -> web.Response:
    headers = dict(headers or {})
    if status == 503:  # the predicted wait (frontend/engine/backpressure.py); from a draining server, no promise
        headers.update(refusal_headers(retry_after, going_away))
    elif status == 408:
        # The server already gave the request its time: the official clients retry a 408 unless told not to
        headers["x-should-retry"] = "false"
    response = web.json_response(error_body(status, message, param), status=status, headers=headers)
    if going_away and status == 503:
        response.force_close()  # what its Connection: close says
    return response


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI error body with the right status; never a stack trace to the client."""
    try:
        return await handler(request)
    except (InvalidRequestError, ModelNotFoundError, GenerationError) as exc:
        status, param = client_error(exc)
        request.app[STATE].metrics.on_client_error(exc)
        return _error(status, str(exc), param, retry_after=getattr(exc, "retry_after", None),
                      going_away=request.app[STATE].engine.draining)
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
    """Requests outside OPEN_PATHS need `Authorization: Bearer <api_key>` (else 401); under /v1/messages
    `x-api-key: <api_key>` (Anthropic's header) is taken too. The scheme name is case-insensitive (RFC 9110,
    section 11.1), the key is compared exactly, in constant time."""
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler) -> web.StreamResponse:
        if route_path(request) not in OPEN_PATHS:
            scheme, _, key = request.headers.get("Authorization", "").partition(" ")
            given = key.lstrip(" ").encode("utf-8", "surrogateescape")
            anthropic = is_messages_path(route_path(request))
            if not (hmac.compare_digest(given, expected) and scheme.lower() == "bearer") and not (
                    anthropic and hmac.compare_digest(_header_bytes(request, "x-api-key"), expected)):
                return _error(401, "invalid or missing API key: send Authorization: Bearer <key>"
                              + (" or x-api-key: <key>" if anthropic else ""))
        return await handler(request)

    return check


def _header_bytes(request: web.Request, name: str) -> bytes:
    return request.headers.get(name, "").encode("utf-8", "surrogateescape")


async def request_id_header(request: web.Request, response: web.StreamResponse) -> None:
    """x-request-id on every response (an on_response_prepare hook, so streams get it before their headers go):
    the client's own x-request-id if it sent one, else the response's id, else a fresh one."""
    given = request.headers.get("x-request-id", "")
    response.headers["x-request-id"] = given if _ECHOABLE_ID.match(given) else (
        request.get(RESPONSE_ID) or uuid.uuid4().hex)


def reads_no_body(handler):
    """Mark a route's handler as one that never reads the request body: json_content_type lets any Content-Type
    through to it (a POST with no body goes out as application/octet-stream from aiohttp's and other clients)."""
    handler.reads_no_body = True
    return handler


@web.middleware
async def json_content_type(request: web.Request, handler) -> web.StreamResponse:
    """POST bodies must be JSON: a Content-Type other than application/json (or +json) gets 415, but on the routes
    whose handler is marked `reads_no_body` (POST /ping, POST /v1/responses/{id}/cancel)."""
    if request.method == "POST" and request.content_type and request.headers.get("Content-Type") \
            and not getattr(request.match_info.handler, "reads_no_body", False):
        content_type = request.content_type
        if content_type != "application/json" and not content_type.endswith("+json"):
            return _error(415, f"Content-Type must be application/json, got {content_type}")
    return await handler(request)
