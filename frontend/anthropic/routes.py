"""POST /v1/messages and POST /v1/messages/count_tokens over HTTP: the body decoded (off the event loop when large),
the message object as JSON or its events as named Server-Sent Events (`event: <type>` lines, no [DONE]; a failure
after the first event is an `error` event in Anthropic's shape). Error answers are Anthropic's
(frontend/anthropic/errors.py)."""

from __future__ import annotations

import json

from aiohttp import web

from shuttle.frontend.anthropic.errors import error_body
from shuttle.frontend.anthropic.messages import MessagesCall, count_tokens
from shuttle.frontend.anthropic.request import CountTokensRequest, MessagesRequest
from shuttle.frontend.completions.routes import _named_event, _stream
from shuttle.frontend.request.decoding import decode_body
from shuttle.frontend.state import RESPONSE_ID, STATE
from shuttle.frontend.web.off_loop import convert
from shuttle.frontend.web.server import request_body

MESSAGES_URL = "/v1/messages"
COUNT_TOKENS_URL = "/v1/messages/count_tokens"


async def create_message(request: web.Request) -> web.StreamResponse:
    """POST /v1/messages."""
    raw, state = await request_body(request), request.app[STATE]
    call = await convert(lambda: MessagesCall(state, decode_body(raw, MessagesRequest)), len(raw))
    request[RESPONSE_ID] = call.request_id
    if not call.body.stream:
        return web.json_response(await call.collect(), dumps=_dumps)
    return await _stream(request, call, _named_event, error_body, done=b"")


async def count_message_tokens(request: web.Request) -> web.Response:
    """POST /v1/messages/count_tokens."""
    raw, state = await request_body(request), request.app[STATE]
    return web.json_response(await convert(lambda: count_tokens(state, decode_body(raw, CountTokensRequest)),
                                           len(raw)))


def add_routes(app: web.Application) -> None:
    """Register the Messages API's routes on `app`."""
    app.router.add_post(MESSAGES_URL, create_message)
    app.router.add_post(COUNT_TOKENS_URL, count_message_tokens)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)
