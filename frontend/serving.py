"""The transport-neutral serving core: one completion or chat completion from its body to its response bodies.

    validate the body -> tokenize the prompt(s) or render the chat template -> one TextGeneration per (prompt,
    choice) -> submit, detokenize, stop strings (frontend/generation.py) -> collect one response body, or stream
    chunk bodies

HTTP (frontend/openai_api.py), the WebSocket (frontend/websocket.py) and the ZeroMQ batch endpoint
(frontend/zmq_api.py) are thin adapters around it: they only read their transport's frames, call `prepare` and
write `Prepared.collect()` or `Prepared.chunks()` back in their own framing. So every transport has the same
parameters, the same validation and the same errors (InvalidRequestError, ModelNotFoundError, GenerationError;
`frontend.protocol.client_error` maps them to HTTP statuses).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec

from common.errors import InvalidRequestError, ModelNotFoundError
from frontend.choices import collect, merge, usage
from frontend.generation import TextDelta, TextGeneration
from frontend.protocol import (
    ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest, check_logprobs, completion_prompts,
    convert_body, sampling_params,
)
from frontend.responses import chat_logprobs, completion_logprobs, prompt_logprobs_object
from frontend.state import FrontendState

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)


def check_model(state: FrontendState, model: str | None) -> None:
    """Raises ModelNotFoundError: `model` is given and is not the served name."""
    if model is not None and model != state.model_name:
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{state.model_name}`")


def build_generations(state: FrontendState, body: SamplingFields, prompts: list[list[int]], request_id: str,
                      max_tokens: int | None, logprobs: int | None, prompt_param: str = "prompt",
                      prompt_logprobs: int | None = None, background: bool = False,
                      max_tokens_param: str = "max_tokens") -> list[TextGeneration]:
    """One TextGeneration per (prompt, choice); choice index = prompt index * n + j. With a seed, choice j of a
    prompt samples with seed + j, so the n choices differ yet each is reproducible. `background`: batch work,
    which the scheduler runs behind every interactive request.

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
                               prompt_param, prompt_logprobs, max_tokens_param)
        for j in range(body.n):
            sampling = base if base.seed is None else msgspec.structs.replace(base, seed=(base.seed + j) % 2**64)
            index = p * body.n + j
            generations.append(TextGeneration(
                state.engine, state.tokenizer, f"{request_id}-{index}", ids, sampling, index, body.priority,
                body.timeout or 0.0, stops, body.include_stop_str_in_output, state.metrics.request(len(ids)),
                group_id=request_id, ttft_slo_ms=body.ttft_slo_ms or 0.0, background=background))
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


# A choice object from (generation, text, token ids, logprobs, finish_reason, first piece of this choice)
ChoiceMaker = Callable[[TextGeneration, str, list[int], list, "str | None", bool], dict]


@dataclass
class Prepared:
    """A validated request whose generations are built but not yet submitted (submitting starts with
    `collect()` or `chunks()`; leaving either early aborts every choice).

    Attributes:
        request_id: the response's `id` (cmpl-..., chatcmpl-...).
        chat: a chat completion (message/delta choices) rather than a completion (text choices).
        first_fields: fields of the response that go into the first stream chunk only (return_token_ids).
    """

    body: SamplingFields
    request_id: str
    generations: list[TextGeneration]
    envelope: dict
    final_choice: ChoiceMaker
    chunk_choice: ChoiceMaker
    chat: bool
    first_fields: dict = field(default_factory=dict)

    async def collect(self) -> dict:
        """Run every choice to its end; the whole response body.

        Raises:
            GenerationError: a choice failed (the others are aborted).
        """
        results = await collect(self.generations)
        choices = [self.final_choice(r.generation, r.text, r.token_ids, r.logprobs, r.generation.finish_reason, True)
                   for r in results]
        obj = {"object": "chat.completion"} if self.chat else {}
        return {**self.envelope, **obj, "choices": choices, "usage": usage(self.generations), **self.first_fields}

    async def chunks(self) -> AsyncIterator[dict]:
        """Stream chunk bodies as the choices produce text: for chat, each choice opens with a role-only delta (as
        OpenAI's streams do); with stream_options.include_usage a last usage chunk. Nothing is yielded before the
        first text arrives, so an admission error is raised before any chunk (a transport can still answer it
        with a status).

        Raises:
            GenerationError: a choice failed (the others are aborted).
        """
        envelope = {**self.envelope, "object": "chat.completion.chunk"} if self.chat else self.envelope
        pending = dict(self.first_fields)
        started: set[int] = set()

        def chunk(choice: dict) -> dict:
            payload = {**envelope, "choices": [choice]}
            if pending:
                payload.update(pending)
                pending.clear()
            return payload

        events = merge(self.generations)
        try:
            async for generation, delta in events:
                is_first = generation.index not in started
                started.add(generation.index)
                if self.chat and is_first:
                    yield chunk({"index": generation.index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None})
                yield chunk(self._delta_choice(generation, delta, is_first and not self.chat))
        finally:
            await events.aclose()
        if self.body.stream_options is not None and self.body.stream_options.include_usage:
            yield {**envelope, "choices": [], "usage": usage(self.generations)}

    def _delta_choice(self, generation: TextGeneration, delta: TextDelta, first: bool) -> dict:
        return self.chunk_choice(generation, delta.text, delta.token_ids, delta.logprobs, delta.finish_reason, first)


def prepare_completion(state: FrontendState, body: CompletionRequest, id_prefix: str = "cmpl",
                       on_request_id: Callable[[str], None] | None = None, background: bool = False,
                       one_prompt: str | None = None) -> Prepared:
    """Validate a /v1/completions body and build its generations.

    Args:
        on_request_id: called with the response id as soon as it exists (HTTP names its x-request-id after it).
        background: batch work (see build_generations).
        one_prompt: when set, a body with several prompts is refused with this message.

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """
    check_model(state, body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise InvalidRequestError("best_of is not supported (leave it out or equal to n)", param="best_of")
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    logprobs = check_logprobs(body.logprobs, "logprobs")
    prompts = completion_prompts(body.prompt, state.tokenizer, state.config.model.max_model_len,
                                 body.add_special_tokens)
    if one_prompt is not None and len(prompts) != 1:
        raise InvalidRequestError(one_prompt, param="prompt")
    request_id = state.engine.new_request_id(id_prefix)
    if on_request_id is not None:
        on_request_id(request_id)
    # echo with logprobs also scores the prompt (how lm-eval-harness computes loglikelihoods)
    generations = build_generations(state, body, prompts, request_id, body.max_tokens, logprobs,
                                    prompt_logprobs=logprobs if body.echo else None, background=background)
    echo_texts = {}
    if body.echo:
        several = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
        originals = body.prompt if several else [body.prompt]
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

    return Prepared(body, request_id, generations, envelope, choice, choice, chat=False)


def prepare_chat(state: FrontendState, body: ChatCompletionRequest, id_prefix: str = "chatcmpl",
                 on_request_id: Callable[[str], None] | None = None, background: bool = False) -> Prepared:
    """Validate a /v1/chat/completions body, render its prompt and build its generations (see prepare_completion).

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """
    check_model(state, body.model)
    if body.tools:
        raise InvalidRequestError("tools are not supported", param="tools")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise InvalidRequestError("only response_format {\"type\": \"text\"} is supported", param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = check_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
    ids = chat_prompt_ids(state, body, body.add_special_tokens)
    request_id = state.engine.new_request_id(id_prefix)
    if on_request_id is not None:
        on_request_id(request_id)
    newer = body.max_completion_tokens is not None
    generations = build_generations(state, body, [ids], request_id,
                                    body.max_completion_tokens if newer else body.max_tokens, logprobs,
                                    prompt_param="messages", background=background,
                                    max_tokens_param="max_completion_tokens" if newer else "max_tokens")
    envelope = {"id": request_id, "created": int(time.time()), "model": state.model_name}

    def chat_choice(key: str, g: TextGeneration, message: dict, token_ids: list[int], lps, finish: str | None) -> dict:
        out = {"index": g.index, key: message,
               "logprobs": chat_logprobs(state.tokenizer, token_ids, lps) if logprobs is not None else None,
               "finish_reason": finish}
        if body.return_token_ids:
            out["token_ids"] = token_ids
        return out

    def final(g, text, token_ids, lps, finish, first):
        return chat_choice("message", g, {"role": "assistant", "content": text}, token_ids, lps, finish)

    def delta(g, text, token_ids, lps, finish, first):
        return chat_choice("delta", g, {"content": text} if text else {}, token_ids, lps, finish)

    # vLLM's return_token_ids for chat: the prompt's ids once per response (on the first chunk when streaming)
    prompt_fields = {"prompt_token_ids": ids} if body.return_token_ids else {}
    return Prepared(body, request_id, generations, envelope, final, delta, chat=True, first_fields=prompt_fields)


def prepare(state: FrontendState, url: str, data: Any, background: bool = False,
            on_request_id: Callable[[str], None] | None = None) -> Prepared:
    """A body addressed by its endpoint path (`url`: /v1/completions or /v1/chat/completions), already parsed
    from JSON or msgpack into plain objects; for transports that carry either kind of request.

    Raises:
        InvalidRequestError: an unknown url (param "url") or an invalid body (param names the field).
        ModelNotFoundError: a model other than the served one.
    """
    if url == COMPLETIONS_URL:
        return prepare_completion(state, convert_body(data, CompletionRequest), "cmpl", on_request_id, background)
    if url == CHAT_COMPLETIONS_URL:
        return prepare_chat(state, convert_body(data, ChatCompletionRequest), "chatcmpl", on_request_id, background)
    raise InvalidRequestError(f"url must be one of {', '.join(URLS)}, got {url!r}", param="url")
