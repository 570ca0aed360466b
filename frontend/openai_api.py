"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models in OpenAI's shapes, with SSE streaming."""

from __future__ import annotations

import json
import time

import msgspec
from aiohttp import web

from common.errors import GenerationError, InvalidRequestError, ModelNotFoundError
from frontend.choices import collect, merge, usage
from frontend.generation import TextGeneration
from frontend.protocol import (
    ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest, check_logprobs, completion_prompts,
    decode_body, error_body, sampling_params,
)
from frontend.responses import chat_logprobs, completion_logprobs, prompt_logprobs_object
from frontend.state import RESPONSE_ID, STATE, FrontendState


def check_model(state: FrontendState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{state.model_name}`")


def build_generations(state: FrontendState, body: SamplingFields, prompts: list[list[int]], request_id: str,
                      max_tokens: int | None, logprobs: int | None, prompt_param: str = "prompt",
                      prompt_logprobs: int | None = None) -> list[TextGeneration]:
    """One TextGeneration per (prompt, choice); choice index = prompt index * n + j. With a seed, choice j of a
    prompt samples with seed + j, so the n choices differ yet each is reproducible.

    Raises:
        InvalidRequestError: a parameter out of range for any prompt.
    """
    stops = body.stop_strings()
    model = state.config.model
    queue_bound = state.config.scheduler.max_waiting_requests
    if len(prompts) * body.n > queue_bound:
        raise InvalidRequestError(f"{len(prompts)} prompt(s) x n={body.n} sequences exceed the server's waiting "
                                  f"queue bound of {queue_bound}", param="n")
    generations = []
    for p, ids in enumerate(prompts):
        base = sampling_params(body, len(ids), model.max_model_len, state.tokenizer.vocab_size, max_tokens, logprobs,
                               prompt_param, prompt_logprobs)
        for j in range(body.n):
            sampling = base if base.seed is None else msgspec.structs.replace(base, seed=(base.seed + j) % 2**64)
            index = p * body.n + j
            generations.append(TextGeneration(
                state.engine, state.tokenizer, f"{request_id}-{index}", ids, sampling, index, body.priority,
                body.timeout or 0.0, stops, body.include_stop_str_in_output, state.metrics.request(len(ids)),
                group_id=request_id, ttft_slo_ms=body.ttft_slo_ms or 0.0))
    return generations


def chat_prompt_ids(state: FrontendState, body: ChatCompletionRequest | TokenizeRequest,
                    add_special_tokens: bool) -> list[int]:
    """Token ids of a chat request's prompt: the messages through the chat template with the request's options.
    Special-token text in message content stays text unless parse_special_tokens_in_content.

    Raises:
        InvalidRequestError: the template refused the messages or options, or the prompt is empty or too long.
    """
    tokenizer = state.tokenizer
    text = state.chat_template.render(
        body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
        escape=None if body.parse_special_tokens_in_content else tokenizer.special_text.escape)
    ids = tokenizer.encode_chat(text, add_special_tokens, state.config.model.max_model_len)
    if not ids:
        raise InvalidRequestError("the rendered chat prompt is empty", param="messages")
    return ids


# ---- /v1/completions --------------------------------------------------------------------------------------------

async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request.read(), CompletionRequest)
    check_model(state, body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of is not supported (leave it out or equal to n)", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    logprobs = check_logprobs(body.logprobs, "logprobs")
    prompts = completion_prompts(body.prompt, state.tokenizer, state.config.model.max_model_len,
                                 body.add_special_tokens)
    request_id = state.engine.new_request_id("cmpl")
    request[RESPONSE_ID] = request_id
    # echo with logprobs also scores the prompt (how lm-eval-harness computes loglikelihoods)
    generations = build_generations(state, body, prompts, request_id, body.max_tokens, logprobs,
                                    prompt_logprobs=logprobs if body.echo else None)
    echo_texts = {}
    if body.echo:
        originals = body.prompt if isinstance(body.prompt, list) and not isinstance(body.prompt[0], int) else [body.prompt]
        for g in generations:
            original = originals[g.index // body.n]
            echo_texts[g.index] = original if isinstance(original, str) else state.tokenizer.decode(g.prompt_token_ids)
    envelope = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name}

    emitted: dict[int, int] = {}  # characters of each choice's text sent so far (stream chunks)

    def choice(g: TextGeneration, text: str, token_ids: list[int], lps, finish: str | None, first: bool) -> dict:
        prefix = echo_texts.get(g.index, "") if first else ""
        start = emitted.get(g.index, 0) + len(prefix)
        emitted[g.index] = start + len(text)
        lp_object = None
        if logprobs is not None:
            lp_object = completion_logprobs(state.tokenizer, token_ids, lps, start, len(text))
            if first and g.index in echo_texts:
                lp_object = prompt_logprobs_object(state.tokenizer, g.prompt_token_ids, g.prompt_logprobs, lp_object,
                                                   len(prefix))
        out = {"index": g.index, "text": prefix + text, "logprobs": lp_object, "finish_reason": finish}
        if body.return_token_ids:
            out["token_ids"] = token_ids
            if first:
                out["prompt_token_ids"] = g.prompt_token_ids
        return out

    if body.stream:
        return await _stream(request, generations, body, envelope, lambda g, d, first: choice(
            g, d.text, d.token_ids, d.logprobs, d.finish_reason, first), chat=False)
    results = await collect(generations)
    choices = [choice(r.generation, r.text, r.token_ids, r.logprobs, r.generation.finish_reason, True)
               for r in results]
    return web.json_response({**envelope, "choices": choices, "usage": usage(generations)}, dumps=_dumps)


# ---- /v1/chat/completions ---------------------------------------------------------------------------------------

async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = decode_body(await request.read(), ChatCompletionRequest)
    check_model(state, body.model)
    if body.tools:
        raise InvalidRequestError("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise InvalidRequestError("only response_format {\"type\": \"text\"} is supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = check_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
    ids = chat_prompt_ids(state, body, body.add_special_tokens)
    request_id = state.engine.new_request_id("chatcmpl")
    request[RESPONSE_ID] = request_id
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    generations = build_generations(state, body, [ids], request_id, max_tokens, logprobs, prompt_param="messages")
    envelope = {"id": request_id, "created": int(time.time()), "model": state.model_name}

    def chat_choice(g: TextGeneration, key: str, message: dict, token_ids: list[int], lps, finish: str | None) -> dict:
        out = {"index": g.index, key: message,
               "logprobs": chat_logprobs(state.tokenizer, token_ids, lps) if logprobs is not None else None,
               "finish_reason": finish}
        if body.return_token_ids:
            out["token_ids"] = token_ids
        return out

    # vLLM's return_token_ids for chat: the prompt's ids once per response (on the first chunk when streaming)
    prompt_fields = {"prompt_token_ids": ids} if body.return_token_ids else {}
    if body.stream:
        return await _stream(request, generations, body, {**envelope, "object": "chat.completion.chunk"},
                             lambda g, d, first: chat_choice(g, "delta", {"content": d.text} if d.text else {},
                                                             d.token_ids, d.logprobs, d.finish_reason),
                             chat=True, first_fields=prompt_fields)
    results = await collect(generations)
    choices = [chat_choice(r.generation, "message", {"role": "assistant", "content": r.text}, r.token_ids,
                           r.logprobs, r.generation.finish_reason) for r in results]
    return web.json_response({**envelope, "object": "chat.completion", "choices": choices,
                              "usage": usage(generations), **prompt_fields}, dumps=_dumps)


# ---- streaming --------------------------------------------------------------------------------------------------

async def _stream(request: web.Request, generations: list[TextGeneration], body: SamplingFields, envelope: dict,
                  make_choice, chat: bool, first_fields: dict | None = None) -> web.StreamResponse:
    """Server-Sent Events for all choices, then (with stream_options.include_usage) a usage chunk, then [DONE].
    `first_fields` go into the first event only.

    The first event is awaited before the headers go out, so an admission error is a real HTTP status; an error
    after that arrives as a `data: {"error": ...}` event.
    """
    events = merge(generations)
    try:
        first = await anext(events)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await events.aclose()
        raise
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)

    pending_fields = dict(first_fields or {})

    async def send(payload: dict | str) -> None:
        if pending_fields and isinstance(payload, dict) and "choices" in payload:
            payload = {**payload, **pending_fields}
            pending_fields.clear()
        data = payload if isinstance(payload, str) else _dumps(payload)
        await response.write(f"data: {data}\n\n".encode())

    started: set[int] = set()
    try:
        item = first
        while item is not None:
            generation, delta = item
            is_first = generation.index not in started
            started.add(generation.index)
            if chat and is_first:  # OpenAI's chat streams open each choice with a role-only delta
                await send({**envelope, "choices": [{"index": generation.index, "delta": {"role": "assistant",
                            "content": ""}, "logprobs": None, "finish_reason": None}]})
            await send({**envelope, "choices": [make_choice(generation, delta, is_first and not chat)]})
            item = await anext(events, None)
    except GenerationError as exc:
        await send(error_body(exc.status, str(exc)))
    except ConnectionResetError:
        raise  # the client is gone: closing `events` below aborts its requests
    except Exception:
        request.app.logger.exception("stream failed")
        await send(error_body(500, "internal server error"))
    else:
        if body.stream_options is not None and body.stream_options.include_usage:
            await send({**envelope, "choices": [], "usage": usage(generations)})
    finally:
        await events.aclose()
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
