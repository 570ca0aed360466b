"""The real frontend app in the test's own event loop, on a real loopback port, over tests/fake_engine.py's
FakeEngine.

Validation, HTTP edges, WebSocket and batch-socket behaviour need no model: the fake answers every request with
SCRIPT's tokens (up to its max_tokens), one per output, a `step_delay` apart, the last one finishing with "length",
through the same admission checks (draining, engine down) as the real EngineClient.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

from aiohttp import web

from shuttle.common.config import IpcConfig, OpsConfig, ShuttleConfig
from shuttle.common.messages import FinishReason
from shuttle.common.model_config import ModelConfig
from shuttle.frontend.app import BATCH, build_app
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.request.chat_template import ChatTemplate
from shuttle.frontend.state import FrontendState
from shuttle.frontend.tokenizer import TextTokenizer
from shuttle.frontend.transports.zmq_batch import BatchEndpoint
from shuttle.frontend.web.server import listen
from tests.fake_engine import SCRIPT, FakeEngine
from tests.server import MODEL_DIR, REPO

__all__ = ["SCRIPT", "AppServer", "FakeEngine", "make_config", "start_app"]

CHAT_TEMPLATE = str(REPO / "tests" / "data" / "stories_chat.jinja")


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
    engine = FakeEngine(step_delay=step_delay, script_end=FinishReason.LENGTH)
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
