"""GET /v1/ws: token streaming over a WebSocket.

Protocol (JSON text frames; several generations may share one socket, told apart by `id`):
  client -> {"type": "generate", "id": "<optional, chosen by the client>", ...any /v1/completions field}
  server -> {"type": "delta", "id": ..., "text": "...", "token_ids": [...]}         one per text delta
  server -> {"type": "done", "id": ..., "finish_reason": "stop"|"length"|"abort", "usage": {...}}
  client -> {"type": "cancel", "id": ...}       the generation ends with a "done" whose finish_reason is "abort"
  server -> {"type": "error", "id": ..., "error": {OpenAI error object}}     instead of "done" when it failed
Every generate gets exactly one "done" or "error". Closing the socket aborts all its generations.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import aclosing

from aiohttp import WSMsgType, web

from common.errors import InvalidRequestError
from frontend.generation import GenerationError
from frontend.openai_api import ModelNotFound, prepare_generation
from frontend.protocol import CompletionRequest, decode_body, error_body
from frontend.state import STATE


async def websocket_handler(request: web.Request) -> web.WebSocketResponse:
    state = request.app[STATE]
    ws = web.WebSocketResponse(heartbeat=30)
    await ws.prepare(request)
    running: dict[str, asyncio.Task] = {}

    async def run(client_id: str, body: CompletionRequest) -> None:
        try:
            generation = prepare_generation(state, body, state.engine.new_request_id("ws"))
            async with aclosing(generation.deltas()) as deltas:
                async for delta in deltas:
                    if delta.text or delta.token_ids:
                        await ws.send_json({"type": "delta", "id": client_id, "text": delta.text,
                                            "token_ids": delta.token_ids})
            await ws.send_json({"type": "done", "id": client_id, "finish_reason": generation.finish_reason,
                                "usage": generation.usage()})
        except asyncio.CancelledError:
            if not ws.closed:
                await ws.send_json({"type": "done", "id": client_id, "finish_reason": "abort",
                                    "usage": generation.usage()})
        except (InvalidRequestError, ModelNotFound, GenerationError) as exc:
            status = 400 if isinstance(exc, InvalidRequestError) else 404 if isinstance(exc, ModelNotFound) else exc.status
            await ws.send_json({"type": "error", "id": client_id,
                                "error": error_body(status, str(exc), getattr(exc, "param", None))["error"]})
        finally:
            running.pop(client_id, None)

    try:
        async for message in ws:
            if message.type != WSMsgType.TEXT:
                continue
            await _dispatch(message.data, ws, running, run)
    finally:
        for task in list(running.values()):
            task.cancel()
    return ws


async def _dispatch(data: str, ws: web.WebSocketResponse, running: dict[str, asyncio.Task], run) -> None:
    try:
        frame = json.loads(data)
    except ValueError as exc:
        return await ws.send_json({"type": "error", "id": None, "error": error_body(400, f"invalid JSON: {exc}")["error"]})
    if not isinstance(frame, dict):
        return await ws.send_json({"type": "error", "id": None, "error": error_body(400, "frame must be a JSON object")["error"]})
    client_id = str(frame.get("id") or f"gen-{len(running)}-{id(frame)}")
    kind = frame.get("type")
    if kind == "cancel":
        task = running.get(client_id)
        if task is not None:
            task.cancel()
        return
    if kind != "generate":
        return await ws.send_json({"type": "error", "id": client_id,
                                   "error": error_body(400, "type must be 'generate' or 'cancel'", "type")["error"]})
    if client_id in running:
        return await ws.send_json({"type": "error", "id": client_id,
                                   "error": error_body(400, f"id {client_id!r} is already generating", "id")["error"]})
    try:
        body = decode_body(json.dumps({k: v for k, v in frame.items() if k not in ("type", "id")}).encode(),
                           CompletionRequest)
    except InvalidRequestError as exc:
        return await ws.send_json({"type": "error", "id": client_id, "error": error_body(400, str(exc), exc.param)["error"]})
    running[client_id] = asyncio.create_task(run(client_id, body))
