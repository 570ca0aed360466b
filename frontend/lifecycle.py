"""The frontend's side of supervision: the launcher's messages, liveness, and the drain the launcher asks for (it
got SIGTERM or Ctrl-C)."""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio
from aiohttp import WSCloseCode, web

from shuttle.common.config import ShuttleConfig
from shuttle.common.ipc import AsyncChannel
from shuttle.common.messages import EngineDown, SupervisorMessage
from shuttle.common.process import HEARTBEAT_INTERVAL_S, HeartbeatSender
from shuttle.frontend.engine.api import Engine

log = logging.getLogger("shuttle.frontend")

ANSWER_GRACE_S = 0.5  # after the drain fails what is left: time for handlers to write those errors


class SupervisorLink:
    """The PULL socket the launcher pushes EngineDown (naming the serving group) to, and this process's heartbeat
    to the launcher.

    The heartbeat is sent from the event loop, so a wedged loop stops it and the launcher restarts the frontend.
    """

    def __init__(self, config: ShuttleConfig, engine: Engine):
        self.engine = engine
        self.heartbeat = HeartbeatSender(config, "frontend")
        self.channel: AsyncChannel[SupervisorMessage] | None = None
        if config.ipc.supervisor:
            self.channel = AsyncChannel(zmq.asyncio.Context.instance(), zmq.PULL, config.ipc.supervisor, bind=True,
                                        recv_type=SupervisorMessage)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._beat(), name="launcher-heartbeat"))
        if self.channel is not None:
            self._tasks.append(asyncio.create_task(self._listen(), name="launcher-link"))

    async def _listen(self) -> None:
        assert self.channel is not None  # started only with a supervisor endpoint
        while True:
            msg = await self.channel.recv()
            if isinstance(msg, EngineDown):
                if not msg.restarting:  # the launcher stops: every refusal from now on promises nothing
                    self.engine.draining = True
                self.engine.engine_down(msg.reason, msg.retry_after, msg.group, msg.restarting)

    async def _beat(self) -> None:
        while True:
            self.heartbeat.beat()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S / 4)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.channel is not None:
            self.channel.close()


class Shutdown:
    """The launcher's DRAIN_SIGNAL once (it got SIGTERM or Ctrl-C): drain. Again: end the drain now."""

    def __init__(self):
        self.requested = asyncio.Event()
        self.hurry = asyncio.Event()

    def on_signal(self) -> None:
        if self.requested.is_set():
            self.hurry.set()
        self.requested.set()

    def on_parent_gone(self) -> None:
        """PARENT_GONE_SIGNAL: the launcher died, and the engine it ran with it; nothing in flight will finish."""
        log.error("the launcher is gone (killed, or it crashed): ending every request in flight with an error and "
                  "exiting")
        self.requested.set()
        self.hurry.set()


async def drain(engine: Engine, timeout: float, hurry: asyncio.Event,
                websockets: set[web.WebSocketResponse]) -> None:
    """Stop admitting at once (503 with no Retry-After and `Connection: close`: the server is going away, see
    frontend/engine/backpressure.py; /health says "draining"), let in-flight requests finish for up to `timeout`
    seconds, then end the rest with an error and close the WebSockets (1001 going away)."""
    engine.draining = True
    deadline = time.monotonic() + timeout
    log.info("draining: %d request(s) in flight, up to %g s", engine.num_in_flight, timeout)
    while engine.num_in_flight and time.monotonic() < deadline and not hurry.is_set():
        try:
            await asyncio.wait_for(hurry.wait(), 0.05)
        except TimeoutError:
            pass
    if engine.num_in_flight:
        log.warning("drain over: ending %d unfinished request(s) with an error", engine.num_in_flight)
        engine.fail_all(503, "the server shut down before this request finished")
        await asyncio.sleep(ANSWER_GRACE_S)
    if websockets:
        closing = [ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down") for ws in list(websockets)]
        await asyncio.wait([asyncio.ensure_future(c) for c in closing], timeout=1.0)
