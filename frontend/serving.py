"""The transport-neutral serving core: one completion or chat completion from its body to its response bodies.

    1. CompletionCall(state, body) (frontend/completion_call.py) or ChatCall (frontend/chat_call.py): check the
       body, tokenize the prompt(s) or render the chat template, name the response (`request_id`)
    2. `collect()`: the whole response body, or `chunks()`: the stream's chunk bodies. Either first builds one
       TextGeneration per (prompt, choice) (checking each prompt's sampling parameters), then runs them
       (frontend/generation.py: submit, detokenize, stop strings): one choice streams straight from its
       generation, several are merged (frontend/choices.py)

HTTP (frontend/completions/routes.py), the WebSocket (frontend/transports/websocket.py) and the ZeroMQ batch endpoint
(frontend/transports/zmq_batch.py) are thin adapters around it: they only read their transport's frames, make a call and
write `collect()` or `chunks()` back in their own framing (frontend/open_call.py picks the call by endpoint path). So
every transport has the same parameters, the same validation and the same errors (InvalidRequestError,
ModelNotFoundError, GenerationError; `frontend/request/errors.py`'s `client_error` maps them to HTTP statuses).
"""

from __future__ import annotations

import time
import uuid
from contextlib import aclosing
from typing import AsyncGenerator

import msgspec

from shuttle.common.errors import InvalidRequestError, ModelNotFoundError
from shuttle.common.messages import Submit
from shuttle.common.sampling import StructuredOutput
from shuttle.frontend.choices import CollectedChoice, collect, merge, usage
from shuttle.frontend.generation import TextDelta, TextGeneration
from shuttle.frontend.request.params import sampling_params
from shuttle.frontend.request.protocol import SamplingFields
from shuttle.frontend.state import FrontendState
from shuttle.frontend.structured.request import constraint_source, structured_output_of


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_model(state: FrontendState, model: str | None) -> None:
    """Raises ModelNotFoundError: `model` is given and is none of the served names or LoRA adapters (the message
    lists them all)."""
    names = state.config.model.served_model_names + adapter_names(state)
    if model is not None and model not in names:
        listed = " or ".join(filter(None, (", ".join(f"`{n}`" for n in names[:-1]), f"`{names[-1]}`")))
        raise ModelNotFoundError(f"The model `{model}` does not exist; this server serves {listed}")


def adapter_names(state: FrontendState) -> tuple[str, ...]:
    """The LoRA adapters a request may name as its model (none without --enable-lora)."""
    return tuple(state.lora_modules)


def lora_name(state: FrontendState, model: str | None) -> str:
    """The LoRA adapter a request's (checked) `model` names; "" for the served model itself."""
    return model if model is not None and model in state.lora_modules else ""


def response_model(state: FrontendState, model: str | None) -> str:
    """The `model` a response names: the LoRA adapter the request named, else the served model's name."""
    return lora_name(state, model) or state.model_name


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
    adapter = lora_name(state, body.model)
    if body.priority and state.config.scheduler.scheduling_policy != "priority":  # vLLM's rule: never ignored
        raise InvalidRequestError("priority is honoured only under --scheduling-policy priority; "
                                  f"this server schedules {state.config.scheduler.scheduling_policy} (leave it out "
                                  f"or 0)", param="priority")
    queue_bound = state.config.scheduler.max_waiting_requests
    if len(prompts) * body.n > queue_bound:
        raise InvalidRequestError(f"{len(prompts)} prompt(s) x n={body.n} sequences exceed the server's waiting "
                                  f"queue bound of {queue_bound}", param="n")
    info = state.engine.info
    kv_tokens = info.num_kv_blocks * info.block_size if info is not None else None
    generations = []
    for p, ids in enumerate(prompts):
        base = sampling_params(body, len(ids), model.max_model_len, state.tokenizer.vocab_size, max_tokens, logprobs,
                               prompt_param, prompt_logprobs, max_tokens_param, model.max_logprobs, structured,
                               model.sampling_defaults, kv_tokens)
        prompt_metrics = state.metrics.prompt(body.n)
        for j in range(body.n):
            sampling = base if base.seed is None else msgspec.structs.replace(base, seed=(base.seed + j) % 2**64)
            index = p * body.n + j
            request = Submit(request_id=f"{request_id}-{index}", prompt_token_ids=ids, sampling=sampling,
                             arrival_time=time.time(), priority=body.priority, timeout=body.timeout or 0.0,
                             group_id=request_id, ttft_slo_ms=body.ttft_slo_ms or 0.0, background=background,
                             lora_name=adapter, lora_path=state.lora_modules[adapter].path if adapter else "",
                             lora_load_id=state.lora_modules[adapter].load_id if adapter else "")
            metrics = prompt_metrics.sequence(len(ids))
            generations.append(TextGeneration(state.engine, state.tokenizer, request, index, stops,
                                              body.include_stop_str_in_output, metrics,
                                              refusal_params=(constraint_param, max_tokens_param),
                                              log_requests=state.config.observability.enable_log_requests))
    return generations


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
                # a chat choice's role chunk goes before its first delta's tokens: its usage counts none of them,
                # as vLLM's (taken before chunk_choices counts the delta's reasoning tokens)
                opening = _uncounted(self.usage(), len(delta.token_ids)) if continuous and first else None
                for choice in self.chunk_choices(delta, first):
                    so_far = {}
                    if continuous:
                        role = opening is not None and "role" in choice.get("delta", {})
                        so_far = {"usage": opening if role else self.usage()}
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


def _uncounted(usage: dict, tokens: int) -> dict:
    """`usage` (changed in place) without `tokens` output tokens: that of a chunk sent before them."""
    usage["completion_tokens"] -= tokens
    usage["total_tokens"] -= tokens
    return usage
