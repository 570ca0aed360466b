"""The real frontend app in the test's own event loop, on a real loopback port, with a scripted fake engine.

Validation, HTTP edges, WebSocket and batch-socket behaviour need no model: `FakeEngine` answers every
request with a fixed, known sequence of tokens, one per output, through the same admission checks
(draining, engine down) as the real EngineClient.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

from aiohttp import web

from common.config import IpcConfig, ModelConfig, OpsConfig, ShuttleConfig
from common.messages import FinishReason, RequestOutput, SchedulerInfo
from common.sampling import SamplingParams
from frontend.app import BATCH, build_app
from frontend.chat import ChatTemplate
from frontend.engine_client import EngineClient
from frontend.http_server import listen
from frontend.metrics import Metrics
from frontend.state import FrontendState
from frontend.tokenizer import TextTokenizer
from frontend.zmq_api import BatchEndpoint
from tests.server import MODEL_DIR, REPO

SCRIPT = [395, 392, 412, 444, 426, 346, 401, 396]  # " named Max. He loved to play with": decodes cleanly
CHAT_TEMPLATE = str(REPO / "tests" / "data" / "stories_chat.jinja")


class FakeEngine(EngineClient):
    """EngineClient with the scheduler replaced by a script: each request gets SCRIPT's tokens (up to its
    max_tokens), one per output, a `step_delay` apart, the last one finishing with "length"."""

    def __init__(self, step_delay: float = 0.0):
        super().__init__("ipc:///nonexistent/shuttle-fake-engine.sock")
        self.info = SchedulerInfo(num_kv_blocks=1000, block_size=16, max_model_len=512)
        self._up.set()
        self.step_delay = step_delay
        self.submitted: list[str] = []
        self.background: set[str] = set()  # ids submitted as background (batch) work

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, timeout: float = 0.0, group_id: str = "",
                       ttft_slo_ms: float = 0.0, background: bool = False) -> AsyncIterator[RequestOutput]:
        error = self.admission_error()
        if error is not None:
            raise error
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue  # counted in flight; fail_all reaches it
        self.submitted.append(request_id)
        if background:
            self.background.add(request_id)
        tokens = SCRIPT[:sampling.max_tokens]
        try:
            for i, token in enumerate(tokens):
                await asyncio.sleep(self.step_delay)
                if not queue.empty():  # failed from outside (drain, engine down)
                    yield queue.get_nowait()
                    return
                last = i == len(tokens) - 1
                yield RequestOutput(request_id, [token], FinishReason.LENGTH if last else None)
        finally:
            del self._queues[request_id]


@dataclass
class AppServer:
    url: str
    state: FrontendState
    runner: web.AppRunner
    server: asyncio.Server
    batch: BatchEndpoint | None = None
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def engine(self) -> FakeEngine:
        return self.state.engine

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.batch is not None:
            self.batch.close()
        self.server.close()
        await self.runner.cleanup()
        self.engine.close()


def make_config(allowed_origins: tuple[str, ...] = (), **ops) -> ShuttleConfig:
    return ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/nonexistent"),
                         chat_template=CHAT_TEMPLATE, ops=replace(OpsConfig(), **ops), allowed_origins=allowed_origins)


async def start_app(api_key: str | None = None, batch: bool = False, step_delay: float = 0.0, **ops) -> AppServer:
    """Serve the frontend app with a FakeEngine on 127.0.0.1 (any free port); `ops` override OpsConfig fields."""
    config = make_config(**ops)
    engine = FakeEngine(step_delay)
    state = FrontendState(config, engine, TextTokenizer(config.model.model_dir),
                          ChatTemplate(config.model.model_dir, config.chat_template), Metrics(lambda: engine.stats))
    web_app = build_app(state, api_key)
    endpoint = BatchEndpoint(state, "tcp://127.0.0.1:*", api_key) if batch else None
    if endpoint is not None:
        web_app[BATCH] = endpoint  # /health reports on it, as in frontend.app.serve
    runner = web.AppRunner(web_app, handler_cancellation=True, access_log=None, shutdown_timeout=1)
    await runner.setup()
    server = await listen(runner, "127.0.0.1", 0, config.ops)
    app = AppServer(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", state, runner, server)
    if endpoint is not None:
        app.batch = endpoint
        app.tasks.append(asyncio.create_task(app.batch.serve()))
    return app
