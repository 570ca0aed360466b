"""The frontend's link to the scheduler: submit, one listener fanning outputs to per-request queues, abort.

It also carries the frontend's side of supervision (issue 9): while the engine is down (the launcher said so)
or the server drains, `generate` refuses at once with a 503 and a Retry-After; when the engine goes down every
in-flight request gets one terminal error and the link starts over with a fresh socket, which is up again as
soon as the new scheduler answers its Hello.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
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
from frontend.backpressure import RetryAfterEstimator

log = logging.getLogger("shuttle.frontend")

HEARTBEAT_INTERVAL_S = 1.0  # the scheduler takes a frontend silent for 10 s as gone (scheduler/liveness.py)


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

    def __init__(self, endpoint: str, curve: bool = False):
        self._endpoint = endpoint
        self._curve = curve
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
        self._down_since = 0.0
        self._down_until = 0.0
        self.draining = False
        self.drain_deadline = 0.0
        self.retry_after = RetryAfterEstimator()

    def _connect(self) -> AsyncChannel[SchedulerMessage]:
        return AsyncChannel(zmq.asyncio.Context.instance(), zmq.DEALER, self._endpoint, bind=False,
                            recv_type=SchedulerMessage, curve=self._curve)

    async def start(self, timeout: float = 120.0) -> SchedulerInfo:
        """Say Hello and wait for the scheduler's cache geometry; outputs and stats flow from then on.

        Raises:
            TimeoutError: the scheduler did not answer within `timeout` seconds.
        """
        self._listener = asyncio.create_task(self._listen(self._channel), name="engine-client-listener")
        self._heartbeat = asyncio.create_task(self._beat(), name="engine-client-heartbeat")
        await self._channel.send(Hello())
        await asyncio.wait_for(self._up.wait(), timeout)
        return self.info

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
                    log.info("the engine is serving again")
                self.down_reason = None
                self._up.set()

    def _on_stats(self, stats: SchedulerStats) -> None:
        self.stats = stats
        self.retry_after.observe(time.monotonic(), stats.num_admitted, stats.num_waiting)
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
        """The 503 a new request gets now (draining, or engine down), with its Retry-After; None: admit."""
        now = time.monotonic()
        if self.draining:
            return GenerationError(503, "the server is shutting down", retry_after=max(self.drain_deadline - now, 1))
        if self.down_reason is not None or not self._up.is_set():
            reason = f" ({self.down_reason})" if self.down_reason else ""
            # the launcher's estimate while it holds; a restart that overruns it is guessed to need half again
            # as long as it has taken so far
            retry_after = max(self._down_until - now, 0.5 * (now - self._down_since), 1.0)
            return GenerationError(503, f"the engine is restarting{reason}; retry shortly", retry_after=retry_after)
        return None

    def refusal_retry_after(self) -> float:
        """Seconds a client whose request ended with a 503 should wait: until the engine is back, or the
        drain ends, or else (a full waiting queue) its place in frontend/backpressure.py's virtual queue."""
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
        self._down_since = time.monotonic()
        self._down_until = self._down_since + retry_after
        self._up.clear()
        self.fail_all(503, f"the engine stopped ({reason}); it is restarting, retry shortly")
        if self._listener is not None:
            self._listener.cancel()
        self._channel.close()
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

    def close(self) -> None:
        for task in (self._listener, self._heartbeat):
            if task is not None:
                task.cancel()
        self._channel.close()


async def _quietly(coroutine) -> None:
    try:
        await coroutine
    except zmq.ZMQError:
        pass  # a socket closed by an engine restart: the message had nobody left to reach
