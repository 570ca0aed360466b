"""The transport-neutral serving core: one completion or chat completion from its body to its response bodies.

    1. CompletionCall or ChatCall(state, body): check the body, tokenize the prompt(s) or render the chat
       template, name the response (`request_id`)
    2. `collect()`: the whole response body, or `chunks()`: the stream's chunk bodies. Either first builds one
       TextGeneration per (prompt, choice) (checking each prompt's sampling parameters), then runs them
       (frontend/generation.py: submit, detokenize, stop strings): one choice streams straight from its
       generation, several are merged (frontend/choices.py)

HTTP (frontend/completions/routes.py), the WebSocket (frontend/transports/websocket.py) and the ZeroMQ batch endpoint
(frontend/transports/zmq_batch.py) are thin adapters around it: they only read their transport's frames, make a call and
write `collect()` or `chunks()` back in their own framing. So every transport has the same parameters, the same
validation and the same errors (InvalidRequestError, ModelNotFoundError, GenerationError;
`frontend/request/errors.py`'s `client_error` maps them to HTTP statuses).
"""

from __future__ import annotations

import logging
import time
import uuid
from contextlib import aclosing
from typing import Any, AsyncGenerator

import msgspec

from shuttle.common.errors import InvalidRequestError, ModelNotFoundError
from shuttle.common.messages import Submit
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.choices import CollectedChoice, collect, merge, usage
from shuttle.frontend.completions.prompt_logprobs import first_k, prompt_logprobs_list, prompt_logprobs_of
from shuttle.frontend.completions.shapes import chat_logprobs, completion_logprobs, prompt_logprobs_object
from shuttle.frontend.generation import TextDelta, TextGeneration
from shuttle.frontend.reasoning.choices import ReasoningChoices, reasoning_fields
from shuttle.frontend.request.decoding import convert_body
from shuttle.frontend.request.params import check_logprobs, completion_prompts, sampling_params
from shuttle.frontend.request.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, TokenizeRequest
from shuttle.frontend.state import FrontendState
from shuttle.frontend.structured.request import constraint_source, structured_output_of
from shuttle.frontend.tools.calls import ToolCallChoices, tool_parser_of
from shuttle.frontend.tools.request import template_tools, tool_constraint, tool_use_of

log = logging.getLogger("shuttle.frontend")

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
URLS = (COMPLETIONS_URL, CHAT_COMPLETIONS_URL)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: FrontendState, model: str | None) -> None:
    """Raises ModelNotFoundError: `model` is given and is not the served name."""
    if model is not None and model not in state.config.model.served_model_names:
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves `{state.model_name}`")


def build_generations(state: FrontendState, body: SamplingFields, prompts: list[list[int]], request_id: str,
                      max_tokens: int | None, logprobs: int | None, prompt_param: str = "prompt",
                      prompt_logprobs: int | None = None, background: bool = False,
                      max_tokens_param: str = "max_tokens",
                      structured: StructuredOutput | None = None,
                      constraint_param: str | None = None) -> list[TextGeneration]:
    """One TextGeneration per (prompt, choice); choice index = prompt index * n + j. With a seed, choice j of a
    prompt samples with seed + j, so the n choices differ yet each is reproducible. `background`: batch work,
    which the scheduler runs behind every interactive request. `structured`: every choice's output constraint, from
    the field `constraint_param` (which an engine's refusal of it names, as max_tokens_param names a length one).

    Raises:
        InvalidRequestError: a parameter out of range for any prompt.
    """
    stops = body.stop_strings()
    model = state.config.model
    if body.priority and state.config.scheduler.scheduling_policy != "priority":  # vLLM's rule: never ignored
        raise InvalidRequestError("priority is honoured only under --scheduling-policy priority; "
                                  f"this server schedules {state.config.scheduler.scheduling_policy} (leave it out "
                                  f"or 0)", param="priority")
    queue_bound = state.config.scheduler.max_waiting_requests
    if len(prompts) * body.n > queue_bound:
        raise InvalidRequestError(f"{len(prompts)} prompt(s) x n={body.n} sequences exceed the server's waiting "
                                  f"queue bound of {queue_bound}", param="n")
    generations = []
    for p, ids in enumerate(prompts):
        base = sampling_params(body, len(ids), model.max_model_len, state.tokenizer.vocab_size, max_tokens, logprobs,
                               prompt_param, prompt_logprobs, max_tokens_param, model.max_logprobs, structured,
                               model.sampling_defaults)
        prompt_metrics = state.metrics.prompt(body.n)
        for j in range(body.n):
            sampling = base if base.seed is None else msgspec.structs.replace(base, seed=(base.seed + j) % 2**64)
            index = p * body.n + j
            request = Submit(request_id=f"{request_id}-{index}", prompt_token_ids=ids, sampling=sampling,
                             arrival_time=time.time(), priority=body.priority, timeout=body.timeout or 0.0,
                             group_id=request_id, ttft_slo_ms=body.ttft_slo_ms or 0.0, background=background)
            if state.config.observability.enable_log_requests:  # never the prompt's text
                log.info("request %s: %d prompt tokens, %s", request.request_id, len(ids), sampling)
            metrics = prompt_metrics.sequence(len(ids))
            generations.append(TextGeneration(state.engine, state.tokenizer, request, index, stops,
                                              body.include_stop_str_in_output, metrics,
                                              refusal_params=(constraint_param, max_tokens_param)))
    return generations


def chat_prompt_ids(state: FrontendState, body: ChatCompletionRequest | TokenizeRequest,
                    add_special_tokens: bool) -> list[int]:
    """Token ids of a chat request's prompt: the messages (and tools) through the chat template with the request's
    options. Special-token text in message content stays text unless parse_special_tokens_in_content.

    Raises:
        InvalidRequestError: the template refused the messages or options, or the prompt is empty or too long.
    """
    tokenizer = state.tokenizer
    assert body.messages is not None  # a TokenizeRequest comes here only with messages
    text = state.chat_template.render(
        body.messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
        escape=None if body.parse_special_tokens_in_content else tokenizer.special_text.escape,
        tools=template_tools(body.tools or ()))
    ids = tokenizer.encode_chat(text, add_special_tokens, state.config.model.max_model_len)
    if not ids:
        raise InvalidRequestError("the rendered chat prompt is empty", param="messages")
    return ids


class Call:
    """One request's choices, run to one response body (`collect`) or streamed as chunk bodies (`chunks`); leaving
    either early aborts every choice. A subclass builds the generations and shapes the choices of its endpoint.

    Attributes:
        request_id: the response's `id` (cmpl-..., chatcmpl-...). It is named before the sampling parameters are
            checked (in `collect`/`chunks`), so an error from them is answered under it.
        generations: one per choice, in choice order; built by the first of collect, chunks or deltas.
        first_fields: fields of the response that go into the first stream chunk only (chat's prompt_token_ids).
    """

    response_object: dict = {}  # the response's "object" when the envelope does not name it
    chunk_object: dict = {}  # ... and a stream chunk's

    def __init__(self, state: FrontendState, body: SamplingFields, request_id: str, envelope: dict):
        self.state = state
        self.body = body
        self.request_id = request_id
        self.envelope = envelope
        self.generations: list[TextGeneration] = []
        self.first_fields: dict = {}
        self.constraint_param: str | None = None  # the field of the output constraint (set by structured_output)

    def build(self) -> list[TextGeneration]:
        raise NotImplementedError

    def structured_output(self) -> StructuredOutput | None:
        """The output constraint of every choice: the body's response_format / structured_outputs / guided_*.

        Sets `constraint_param`, the field it came from.

        Raises:
            InvalidRequestError: a malformed constraint, or several at once (param names the field).
        """
        found = structured_output_of(self.body)
        self.constraint_param = constraint_source(self.body) if found is not None else None
        return found

    def final_choice(self, choice: CollectedChoice) -> dict:
        raise NotImplementedError

    def chunk_choices(self, delta: TextDelta, first: bool) -> list[dict]:
        """The choice objects of one delta (`first`: the first of its choice)."""
        raise NotImplementedError

    def deltas(self) -> AsyncGenerator[TextDelta, None]:
        """The choices' text deltas as they arrive: a lone choice's own (no task, no queue), or several merged.

        Raises:
            InvalidRequestError: a sampling parameter out of range (raised here, before anything is submitted).
        """
        if not self.generations:
            self.generations = self.build()
        if len(self.generations) == 1:
            return self.generations[0].deltas()
        return merge(self.generations)

    async def collect(self) -> dict:
        """Run every choice to its end; the whole response body.

        Raises:
            InvalidRequestError: a sampling parameter out of range.
            GenerationError: a choice failed (the others are aborted).
        """
        if not self.generations:
            self.generations = self.build()
        choices = [self.final_choice(c) for c in await collect(self.generations)]
        return {**self.envelope, **self.response_object, "choices": choices, "usage": self.usage(),
                **self.first_fields}

    async def chunks(self) -> AsyncGenerator[dict, None]:
        """Stream chunk bodies as the choices produce text; with stream_options.include_usage a last usage chunk
        (and with continuous_usage_stats, the usage so far on every chunk). --enable-force-include-usage gives every
        stream both, whatever stream_options say, as vLLM does.
        Nothing is yielded before the first text arrives, so an admission error is raised before any chunk (a
        transport can still answer it with a status).

        Raises:
            InvalidRequestError: a sampling parameter out of range.
            GenerationError: a choice failed (the others are aborted).
        """
        envelope = {**self.envelope, **self.chunk_object}
        first_fields = self.first_fields
        started: set[int] = set()
        options = self.body.stream_options
        forced = self.state.config.api.enable_force_include_usage
        include = forced or (options is not None and options.include_usage)
        continuous = forced or (include and options is not None and options.continuous_usage_stats)
        async with aclosing(self.deltas()) as deltas:
            async for delta in deltas:
                first = delta.index not in started
                started.add(delta.index)
                for choice in self.chunk_choices(delta, first):
                    so_far = {"usage": self.usage()} if continuous else {}
                    yield {**envelope, "choices": [choice], **first_fields, **so_far}
                    first_fields = {}
        if include:
            yield {**envelope, "choices": [], "usage": self.usage()}

    def usage(self) -> dict:
        """The response's usage so far (prompt_tokens_details unless --no-enable-prompt-tokens-details)."""
        return usage(self.generations, self.state.config.api.enable_prompt_tokens_details)

    @property
    def as_token_ids(self) -> bool:
        """Whether logprobs name tokens "token_id:ID": the request's return_tokens_as_token_ids, else the server's
        --return-tokens-as-token-ids (vLLM's precedence)."""
        asked = self.body.return_tokens_as_token_ids
        return self.state.config.api.return_tokens_as_token_ids if asked is None else asked


class CompletionCall(Call):
    """POST /v1/completions (and a WebSocket generate): text choices, `echo`, `logprobs` as in OpenAI's legacy API.

    Args:
        background: batch work (see build_generations).
        one_prompt: when set, a body with several prompts is refused with this message.

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """

    body: CompletionRequest

    def __init__(self, state: FrontendState, body: CompletionRequest, id_prefix: str = "cmpl",
                 background: bool = False, one_prompt: str | None = None):
        check_model(state, body.model)
        if body.best_of is not None and body.best_of != body.n:
            raise InvalidRequestError("best_of is not supported (leave it out or equal to n)", param="best_of")
        if body.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        self.logprobs = check_logprobs(body.logprobs, "logprobs", state.config.model.max_logprobs)
        asked = prompt_logprobs_of(body.prompt_logprobs, body.stream, state.config.model.max_logprobs,
                                   state.tokenizer.vocab_size)
        # echo with logprobs also scores the prompt (how lm-eval-harness computes loglikelihoods), as vLLM: with
        # the k of prompt_logprobs when both are given; a stream shows prompt logprobs only in its echo
        echoed = self.logprobs if body.echo and self.logprobs is not None else None
        self.prompt_logprobs = asked if asked is not None and (echoed is not None or not body.stream) else echoed
        self.prompts = completion_prompts(body.prompt, state.tokenizer, state.config.model.max_model_len,
                                          body.add_special_tokens)
        if one_prompt is not None and len(self.prompts) != 1:
            raise InvalidRequestError(one_prompt, param="prompt")
        request_id = new_request_id(id_prefix)
        super().__init__(state, body, request_id, {"id": request_id, "object": "text_completion",
                                                   "created": int(time.time()), "model": state.model_name})
        self.background = background
        self.echo_texts: dict[int, str] = {}  # choice index -> the prompt as given, to prepend (echo)
        self.echo_ids: set[int] = set()  # choices whose prompt was token ids: their echo keeps special tokens
        self.emitted: dict[int, int] = {}  # choice index -> characters of its text sent so far (stream chunks)

    def build(self) -> list[TextGeneration]:
        body, state = self.body, self.state
        generations = build_generations(state, body, self.prompts, self.request_id, body.max_tokens, self.logprobs,
                                        prompt_logprobs=self.prompt_logprobs,
                                        background=self.background, structured=self.structured_output(),
                                        constraint_param=self.constraint_param)
        if body.echo:
            several = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
            originals = body.prompt if several else [body.prompt]
            for g in generations:
                original = originals[g.index // body.n]
                if isinstance(original, str):
                    self.echo_texts[g.index] = original
                else:  # vLLM echoes decode(ids), special tokens and all
                    self.echo_texts[g.index] = state.tokenizer.decode(g.prompt_token_ids, skip_special_tokens=False)
                    self.echo_ids.add(g.index)
        return generations

    def final_choice(self, choice: CollectedChoice) -> dict:
        g = choice.generation
        out = self._choice(g, choice.text, choice.token_ids, choice.logprobs, g.finish_reason, True)
        if self.prompt_logprobs is not None:  # vLLM's, on each choice of a whole response
            out["prompt_logprobs"] = prompt_logprobs_list(self.state.tokenizer, g.prompt_token_ids, g.prompt_logprobs,
                                                          self.as_token_ids)
        return out

    def chunk_choices(self, delta: TextDelta, first: bool) -> list[dict]:
        return [self._choice(self.generations[delta.index], delta.text, delta.token_ids, delta.logprobs,
                             delta.finish_reason, first)]

    def _choice(self, g: TextGeneration, text: str, token_ids: list[int], lps, finish: str | None,
                first: bool) -> dict:
        tokenizer = self.state.tokenizer
        prefix = self.echo_texts.get(g.index, "") if first else ""
        start = self.emitted.get(g.index, 0) + len(prefix)
        self.emitted[g.index] = start + len(text)
        lp_object = None
        if self.logprobs is not None:
            as_ids = self.as_token_ids
            lp_object = completion_logprobs(tokenizer, token_ids, lps, start, len(text), as_ids)
            if first and g.index in self.echo_texts:
                echoed = [first_k(lp, self.logprobs) for lp in g.prompt_logprobs]
                lp_object = prompt_logprobs_object(tokenizer, g.prompt_token_ids, echoed, lp_object, len(prefix),
                                                   g.index in self.echo_ids, as_ids)
        out = {"index": g.index, "text": prefix + text, "logprobs": lp_object, "finish_reason": finish}
        if self.body.return_token_ids:
            out["token_ids"] = token_ids
            if first:
                out["prompt_token_ids"] = g.prompt_token_ids
        return out


class ChatCall(Call):
    """POST /v1/chat/completions: message choices; in a stream each choice opens with a role-only delta (as OpenAI's
    streams do). With tools, each choice's text is parsed into content and tool calls (frontend/tools/calls.py), and
    tool_choice "required" or a named function constrains the output to them (frontend/tools/request.py). Under
    --reasoning-parser the thinking is split from the answer first (frontend/reasoning/): calls and a grammar apply
    to the answer only.

    Raises:
        InvalidRequestError, ModelNotFoundError: the body is not valid (param names the field).
    """

    body: ChatCompletionRequest
    response_object = {"object": "chat.completion"}
    chunk_object = {"object": "chat.completion.chunk"}

    def __init__(self, state: FrontendState, body: ChatCompletionRequest, id_prefix: str = "chatcmpl",
                 background: bool = False):
        check_model(state, body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        self.logprobs = check_logprobs(body.top_logprobs or 0, "top_logprobs", state.config.model.max_logprobs) \
            if body.logprobs else None
        asked = prompt_logprobs_of(body.prompt_logprobs, body.stream, state.config.model.max_logprobs,
                                   state.tokenizer.vocab_size)
        self.prompt_logprobs = None if body.stream else asked  # a stream's chunks never carry them (vLLM)
        tool_config = state.config.tool_calls
        self.tool_use = tool_use_of(body.tools, body.tool_choice, body.parallel_tool_calls,
                                    tool_config.enable_auto_tool_choice and tool_config.tool_call_parser is not None)
        parser = tool_parser_of(self.tool_use, tool_config.tool_call_parser)
        self.tool_calls = ToolCallChoices(parser, self.tool_use.parallel) if parser is not None else None
        self.prompt = chat_prompt_ids(state, body, body.add_special_tokens)
        # a reasoning model's thinking, split from each choice's content (frontend/reasoning/)
        self.reasoning = ReasoningChoices(state.reasoning, state.reasoning.thinks(
            self.prompt, body.chat_template_kwargs)) if state.reasoning is not None else None
        self._output_ids: dict[int, list[int]] = {}  # choice index -> its token ids so far (reasoning_tokens)
        if self.reasoning is not None and not body.include_reasoning:
            self.logprobs = None  # they would show the thinking's tokens (vLLM leaves them out too)
        request_id = new_request_id(id_prefix)
        super().__init__(state, body, request_id, {"id": request_id, "created": int(time.time()),
                                                   "model": state.model_name})
        self.background = background
        # vLLM's return_token_ids for chat: the prompt's ids once per response (on the first chunk when streaming)
        if body.return_token_ids:
            self.first_fields = {"prompt_token_ids": self.prompt}

    def build(self) -> list[TextGeneration]:
        body = self.body
        newer = body.max_completion_tokens is not None
        return build_generations(self.state, body, [self.prompt], self.request_id,
                                 body.max_completion_tokens if newer else body.max_tokens, self.logprobs,
                                 prompt_param="messages", prompt_logprobs=self.prompt_logprobs,
                                 background=self.background,
                                 max_tokens_param="max_completion_tokens" if newer else "max_tokens",
                                 structured=self.structured_output(), constraint_param=self.constraint_param)

    def structured_output(self) -> StructuredOutput | None:
        """The constraint that tool_choice "required" or a named function makes, else the body's own.

        A forced call beside response_format or structured_outputs is served as the call, as OpenAI and vLLM do (the
        Agents SDK sends an agent's output type with every turn, tool_choice "required" included): the format is
        for a text answer, and a forced call's output is never one. The body's own constraint is still checked.

        Raises:
            InvalidRequestError: as Call.structured_output.
        """
        own = super().structured_output()
        forced = tool_constraint(self.tool_use)
        if forced is not None:
            self.constraint_param = "tools"
        found = forced or own
        after = self.reasoning.grammar_starts_after if self.reasoning is not None else None
        if found is not None and after is not None:  # the thinking is free; the grammar governs the answer (vLLM)
            found = msgspec.structs.replace(found, starts_after=after)
        return found

    def split_reasoning(self, text: str) -> tuple[dict, str | None]:
        """A whole choice's thinking as message fields (none without a reasoning parser; null under
        include_reasoning false) and the text left for content and tool calls (None: the thinking never ended)."""
        if self.reasoning is None:
            return {}, text
        thought, content = self.reasoning.split(text)
        return reasoning_fields(thought if self.body.include_reasoning else None), content

    def reasoning_delta(self, delta: TextDelta) -> tuple[str, str]:
        """(thinking, answer) text that a streamed delta releases; the thinking "" under include_reasoning false."""
        if self.reasoning is None:
            return "", delta.text
        piece = self.reasoning.delta(delta.index, delta.text, delta.finish_reason is not None)
        return piece.reasoning if self.body.include_reasoning else "", piece.content

    def usage(self) -> dict:
        """As Call.usage; under --reasoning-parser with vLLM's completion_tokens_details.reasoning_tokens (the
        thinking's tokens, every choice's, so far)."""
        out = super().usage()
        if self.reasoning is not None:
            out["completion_tokens_details"] = {"reasoning_tokens": sum(
                self.reasoning.count_tokens(ids) for ids in self._output_ids.values())}
        return out

    async def collect(self) -> dict:
        """As Call.collect, with vLLM's `prompt_logprobs` of the (one) prompt beside the choices when asked."""
        body = await super().collect()
        if self.prompt_logprobs is not None:
            g = self.generations[0]
            body["prompt_logprobs"] = prompt_logprobs_list(self.state.tokenizer, g.prompt_token_ids,
                                                           g.prompt_logprobs, self.as_token_ids)
        return body

    def final_choice(self, choice: CollectedChoice) -> dict:
        g = choice.generation
        thought, text = self.split_reasoning(choice.text)  # tool calls are read from the answer only
        self._output_ids[g.index] = choice.token_ids
        message, finish = {"role": "assistant", "content": text}, g.finish_reason
        if self.tool_calls is not None:
            message, finish = self.tool_calls.message(text or "", finish)
        message.update(thought)
        return self._choice("message", g.index, message, choice.token_ids, choice.logprobs, finish)

    def chunk_choices(self, delta: TextDelta, first: bool) -> list[dict]:
        thought, text = self.reasoning_delta(delta)
        self._output_ids.setdefault(delta.index, []).extend(delta.token_ids)
        message, finish = {"content": text} if text else {}, delta.finish_reason
        if self.tool_calls is not None:
            message, finish = self.tool_calls.delta(delta.index, text, finish)
        if thought:
            message = {**reasoning_fields(thought), **message}
        # a delta that released nothing (a think tag, text held as a possible tag) and carries nothing else is not
        # sent, as vLLM skips it
        silent = self.reasoning is not None and not message and finish is None and self.logprobs is None and \
            not self.body.return_token_ids
        choices = [] if silent else [self._choice("delta", delta.index, message, delta.token_ids, delta.logprobs,
                                                  finish)]
        if not first:
            return choices
        role = {"index": delta.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}
        return [role, *choices]

    def _choice(self, key: str, index: int, message: dict, token_ids: list[int], lps, finish: str | None) -> dict:
        out = {"index": index, key: message,
               "logprobs": None if self.logprobs is None else chat_logprobs(self.state.tokenizer, token_ids, lps,
                                                                            self.as_token_ids),
               "finish_reason": finish}
        if self.body.return_token_ids:
            out["token_ids"] = token_ids
        return out


def open_call(state: FrontendState, url: str, data: Any, background: bool = False) -> Call:
    """A body addressed by its endpoint path (`url`: /v1/completions or /v1/chat/completions), already parsed
    from JSON or msgpack into plain objects; for transports that carry either kind of request.

    Raises:
        InvalidRequestError: an unknown url (param "url") or an invalid body (param names the field).
        ModelNotFoundError: a model other than the served one.
    """
    if url == COMPLETIONS_URL:
        return CompletionCall(state, convert_body(data, CompletionRequest), "cmpl", background)
    if url == CHAT_COMPLETIONS_URL:
        return ChatCall(state, convert_body(data, ChatCompletionRequest), "chatcmpl", background)
    raise InvalidRequestError(f"url must be one of {', '.join(URLS)}, got {url!r}", param="url")
