"""The frontend's link to the scheduler: submit, one listener fanning outputs to per-request queues, abort.

It also carries the frontend's side of supervision (issue 9): while the engine is down (the launcher said so)
`generate` refuses at once with a 503 and the expected restart time as Retry-After, while the server drains with
a 503 and no promise (it is going away: frontend/backpressure.py); when the engine goes down every
in-flight request gets one terminal error and the link starts over with a fresh socket, which is up again as
soon as the new scheduler answers its Hello.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

import zmq
import zmq.asyncio

from common.errors import GenerationError
from common.ipc import AsyncChannel
from common.messages import (
    Abort, FinishReason, Heartbeat, Hello, RequestOutput, SchedulerInfo, SchedulerMessage, SchedulerStats,
    StepOutputs, Submit,
)
from common.sampling import SamplingParams
from frontend.backpressure import RestartClock, RetryAfterEstimator

log = logging.getLogger("shuttle.frontend")

HEARTBEAT_INTERVAL_S = 1.0  # the scheduler takes a frontend silent for 10 s as gone (scheduler/liveness.py)
REMOTE_RESTART_GUESS_S = 10.0  # a remote group away for the first time: about one engine start-up on a CPU


@dataclass
class GroupState:
    """One serving group as the frontend sees it, for /health and /metrics.

    Attributes:
        group: its index in the router. endpoint: its scheduler's requests endpoint. up: it takes new work.
        reason: why it is down (None while up). in_flight: this frontend's sequences there. times_down: failures
        seen since the frontend started. routed: sequences sent to it. stats: its scheduler's latest stats.
    """

    group: int
    endpoint: str
    up: bool
    reason: str | None
    in_flight: int
    times_down: int
    routed: int
    stats: SchedulerStats


class EngineClient:
    """Talks to the scheduler over one DEALER socket.

    Every request the client submits yields RequestOutputs until exactly one carries a finish_reason. If the
    consumer stops early (client gone, cancel, stop string), the request is aborted in the scheduler.

    Attributes:
        info: the scheduler's cache geometry (from its answer to Hello).
        stats: the scheduler's latest stats.
        down_reason: why the engine is down, or None while it serves.
        draining: set by the shutdown drain; new requests are refused.
    """

    def __init__(self, endpoint: str, curve: bool = False, remote: bool = False):
        self._endpoint = endpoint
        self._curve = curve
        # A remote group (another host's `shuttle engine`) has no launcher here to say it died: a dropped
        # connection on the socket monitor says it instead.
        self._remote = remote
        self._monitor: asyncio.Task | None = None
        self.times_down = 0
        self.routed = 0
        self._channel: AsyncChannel[SchedulerMessage] = self._connect()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._listener: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._up = asyncio.Event()
        self.info: SchedulerInfo | None = None
        self.stats = SchedulerStats()
        self.on_stats = None  # called with every SchedulerStats message (the metrics' per-step histograms)
        self.down_reason: str | None = None
        self.restart = RestartClock()
        self.draining = False
        self.drain_deadline = 0.0
        self.retry_after = RetryAfterEstimator()

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def _connect(self) -> AsyncChannel[SchedulerMessage]:
        channel = AsyncChannel(zmq.asyncio.Context.instance(), zmq.DEALER, self._endpoint, bind=False,
                               recv_type=SchedulerMessage, curve=self._curve)
        if self._remote:
            monitor = channel.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self._monitor = asyncio.get_running_loop().create_task(self._watch(channel, monitor),
                                                                   name="engine-client-monitor")
        return channel

    async def _watch(self, channel: AsyncChannel, monitor) -> None:
        """A remote group's connection dropped (its scheduler died, or the network): the group is down."""
        try:
            await monitor.recv_multipart()
        finally:
            monitor.close(linger=0)
        if channel is self._channel:  # no launcher here to estimate its restart: the last one measured, if any
            self.engine_down(f"lost the connection to {self._endpoint}",
                             self.restart.last_restart_s or REMOTE_RESTART_GUESS_S)

    async def start(self, timeout: float = 120.0, wait: bool = True) -> SchedulerInfo | None:
        """Say Hello and wait for the scheduler's cache geometry; outputs and stats flow from then on.
        `wait=False`: return at once; the group joins whenever its scheduler answers (a remote group).

        Raises:
            TimeoutError: the scheduler did not answer within `timeout` seconds.
        """
        self._listener = asyncio.create_task(self._listen(self._channel), name="engine-client-listener")
        self._heartbeat = asyncio.create_task(self._beat(), name="engine-client-heartbeat")
        await self._channel.send(Hello())
        if wait:
            await asyncio.wait_for(self._up.wait(), timeout)
        return self.info

    async def wait_up(self) -> None:
        """Return once the scheduler has answered Hello."""
        await self._up.wait()

    @property
    def is_up(self) -> bool:
        """The group takes new work: its scheduler answered, and no failure was reported since."""
        return self.down_reason is None and self._up.is_set()

    def group_state(self, group: int = 0, in_flight: int | None = None) -> GroupState:
        return GroupState(group, self._endpoint, self.is_up, self.down_reason if not self.is_up else None,
                          self.num_in_flight if in_flight is None else in_flight, self.times_down, self.routed,
                          self.stats)

    def group_states(self) -> list[GroupState]:
        """The one serving group behind this client (a Router lists several)."""
        return [self.group_state()]

    async def _listen(self, channel: AsyncChannel[SchedulerMessage]) -> None:
        while True:
            msg = await channel.recv()
            if isinstance(msg, StepOutputs):
                for output in msg.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                if msg.stats is not None:
                    self._on_stats(msg.stats)
            elif isinstance(msg, SchedulerStats):
                self._on_stats(msg)
            elif isinstance(msg, SchedulerInfo):
                self.info = msg
                if self.down_reason is not None:
                    self.restart.up(time.monotonic())
                    log.info("the engine is serving again (%.1f s after it stopped)", self.restart.last_restart_s)
                self.down_reason = None
                self._up.set()

    def _on_stats(self, stats: SchedulerStats) -> None:
        self.stats = stats
        self.retry_after.observe(time.monotonic(), stats.num_admitted, stats.num_waiting, stats.num_running,
                                 stats.num_preemptions)
        if self.on_stats is not None:
            self.on_stats(stats)

    async def _beat(self) -> None:
        """Tell the scheduler this frontend is alive; a silent one is taken as gone and its requests aborted."""
        message = Heartbeat("frontend", os.getpid())
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            try:
                await self._channel.send(message)
            except zmq.ZMQError:
                pass  # the socket was swapped under us (engine restart): the next beat uses the new one

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @staticmethod
    def new_request_id(prefix: str = "cmpl") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    def admission_error(self) -> GenerationError | None:
        """The 503 a new request gets now, or None: admit. Draining: no Retry-After (the server is going away);
        engine down: the time until it is expected back (frontend/backpressure.py's RestartClock)."""
        if self.draining:
            return GenerationError(503, "the server is shutting down", retry_after=None)
        if self.down_reason is not None or not self._up.is_set():
            reason = f" ({self.down_reason})" if self.down_reason else ""
            return GenerationError(503, f"the engine is restarting{reason}; retry shortly",
                                   retry_after=self.restart.retry_after(time.monotonic()))
        return None

    def refusal_retry_after(self) -> float | None:
        """Seconds a client whose request ended with a 503 should wait: until the engine is back, or else (a full
        waiting queue) its place in frontend/backpressure.py's line of promises; None while draining."""
        error = self.admission_error()
        if error is not None:
            return error.retry_after
        return self.retry_after.refused(time.monotonic())

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, timeout: float = 0.0, group_id: str = "",
                       ttft_slo_ms: float = 0.0, background: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; the last one has a finish_reason.
        `timeout`: seconds from now after which the scheduler ends it with an error (0: server default).
        `group_id`: the client request the sequence belongs to (its prompts x n share the running set fairly).
        `ttft_slo_ms`: its TTFT objective for SLO admission (0: the server's).
        `background`: batch work, which the scheduler runs behind every interactive request.

        Raises:
            GenerationError: 503 at once while the server drains or the engine is down.
        """
        error = self.admission_error()
        if error is not None:
            raise error
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        channel = self._channel
        finished = False
        try:
            try:
                await channel.send(Submit(request_id, prompt_token_ids, sampling, time.time(), priority, timeout,
                                          group_id, ttft_slo_ms, background))
            except zmq.ZMQError:  # the engine went down while this was being sent
                if queue.empty():
                    queue.put_nowait(self._error_output(request_id, 503, "the engine stopped; retry shortly"))
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            del self._queues[request_id]
            if not finished and channel is self._channel:
                self.abort(request_id)

    @staticmethod
    def _error_output(request_id: str, status: int, message: str) -> RequestOutput:
        return RequestOutput(request_id, finish_reason=FinishReason.ERROR, error_status=status, error_message=message)

    def fail_all(self, status: int, message: str) -> None:
        """End every in-flight request with an error output (the engine is going away), so each client gets a
        terminal answer instead of a dropped connection."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(self._error_output(request_id, status, message))

    def engine_down(self, reason: str, retry_after: float) -> None:
        """The launcher says the engine stopped: fail what is in flight, refuse new requests until a new
        scheduler answers, and reconnect on a fresh socket (nothing queued for the dead one is replayed)."""
        log.warning("the engine stopped (%s); failing %d in-flight request(s), restart expected in %.1f s",
                    reason, len(self._queues), retry_after)
        self.down_reason = reason
        self.times_down += 1
        self.restart.down(time.monotonic(), retry_after)
        self._up.clear()
        self.stats = SchedulerStats()  # the dead scheduler's queues are gone; the new one reports its own
        self.fail_all(503, f"the engine stopped ({reason}); it is restarting, retry shortly")
        if self._listener is not None:
            self._listener.cancel()
        self._close_channel()
        self._channel = self._connect()
        self._listener = asyncio.create_task(self._listen(self._channel), name="engine-client-listener")
        self._spawn(self._channel.send(Hello()))

    def abort(self, request_id: str) -> None:
        """Tell the scheduler to drop the request now; safe to call from a cancelled task."""
        self._spawn(self._channel.send(Abort([request_id])))

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(_quietly(coroutine))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _close_channel(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            self._monitor = None
            try:
                self._channel.socket.disable_monitor()
            except zmq.ZMQError:
                pass
        self._channel.close()

    def close(self) -> None:
        for task in (self._listener, self._heartbeat):
            if task is not None:
                task.cancel()
        self._close_channel()


async def _quietly(coroutine) -> None:
    try:
        await coroutine
    except zmq.ZMQError:
        pass  # a socket closed by an engine restart: the message had nobody left to reach
