"""The Responses API over HTTP: POST /v1/responses (the response object as JSON, or its named Server-Sent Events
with no [DONE]; `background: true` answered at once), GET and DELETE /v1/responses/{id} and
POST /v1/responses/{id}/cancel on the server's ResponseStore (frontend/responses/store.py)."""

from __future__ import annotations

import json

from aiohttp import web

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend.completions.routes import _named_event, _respond, _stream
from shuttle.frontend.request.decoding import decode_body
from shuttle.frontend.responses import background
from shuttle.frontend.responses.api import RESPONSES_URL, ResponsesCall
from shuttle.frontend.responses.request import ResponsesRequest
from shuttle.frontend.state import RESPONSE_ID, STATE
from shuttle.frontend.web.middleware import reads_no_body
from shuttle.frontend.web.off_loop import convert
from shuttle.frontend.web.server import request_body


async def create_response(request: web.Request) -> web.StreamResponse:
    """POST /v1/responses. A failure after the stream's first event is an `error` event."""
    raw, state = await request_body(request), request.app[STATE]
    body = await convert(lambda: decode_body(raw, ResponsesRequest), len(raw))
    # looked up here, on the event loop that owns the store; the conversation it holds is converted with the body
    previous = state.responses.previous(body.previous_response_id) if body.previous_response_id is not None else None
    size = len(raw) + (previous.size if previous is not None else 0)
    call = await convert(lambda: ResponsesCall(state, body, previous), size)
    call.input_size, call.body_bytes = size, len(raw)
    request[RESPONSE_ID] = call.request_id
    if body.background:
        return web.json_response(background.start(call), dumps=_dumps)
    if not body.stream:
        return await _respond(request, call)
    return await _stream(request, call, _named_event, call.error_event, done=b"")


async def retrieve_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: the stored response object as it is now.

    Raises:
        ResponseNotFoundError: not stored (never, deleted, or evicted).
        InvalidRequestError: a query parameter not served (stream, starting_after, include).
    """
    _refuse_query(request)
    return web.json_response(request.app[STATE].responses.get(request.match_info["response_id"]).response,
                             dumps=_dumps)


@reads_no_body
async def cancel_response(request: web.Request) -> web.Response:
    """POST /v1/responses/{id}/cancel (frontend/responses/background.py's cancel)."""
    return web.json_response(await background.cancel(request.app[STATE].responses, request.match_info["response_id"]),
                             dumps=_dumps)


async def delete_response(request: web.Request) -> web.Response:
    """DELETE /v1/responses/{id}: forget it (a background one still running is cancelled)."""
    response_id = request.match_info["response_id"]
    request.app[STATE].responses.delete(response_id)
    return web.json_response({"id": response_id, "object": "response", "deleted": True})


def _refuse_query(request: web.Request) -> None:
    for name, value in request.query.items():
        if name == "stream" and value.lower() == "false":
            continue
        what = "replaying a background response's events is not implemented" if name in ("stream", "starting_after") \
            else "not implemented"
        raise InvalidRequestError(f"{name} is not supported: {what}", param=name)


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


async def _close_store(app: web.Application) -> None:
    await app[STATE].responses.close()


def add_routes(app: web.Application) -> None:
    """The Responses API's routes, and the end of every background response still running when the app stops."""
    app.router.add_post(RESPONSES_URL, create_response)
    app.router.add_get(RESPONSES_URL + "/{response_id}", retrieve_response)
    app.router.add_delete(RESPONSES_URL + "/{response_id}", delete_response)
    app.router.add_post(RESPONSES_URL + "/{response_id}/cancel", cancel_response)
    app.on_shutdown.append(_close_store)
