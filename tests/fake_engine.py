"""The one fake of the frontend's engine (frontend.engine_api.Engine), and the real aiohttp app around it.

`FakeEngine` is a serving group (frontend.engine_client.ServingGroup, as the real EngineClient is) whose scheduler is
a script: every request "generates" the script's token ids, one per output, `step_delay` seconds apart, with made-up
logprobs, and ends as the scheduler would (an end-of-sequence id or max_tokens; at the script's end `script_end`;
or a scripted error). Admission (draining, engine down, Retry-After), failing what is in flight and the counts of
sequences in flight are the real ServingGroup's. `frontend_app()` builds the real application around it for
aiohttp's TestClient; tests/inprocess.py serves it on a real loopback port.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Iterator

from aiohttp import web

from shuttle.common.config import IpcConfig, ShuttleConfig
from shuttle.common.messages import FinishReason, RequestOutput, SchedulerInfo, Submit, TokenLogprobs
from shuttle.common.model_config import ModelConfig
from shuttle.frontend.app import build_app
from shuttle.frontend.engine.client import ServingGroup
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tokenizer import TextTokenizer
from tests.server import MODEL_DIR, REPO

SERVED = "stories"
TEMPLATES = REPO / "tests" / "data"
SCRIPT = [395, 392, 412, 444, 426, 346, 401, 396]  # " named Max. He loved to play with": decodes cleanly
TOP = [(261, -0.1), (286, -2.5), (298, -3.0)]


def sampled_logprob(position: int) -> float:
    """The fake's logprob of the sampled token at output `position`."""
    return -0.25 * (position + 1)


class FakeEngine(ServingGroup):
    """Scripted engine.

    Args:
        script: token ids every request generates, one per output (cut at max_tokens).
        step_delay: seconds before each output.
        script_end: the finish reason at the script's end (STOP: the model's end-of-sequence token, eos[0], follows the
        script when max_tokens leaves room).
        error: (status, message) to end every request with instead of tokens; `retry_after_s` and `rejection` go
            with it (as the scheduler's SLO refusal).
        top: the (token id, logprob) alternatives of every step, most likely first; a request asking for k
            logprobs gets the first k.
        eos: ids that end a request (unless ignore_eos), as the scheduler's end-of-sequence check.

    Attributes:
        submitted: every request that passed admission, as submitted. aborted: ids of requests whose consumer
            left before their end.
    """

    def __init__(self, script: list[int] = SCRIPT, *, step_delay: float = 0.0,
                 script_end: FinishReason = FinishReason.STOP, error: tuple[int, str] | None = None,
                 retry_after_s: float = 0.0, rejection: str = "", top: list[tuple[int, float]] = TOP,
                 eos: tuple[int, ...] = (2,)):
        super().__init__("fake://engine")
        self.script = list(script)
        self.step_delay = step_delay
        self.script_end = script_end
        self.error = error
        self.retry_after_s = retry_after_s
        self.rejection = rejection
        self.top = top
        self.eos = eos
        self.submitted: list[Submit] = []
        self.aborted: list[str] = []
        self._serving(SchedulerInfo(num_kv_blocks=1000, block_size=16, max_model_len=512))

    @property
    def submitted_ids(self) -> list[str]:
        return [request.request_id for request in self.submitted]

    async def start(self, timeout: float = 120.0, wait: bool = True) -> SchedulerInfo | None:
        if wait:
            await asyncio.wait_for(self._up.wait(), timeout)
        return self.info

    def close(self) -> None:
        pass

    async def generate(self, request: Submit) -> AsyncIterator[RequestOutput]:
        error = self.admission_error()
        if error is not None:
            raise error
        self.submitted.append(request)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue  # counted in flight; fail_all reaches it
        finished = False
        try:
            for output in self._outputs(request):
                await asyncio.sleep(self.step_delay)
                if not queue.empty():  # failed from outside (drain, engine down)
                    output = queue.get_nowait()
                finished = output.finish_reason is not None
                yield output
                if finished:
                    return
        finally:
            del self._queues[request.request_id]
            if not finished:
                self.aborted.append(request.request_id)

    def _outputs(self, request: Submit) -> Iterator[RequestOutput]:
        sampling = request.sampling
        if self.error is not None:
            yield RequestOutput(request_id=request.request_id, finish_reason=FinishReason.ERROR,
                                error_status=self.error[0],
                                error_message=self.error[1], retry_after_s=self.retry_after_s,
                                rejection=self.rejection)
            return
        steps = self.script[:sampling.max_tokens]
        if self.script_end == FinishReason.STOP and len(steps) < sampling.max_tokens and self.eos and \
                (not steps or steps[-1] not in self.eos):
            steps = steps + [self.eos[0]]  # the model's end of sequence is a token, as the scheduler sees it
        for position, token_id in enumerate(steps):
            finish = None
            if (token_id in self.eos and not sampling.ignore_eos or token_id in sampling.stop_token_ids) and \
                    position + 1 >= sampling.min_tokens:
                finish = FinishReason.STOP
            elif position + 1 == sampling.max_tokens:
                finish = FinishReason.LENGTH
            elif position + 1 == len(steps):
                finish = self.script_end
            logprobs = [] if sampling.logprobs is None else [self._logprobs(token_id, position, sampling.logprobs)]
            prompt_logprobs = []
            if position == 0 and sampling.prompt_logprobs is not None:
                prompt_logprobs = [self._logprobs(t, i, sampling.prompt_logprobs)
                                   for i, t in enumerate(request.prompt_token_ids[1:])]
            yield RequestOutput(request_id=request.request_id, new_token_ids=[token_id], finish_reason=finish,
                                logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)

    def _logprobs(self, token_id: int, position: int, k: int) -> TokenLogprobs:
        top = self.top[:k]
        logprob = dict(self.top).get(token_id, sampled_logprob(position))
        ranked = [t for t, _ in self.top]
        rank = ranked.index(token_id) + 1 if token_id in ranked else len(ranked) + 1  # as if TOP were the head
        return TokenLogprobs(logprob=logprob, top_token_ids=[t for t, _ in top], top_logprobs=[v for _, v in top],
                             rank=rank)


def frontend_app(engine: FakeEngine, template: str | None = "stories_chat.jinja", api_key: str | None = None,
                 tracer=None, **config) -> web.Application:
    """The real application (routes, middlewares) over `engine`, serving stories260K as `stories`.
    `tracer`: a RequestTracer, as --otlp-traces-endpoint makes. `config`: ShuttleConfig fields to override (e.g.
    allowed_origins)."""
    model = ModelConfig.from_dir(MODEL_DIR, served_model_name=SERVED)
    shuttle_config = ShuttleConfig(model=model, ipc=IpcConfig("", "", "", ""),
                                   chat_template=str(TEMPLATES / template) if template else None, **config)
    tokenizer = TextTokenizer(model.model_dir)
    metrics = Metrics(lambda: engine.stats)
    metrics.tracer = tracer
    state = FrontendState(shuttle_config, engine, tokenizer,
                          ChatTemplate(model.model_dir, shuttle_config.chat_template), metrics)
    return build_app(state, api_key)
