"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models in OpenAI's shapes, with SSE streaming."""

from __future__ import annotations

import json

from aiohttp import web

from common.errors import GenerationError
from frontend.http_server import request_body
from frontend.protocol import ChatCompletionRequest, CompletionRequest, decode_body, error_body
from frontend.serving import Prepared, check_model, prepare_chat, prepare_completion
from frontend.state import RESPONSE_ID, STATE, FrontendState

# The serving core (frontend/serving.py) holds what every transport shares; this module only speaks HTTP.


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request_body(request), CompletionRequest)
    prepared = prepare_completion(state, body, on_request_id=lambda rid: request.__setitem__(RESPONSE_ID, rid))
    return await _respond(request, prepared)


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request_body(request), ChatCompletionRequest)
    prepared = prepare_chat(state, body, on_request_id=lambda rid: request.__setitem__(RESPONSE_ID, rid))
    return await _respond(request, prepared)


async def _respond(request: web.Request, prepared: Prepared) -> web.StreamResponse:
    if prepared.body.stream:
        return await _stream(request, prepared)
    return web.json_response(await prepared.collect(), dumps=_dumps)


# ---- streaming --------------------------------------------------------------------------------------------------

async def _stream(request: web.Request, prepared: Prepared) -> web.StreamResponse:
    """Server-Sent Events: the core's chunks, then [DONE].

    The first chunk is awaited before the headers go out, so an admission error is a real HTTP status; an error
    after that arrives as a `data: {"error": ...}` event.
    """
    chunks = prepared.chunks()
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await chunks.aclose()
        raise
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else _dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    try:
        item = first
        while item is not None:
            await send(item)
            item = await anext(chunks, None)
    except GenerationError as exc:
        await send(error_body(exc.status, str(exc)))
    except ConnectionResetError:
        raise  # the client is gone: closing `chunks` below aborts its requests
    except Exception:
        request.app.logger.exception("stream failed")
        await send(error_body(500, "internal server error"))
    finally:
        await chunks.aclose()
    await send("[DONE]")
    await response.write_eof()
    return response


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _model_object(state: FrontendState) -> dict:
    return {"id": state.model_name, "object": "model", "created": 0, "owned_by": "shuttle",
            "root": state.config.model.model_dir, "max_model_len": state.config.model.max_model_len,
            "vocab_size": state.tokenizer.vocab_size}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_object(request.app[STATE])]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model's object, or 404 for any other id.

    Raises:
        ModelNotFoundError: `id` is not the served model name.
    """
    state = request.app[STATE]
    check_model(state, request.match_info["model_id"])
    return web.json_response(_model_object(state))
