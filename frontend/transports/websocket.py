"""GET /v1/ws: token streaming over a WebSocket.

Protocol (JSON text frames; several generations may share one socket, told apart by `id`):
  client -> {"type": "generate", "id": <optional string or integer, echoed as sent; default "gen-N", the next N
             not in use>, ...any /v1/completions field}
  server -> {"type": "delta", "id": ..., "text": "...", "token_ids": [...]}         one per text delta
  server -> {"type": "done", "id": ..., "finish_reason": "stop"|"length"|"abort", "usage": {...}}
  client -> {"type": "cancel", "id": ...}       the generation ends with a "done" whose finish_reason is "abort"
  server -> {"type": "error", "id": ..., "error": {OpenAI error object}}     instead of "done" when it failed
           (a 503 also carries "retry_after": seconds, like HTTP's Retry-After; from a draining server instead
           "should_retry": false, like HTTP's x-should-retry, as it is going away: the socket closes with 1001
           once its other generations have finished or the drain ends)
Every generate gets exactly one "done" or "error". A cancel for an id that is not generating (already done,
or never started) is ignored. Closing the socket aborts all its generations. Any failure is an error frame,
never an HTTP answer on the upgraded socket; frames are JSON text, escaped to ASCII when a client-chosen id
holds something UTF-8 cannot carry (a lone surrogate such as "\ud800"). A browser's Origin must be the
server's own or one of --allowed-origins (else 403 before the upgrade). A GET without a WebSocket handshake gets
426 (400 for a malformed handshake). Frames from the client must be masked (RFC 6455): an unmasked one closes the
connection with status 1002 (frontend/transports/ws_frames.py, installed by the listener, frontend/web/server.py).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import WSMsgType, web
from yarl import URL

from shuttle.common.errors import InvalidRequestError
from shuttle.frontend import last_words
from shuttle.frontend.completion_call import CompletionCall
from shuttle.frontend.request.decoding import decode_body
from shuttle.frontend.request.errors import client_error, error_body
from shuttle.frontend.request.protocol import CompletionRequest
from shuttle.frontend.state import STATE, FrontendState
from shuttle.frontend.web.off_loop import convert

log = logging.getLogger("shuttle.frontend")


@dataclass(eq=False)
class _Stream:
    """One generation on the socket; `ended` once its terminal frame has been sent."""

    client_id: str | int  # echoed exactly as the client sent it (a string or an integer)
    task: asyncio.Task | None = None
    call: CompletionCall | None = None
    ended: bool = False


def _dumps(frame: dict) -> str:
    text = json.dumps(frame, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a client's id): escaped JSON is still the same JSON
        text = json.dumps(frame, ensure_ascii=True)
    return text


class _Session:
    def __init__(self, ws: web.WebSocketResponse, state: FrontendState, peer: str | None):
        self.ws = ws
        self.state = state
        self.peer = peer
        self.streams: dict[str | int, _Stream] = {}
        self._ids = itertools.count()
        self.broken = False  # the connection failed under a send: logged once, further sends are dropped

    async def send(self, frame: dict) -> None:
        if self.ws.closed or self.broken:
            return
        try:
            await self.ws.send_str(_dumps(frame))
        except (ConnectionError, RuntimeError) as exc:  # reset, or closing under us
            self.broken = True
            log.info("websocket from %s closed abruptly (%s) with %d generation(s) in flight; aborting them",
                     self.peer, type(exc).__name__, len(self.streams))
            for stream in list(self.streams.values()):
                if stream.task is not None and stream.task is not asyncio.current_task():
                    stream.task.cancel()

    async def error(self, client_id: Any, status: int, message: str, param: str | None = None) -> None:
        await self.send({"type": "error", "id": client_id, "error": error_body(status, message, param)["error"]})

    async def refuse(self, client_id: Any, message: str, param: str | None = None) -> None:
        """A frame refused before it became a generation: its 400, counted as an invalid request (as HTTP counts a
        body it cannot read)."""
        self.state.metrics.on_invalid_request()
        await self.error(client_id, 400, message, param)

    async def end(self, stream: _Stream, frame: dict) -> None:
        """Send the stream's one terminal frame (done or error) and forget it."""
        if stream.ended:
            return
        stream.ended = True
        self.streams.pop(stream.client_id, None)
        await self.send(frame)

    async def dispatch(self, data: str) -> None:
        """Handle one text frame; whatever goes wrong becomes an error frame, never a broken socket."""
        try:
            await self._dispatch(data)
        except Exception:
            log.exception("websocket frame handling failed")
            await self.error(None, 500, "internal server error")

    async def _dispatch(self, data: str) -> None:
        try:
            frame = json.loads(data)
        except ValueError as exc:
            return await self.refuse(None, f"invalid JSON: {exc}")
        except RecursionError:  # as HTTP words it; the interpreter's own message names its internals
            return await self.refuse(None, "the frame is nested too deeply")
        if not isinstance(frame, dict):
            return await self.refuse(None, "frame must be a JSON object")
        client_id = frame.get("id")
        kind = frame.get("type")
        if client_id is None:  # the next free name: one in use (a client's own "gen-1") would refuse this one under it
            client_id = f"gen-{next(self._ids)}"
            while client_id in self.streams:
                client_id = f"gen-{next(self._ids)}"
        elif isinstance(client_id, bool) or not isinstance(client_id, (str, int)):
            if kind == "cancel":
                return  # it names no generation
            # the id comes back as sent, so the client can still match this generate's one terminal frame
            return await self.refuse(client_id, "id must be a string or an integer", "id")
        if kind == "cancel":
            stream = self.streams.get(client_id)
            if stream is not None and stream.task is not None:
                stream.task.cancel()
            return
        if kind != "generate":
            return await self.refuse(client_id, "type must be 'generate' or 'cancel'", "type")
        if client_id in self.streams:
            return await self.refuse(client_id, f"id {client_id!r} is already generating", "id")
        stream = _Stream(client_id)
        self.streams[client_id] = stream
        stream.task = asyncio.create_task(self.run(stream, frame))
        stream.task.add_done_callback(lambda task: self._ended_without_frame(stream, task))

    def _ended_without_frame(self, stream: _Stream, task: asyncio.Task) -> None:
        # A task cancelled before it ever ran (generate then cancel in one burst) still owes its terminal frame.
        if not stream.ended and not self.ws.closed:
            asyncio.get_running_loop().create_task(self.end(stream, self._done(stream, "abort")))
        self.streams.pop(stream.client_id, None)

    def _done(self, stream: _Stream, finish_reason: str | None) -> dict:
        call = stream.call
        return {"type": "done", "id": stream.client_id, "finish_reason": finish_reason,
                "usage": call.usage() if call is not None and call.generations else None}

    async def run(self, stream: _Stream, frame: dict) -> None:
        client_id = stream.client_id
        try:
            # null means the default here too (see decode_body), so a null n or stream is no unsupported field
            fields = {k: v for k, v in frame.items() if k not in ("type", "id") and v is not None}
            unsupported = sorted({"n", "stream", "stream_options", "logprobs", "echo"} & fields.keys())
            if unsupported:
                raise InvalidRequestError(f"not supported on the websocket: {', '.join(unsupported)} (it streams one "
                                          f"choice's text per generate)", param=unsupported[0])
            raw = json.dumps(fields).encode()
            stream.call = await convert(lambda: CompletionCall(
                self.state, decode_body(raw, CompletionRequest), "ws",
                one_prompt="the websocket takes one prompt per generate"), len(raw))
            async with aclosing(stream.call.deltas()) as deltas:  # one choice: its own deltas
                async for delta in deltas:
                    if delta.text or delta.token_ids:
                        await self.send({"type": "delta", "id": client_id, "text": delta.text,
                                         "token_ids": delta.token_ids})
            await self.end(stream, self._done(stream, stream.call.generations[0].finish_reason))
        except asyncio.CancelledError:
            await self.end(stream, self._done(stream, "abort"))
        except Exception as exc:
            known = client_error(exc)
            self.state.metrics.on_client_error(exc)
            if known is None and not self.broken:
                log.exception("websocket generation %s failed", client_id)
            status, param = known or (500, None)
            message = str(exc) if known else "internal server error"
            frame = {"type": "error", "id": client_id, "error": error_body(status, message, param)["error"]}
            if status == 503 and self.state.engine.draining:
                frame["should_retry"] = False  # going away: no promise (frontend/engine/backpressure.py)
            elif retry_after := getattr(exc, "retry_after", None):  # a 503: when a retry is expected, as in HTTP
                frame["retry_after"] = round(retry_after, 3)
            await self.end(stream, frame)


def origin_allowed(request: web.Request, allowed: tuple[str, ...]) -> bool:
    """No Origin (not a browser), the server's own host, or one of --allowed-origins ("*": any)."""
    origin = request.headers.get("Origin")
    if origin is None or "*" in allowed or origin in allowed:
        return True
    try:
        return URL(origin).host is not None and URL(origin).raw_authority.lower() == request.host.lower()
    except ValueError:
        return False


def _not_a_handshake(request: web.Request, problem: str) -> web.Response:
    """426 (with `Upgrade: websocket`, RFC 9110 section 15.5.22) for a plain GET, since the endpoint speaks only the
    WebSocket protocol; 400 naming the problem for a handshake that is malformed."""
    if "websocket" not in request.headers.get("Upgrade", "").lower():
        return web.json_response(error_body(426, "GET /v1/ws is a WebSocket endpoint: open it with a WebSocket "
                                                 "handshake (Upgrade: websocket, RFC 6455)"),
                                 status=426, headers={"Upgrade": "websocket"})
    return web.json_response(error_body(400, f"invalid WebSocket handshake: {problem}"), status=400)


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    if not origin_allowed(request, state.config.allowed_origins):
        return web.json_response(error_body(403, f"WebSocket connections from origin "
                                                 f"{request.headers['Origin']!r} are not allowed"), status=403)
    ws = web.WebSocketResponse(heartbeat=30, max_msg_size=4 * 2**20)
    try:
        await ws.prepare(request)
    except web.HTTPBadRequest as exc:  # raised before anything is sent
        return _not_a_handshake(request, exc.text or "")
    session = _Session(ws, state, request.remote)
    state.websockets.add(ws)
    # if the launcher replaces this process, each open generate gets its error frame, then a close with 1012
    token = last_words.register(request.transport, lambda: last_words.websocket_frames(
        [last_words.websocket_error(client_id) for client_id in list(session.streams)]))
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await session.dispatch(message.data)
            elif message.type == WSMsgType.BINARY:
                await session.error(None, 400, "send JSON as text frames; binary frames are not accepted")
    finally:
        last_words.unregister(token)
        state.websockets.discard(ws)
        for stream in list(session.streams.values()):
            if stream.task is not None:
                stream.task.cancel()
    return ws
