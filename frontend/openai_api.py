"""POST /v1/completions and GET /v1/models in OpenAI's shapes, with SSE streaming."""

from __future__ import annotations

import json
import time
from contextlib import aclosing

from aiohttp import web

from common.errors import InvalidRequestError
from frontend.generation import GenerationError, TextGeneration
from frontend.protocol import CompletionRequest, decode_body, error_body, prompt_token_ids, sampling_params
from frontend.state import STATE, FrontendState


class ModelNotFound(Exception):
    """The request names a model this server does not serve (HTTP 404)."""


def prepare_generation(state: FrontendState, body: CompletionRequest, request_id: str) -> TextGeneration:
    """Validate a completion request and build its generation.

    Raises:
        InvalidRequestError: a bad prompt or parameter.
        ModelNotFound: `model` names another model.
    """
    if body.model is not None and body.model != state.model_name:
        raise ModelNotFound(f"The model `{body.model}` does not exist; this server serves `{state.model_name}`")
    ids = prompt_token_ids(body.prompt, state.tokenizer.encode, state.tokenizer.vocab_size)
    sampling = sampling_params(body, len(ids), state.config.model.max_model_len, state.tokenizer.vocab_size)
    return TextGeneration(state.engine, state.tokenizer, request_id, ids, sampling, body.priority, body.timeout or 0.0)


def _choice(text: str, finish_reason: str | None, body: CompletionRequest, generation: TextGeneration,
            token_ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if body.return_token_ids and token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request.read(), CompletionRequest)
    request_id = state.engine.new_request_id()
    generation = prepare_generation(state, body, request_id)
    envelope = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    if body.stream:
        return await _stream_completion(request, generation, body, envelope)
    texts, token_ids = [], []
    async for delta in generation.deltas():
        texts.append(delta.text)
        token_ids.extend(delta.token_ids)
    choice = _choice("".join(texts), generation.finish_reason, body, generation, token_ids)
    if body.return_token_ids:
        choice["prompt_token_ids"] = generation.prompt_token_ids
    return web.json_response({**envelope, "choices": [choice], "usage": generation.usage()})


async def _stream_completion(request: web.Request, generation: TextGeneration, body: CompletionRequest,
                             envelope: dict) -> web.StreamResponse:
    async with aclosing(generation.deltas()) as deltas:  # closing aborts the request if the client left
        return await _write_sse(request, deltas, generation, body, envelope)


async def _write_sse(request: web.Request, deltas, generation: TextGeneration, body: CompletionRequest,
                     envelope: dict) -> web.StreamResponse:
    # Wait for the first delta before sending headers, so an admission error is a real HTTP status.
    first = await anext(deltas)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(payload: dict | str) -> None:
        data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
        await response.write(f"data: {data}\n\n".encode())

    try:
        delta = first
        while True:
            chunk = {**envelope, "choices": [_choice(delta.text, delta.finish_reason, body, generation, delta.token_ids)]}
            if body.return_token_ids and delta is first:
                chunk["choices"][0]["prompt_token_ids"] = generation.prompt_token_ids
            await send(chunk)
            if delta.finish_reason is not None:
                break
            delta = await anext(deltas)
    except GenerationError as exc:
        await send(error_body(exc.status, str(exc)))
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            await send({**envelope, "choices": [], "usage": generation.usage()})
    await send("[DONE]")
    await response.write_eof()
    return response


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "shuttle",
             "root": state.config.model.model_dir, "max_model_len": state.config.model.max_model_len}
    return web.json_response({"object": "list", "data": [model]})


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Turn every failure into an OpenAI error body with the right status; never a stack trace to the client."""
    try:
        return await handler(request)
    except InvalidRequestError as exc:
        return web.json_response(error_body(400, str(exc), exc.param), status=400)
    except ModelNotFound as exc:
        return web.json_response(error_body(404, str(exc), "model"), status=404)
    except GenerationError as exc:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return web.json_response(error_body(exc.status, str(exc)), status=exc.status, headers=headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return web.json_response(error_body(exc.status, exc.reason), status=exc.status)
    except (ConnectionResetError, GeneratorExit):
        raise
    except Exception:
        request.app.logger.exception("unhandled error serving %s %s", request.method, request.path)
        return web.json_response(error_body(500, "internal server error"), status=500)
