"""An in-process frontend over a scripted engine: exact, fast tests of the HTTP API without a scheduler or model.

`FakeEngine` stands in for `frontend.engine_client.EngineClient`: every request "generates" the script's token ids,
one per step, with made-up logprobs, and ends like the scheduler would (an end-of-sequence id, max_tokens, or the
script's end: "stop"; or a scripted error). `frontend_app()` builds the real aiohttp application around it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from aiohttp import web

from common.config import IpcConfig, ModelConfig, ShuttleConfig
from common.messages import FinishReason, RequestOutput, SchedulerStats, TokenLogprobs
from common.sampling import SamplingParams
from frontend.app import build_app
from frontend.chat import ChatTemplate
from frontend.metrics import Metrics
from frontend.state import FrontendState
from frontend.tokenizer import TextTokenizer
from tests.server import MODEL_DIR, REPO

SERVED = "stories"
TEMPLATES = REPO / "tests" / "data"


def sampled_logprob(position: int) -> float:
    """The fake's logprob of the sampled token at output `position`."""
    return -0.25 * (position + 1)


@dataclass
class Submitted:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    timeout: float
    group_id: str = ""


@dataclass
class FakeEngine:
    """Scripted engine client.

    Attributes:
        script: token ids every request generates, one per step (cut at max_tokens).
        top: the (token id, logprob) alternatives of every step, most likely first; a request asking for k
            logprobs gets the first k.
        error: (status, message) to end every request with instead of tokens.
        eos: ids that end a request (unless ignore_eos), as the scheduler's end-of-sequence check.
        submitted: every request seen; aborted: ids of requests whose consumer left before the end.
    """

    script: list[int] = field(default_factory=list)
    top: list[tuple[int, float]] = field(default_factory=lambda: [(261, -0.1), (286, -2.5), (298, -3.0)])
    error: tuple[int, str] | None = None
    eos: tuple[int, ...] = (2,)
    submitted: list[Submitted] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    info: None = None

    @property
    def num_in_flight(self) -> int:
        return 0

    @staticmethod
    def new_request_id(prefix: str = "cmpl") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def _logprobs(self, token_id: int, position: int, k: int) -> TokenLogprobs:
        top = self.top[:k]
        logprob = dict(self.top).get(token_id, sampled_logprob(position))
        return TokenLogprobs(logprob, [t for t, _ in top], [v for _, v in top])

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, timeout: float = 0.0, group_id: str = "", ttft_slo_ms: float = 0.0,
                       background: bool = False):
        self.submitted.append(Submitted(request_id, list(prompt_token_ids), sampling, timeout, group_id))
        finished = False
        try:
            if self.error is not None:
                finished = True
                yield RequestOutput(request_id, finish_reason=FinishReason.ERROR, error_status=self.error[0],
                                    error_message=self.error[1])
                return
            steps = self.script[:sampling.max_tokens]
            for position, token_id in enumerate(steps):
                finish = None
                if token_id in self.eos and not sampling.ignore_eos and position + 1 >= sampling.min_tokens:
                    finish = FinishReason.STOP
                elif position + 1 == sampling.max_tokens:
                    finish = FinishReason.LENGTH
                elif position + 1 == len(steps):
                    finish = FinishReason.STOP
                logprobs = [] if sampling.logprobs is None else [self._logprobs(token_id, position, sampling.logprobs)]
                prompt_logprobs = []
                if position == 0 and sampling.prompt_logprobs is not None:
                    prompt_logprobs = [self._logprobs(t, i, sampling.prompt_logprobs)
                                       for i, t in enumerate(prompt_token_ids[1:])]
                finished = finish is not None
                yield RequestOutput(request_id, [token_id], finish, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request_id)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def frontend_app(engine: FakeEngine, template: str | None = "stories_chat.jinja", api_key: str | None = None,
                 **config) -> web.Application:
    """The real application (routes, middlewares) over `engine`, serving stories260K as `stories`.
    `config`: ShuttleConfig fields to override (e.g. allowed_origins)."""
    model = ModelConfig.from_dir(MODEL_DIR, served_model_name=SERVED)
    shuttle_config = ShuttleConfig(model=model, ipc=IpcConfig("", "", "", ""),
                                   chat_template=str(TEMPLATES / template) if template else None, **config)
    tokenizer = TextTokenizer(model.model_dir)
    state = FrontendState(shuttle_config, engine, tokenizer,
                          ChatTemplate(model.model_dir, shuttle_config.chat_template), Metrics(lambda: engine.stats))
    return build_app(state, api_key)
