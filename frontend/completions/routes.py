"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models in OpenAI's shapes, with SSE streaming (the
Responses API's handlers, frontend/responses/routes.py, stream through `_stream` too)."""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any, Callable, TypeVar

import msgspec
from aiohttp import web

from shuttle.common.errors import GenerationError
from shuttle.common.lora import LoRAModule
from shuttle.frontend import last_words
from shuttle.frontend.chat_call import ChatCall
from shuttle.frontend.completion_call import CompletionCall
from shuttle.frontend.request.decoding import decode_body
from shuttle.frontend.request.errors import error_body
from shuttle.frontend.request.protocol import ChatCompletionRequest, CompletionRequest
from shuttle.frontend.serving import Call, check_model
from shuttle.frontend.state import RESPONSE_ID, STATE, FrontendState
from shuttle.frontend.web.off_loop import convert
from shuttle.frontend.web.server import request_body

# The serving core (frontend/serving.py) holds what every transport shares; this module only speaks HTTP.

DONE = b"data: [DONE]\n\n"  # the stream's last event
_C = TypeVar("_C", bound=Call)


async def create_completion(request: web.Request) -> web.StreamResponse:
    return await _respond(request, await _call_of(request, CompletionCall, CompletionRequest))


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await _respond(request, await _call_of(request, ChatCall, ChatCompletionRequest))


async def _call_of(request: web.Request, call_class: Callable[[FrontendState, Any], _C],
                   body_class: type[msgspec.Struct]) -> _C:
    """The request's body decoded as `body_class` and made a `call_class`, off the event loop for a large body."""
    raw, state = await request_body(request), request.app[STATE]
    return await convert(lambda: call_class(state, decode_body(raw, body_class)), len(raw))


async def _respond(request: web.Request, call: Call) -> web.StreamResponse:
    request[RESPONSE_ID] = call.request_id  # the x-request-id header when the client sent none, errors included
    if call.body.stream:
        return await _stream(request, call)
    return web.json_response(await call.collect(), dumps=_dumps)


# ---- streaming --------------------------------------------------------------------------------------------------

async def _stream(request: web.Request, call: Call, frame=None, error=error_body,
                  done: bytes = DONE) -> web.StreamResponse:
    """Server-Sent Events: the core's chunks (each written by `frame`, a `data:` line by default), then `done`.

    The first chunk is awaited before the headers go out, so an admission error is a real HTTP status; an error
    after that arrives as an event of its own (`error(status, message)`: a `data: {"error": ...}` by default).
    """
    frame = frame or _event
    async with aclosing(call.chunks()) as chunks:  # leaving (the client gone included) aborts the choices
        first = await anext(chunks, None)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        # if the launcher replaces this process mid-stream, the stream still ends with one error event
        chunked = "chunked" in response.headers.get("Transfer-Encoding", "")  # as prepare() decided (HTTP/1.1)
        token = last_words.register(request.transport, lambda: last_words.sse_chunk(
            frame(error(503, last_words.MESSAGE)) + done, chunked))
        try:
            chunk = first
            while chunk is not None:
                await response.write(frame(chunk))
                chunk = await anext(chunks, None)
        except GenerationError as exc:
            await response.write(frame(error(exc.status, str(exc))))
        except ConnectionResetError:
            raise  # the client is gone
        except Exception:
            request.app.logger.exception("stream failed")
            await response.write(frame(error(500, "internal server error")))
        finally:
            last_words.unregister(token)
    if done:
        await response.write(done)
    await response.write_eof()
    return response


def _event(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _named_event(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


def _dumps(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


def _model_object(state: FrontendState, name: str | None = None) -> dict:
    return {"id": name or state.model_name, "object": "model", "created": 0, "owned_by": "shuttle",
            "root": state.config.model.model_as_given or state.config.model.model_dir,
            "max_model_len": state.config.model.max_model_len,
            "vocab_size": state.tokenizer.vocab_size}


def _adapter_object(state: FrontendState, module: LoRAModule) -> dict:
    """A LoRA adapter's model object, as vLLM lists one: its directory as root, the served model as parent."""
    return {**_model_object(state, module.name), "root": module.path,
            "parent": module.base_model_name or state.model_name}


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]  # one object per --served-model-name, then per LoRA adapter, as vLLM lists them
    adapters = state.lora_modules.values()
    return web.json_response({"object": "list", "data": [_model_object(state, name)
                                                          for name in state.config.model.served_model_names]
                              + [_adapter_object(state, module) for module in adapters]})


async def retrieve_model(request: web.Request) -> web.Response:
    """GET /v1/models/{id}: the served model's object, or 404 for any other id.

    Raises:
        ModelNotFoundError: `id` is not the served model name.
    """
    state = request.app[STATE]
    model_id = request.match_info["model_id"]
    check_model(state, model_id)
    adapter = state.lora_modules.get(model_id)
    return web.json_response(_model_object(state, model_id) if adapter is None or model_id in
                             state.config.model.served_model_names else _adapter_object(state, adapter))
