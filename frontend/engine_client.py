"""The frontend's link to the scheduler: submit, one listener fanning outputs to per-request queues, abort."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import AsyncIterator

import zmq
import zmq.asyncio

from common.ipc import AsyncChannel
from common.messages import (
    Abort, FinishReason, Hello, RequestOutput, SchedulerInfo, SchedulerMessage, SchedulerStats, StepOutputs, Submit,
)
from common.sampling import SamplingParams

log = logging.getLogger("shuttle.frontend")


class EngineClient:
    """Talks to the scheduler over one DEALER socket.

    Every request the client submits yields RequestOutputs until exactly one carries a finish_reason. If the
    consumer stops early (client gone, cancel, stop string), the request is aborted in the scheduler.
    """

    def __init__(self, endpoint: str):
        self._channel: AsyncChannel[SchedulerMessage] = AsyncChannel(
            zmq.asyncio.Context.instance(), zmq.DEALER, endpoint, bind=False, recv_type=SchedulerMessage)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._listener: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.info: SchedulerInfo | None = None
        self.stats = SchedulerStats()
        self.on_stats = None  # called with every SchedulerStats message (the metrics' per-step histograms)

    async def start(self, timeout: float = 120.0) -> SchedulerInfo:
        """Say Hello and wait for the scheduler's cache geometry, then start listening.

        Raises:
            TimeoutError: the scheduler did not answer within `timeout` seconds.
        """
        await self._channel.send(Hello())
        deadline = time.monotonic() + timeout
        while self.info is None:
            msg = await asyncio.wait_for(self._channel.recv(), max(deadline - time.monotonic(), 0.001))
            if isinstance(msg, SchedulerInfo):
                self.info = msg
        self._listener = asyncio.create_task(self._listen(), name="engine-client-listener")
        return self.info

    async def _listen(self) -> None:
        while True:
            msg = await self._channel.recv()
            if isinstance(msg, StepOutputs):
                for output in msg.outputs:
                    queue = self._queues.get(output.request_id)
                    if queue is not None:
                        queue.put_nowait(output)
                if msg.stats is not None:
                    self._on_stats(msg.stats)
            elif isinstance(msg, SchedulerStats):
                self._on_stats(msg)

    def _on_stats(self, stats: SchedulerStats) -> None:
        self.stats = stats
        if self.on_stats is not None:
            self.on_stats(stats)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    @staticmethod
    def new_request_id(prefix: str = "cmpl") -> str:
        return f"{prefix}-{uuid.uuid4().hex}"

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                       priority: int = 0, timeout: float = 0.0, ttft_slo_ms: float = 0.0) -> AsyncIterator[RequestOutput]:
        """Submit a request and yield its outputs; the last one has a finish_reason.
        `timeout`: seconds from now after which the scheduler ends it with an error (0: server default).
        `ttft_slo_ms`: its TTFT objective for SLO admission (0: the server's)."""
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            await self._channel.send(Submit(request_id, prompt_token_ids, sampling, time.time(), priority, timeout,
                                            ttft_slo_ms=ttft_slo_ms))
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            del self._queues[request_id]
            if not finished:
                self.abort(request_id)

    def fail_all(self, status: int, message: str) -> None:
        """End every in-flight request with an error output (the engine is going away), so each client gets a
        terminal answer instead of a dropped connection."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(RequestOutput(request_id, finish_reason=FinishReason.ERROR, error_status=status,
                                           error_message=message))

    def abort(self, request_id: str) -> None:
        """Tell the scheduler to drop the request now; safe to call from a cancelled task."""
        task = asyncio.get_running_loop().create_task(self._channel.send(Abort([request_id])))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.cancel()
        self._channel.close()
