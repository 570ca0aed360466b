"""Clients for shuttle's ZeroMQ batch endpoint: the same bodies as /v1/completions and /v1/chat/completions in,
the same response bodies out (see frontend/transports/zmq_batch.py).

    from shuttle.batch_jobs.client import BatchClient
    with BatchClient("tcp://127.0.0.1:8001") as client:
        for r in client.run([{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 8}}]):
            print(r.job_id, r.status_code, r.body)

`AsyncBatchClient` is the asyncio variant (and the engine of both): credit-based flow control (never more than
`max_in_flight` jobs unanswered), a heartbeat to the server every second (so the server aborts the jobs of a
client that died), a clear BatchServerGone when the server falls silent, 503s retried after their Retry-After
instead of being reported, and unanswered jobs sent again when the server restarted (its heartbeat's instance
changed) within the timeout. A 503 from a server shutting down (`should_retry` false) is not retried there: the job
waits for the server's next instance (sent again when its heartbeat says it restarted) or, if none comes within the
timeout, is among the unanswered ones BatchServerGone names.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import queue
import threading
import time
from typing import Any, AsyncIterable, AsyncIterator, Iterable, Iterator

import msgspec
import zmq
import zmq.asyncio

from shuttle.common.config import OpsConfig
from shuttle.common.ipc import AsyncChannel
from shuttle.common.messages import (
    BATCH_MAX_DEPTH,
    BatchHeartbeat,
    BatchPing,
    BatchRequest,
    BatchResponse,
    BatchServerMessage,
)
from shuttle.common.wire_guard import nesting_exceeds

HEARTBEAT_S = 1.0
SERVER_TIMEOUT_S = 5.0  # silence after which the server is taken as gone (it beats every second)
MIN_RETRY_S = 0.2


class BatchServerGone(ConnectionError):
    """The server sent nothing (not even a heartbeat) for `server_timeout` seconds: stopped or unreachable."""


Job = dict[str, Any] | BatchRequest


class AsyncBatchClient:
    """Runs jobs through the batch endpoint, at most `max_in_flight` unanswered at once.

    Args:
        endpoint: the frontend's batch endpoint (`shuttle serve` prints it; default tcp://127.0.0.1:PORT+1).
        max_in_flight: jobs sent and not yet answered (the credit); a 503 being retried still holds its credit.
        api_key: the server's API key, put into every job (default: $SHUTTLE_API_KEY).
        server_timeout: seconds of silence from the server after which BatchServerGone is raised.
        max_message_bytes: the server's --max-batch-message-bytes: a job larger than this once encoded, or nested
            deeper than the server reads (BATCH_MAX_DEPTH), is answered here with a 400 and never sent (the server
            would drop the connection for the one, answer the other under no job id: neither answer could reach
            its job).
    """

    def __init__(self, endpoint: str, max_in_flight: int = 64, api_key: str | None = None,
                 server_timeout: float = SERVER_TIMEOUT_S, heartbeat: float = HEARTBEAT_S,
                 max_message_bytes: int = OpsConfig().max_batch_message_bytes):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.endpoint = endpoint
        self.max_in_flight = max_in_flight
        self.api_key = api_key if api_key is not None else os.environ.get("SHUTTLE_API_KEY", "")
        self.server_timeout = server_timeout
        self.heartbeat = heartbeat
        self.max_message_bytes = max_message_bytes
        self.num_retried = 0  # 503s retried after their Retry-After
        self.num_resent = 0  # jobs sent again because the server restarted while they were unanswered
        self._ctx = zmq.asyncio.Context()
        self._channel: AsyncChannel[BatchServerMessage] | None = None

    def _job(self, job: Job, index: int) -> BatchRequest:
        if isinstance(job, BatchRequest):
            return job if job.api_key or not self.api_key else BatchRequest(job_id=job.job_id, url=job.url,
                                                                            body=job.body, api_key=self.api_key)
        job_id = job.get("custom_id", job.get("job_id", str(index)))
        return BatchRequest(job_id=str(job_id), url=job.get("url", "/v1/completions"), body=job.get("body"),
                            api_key=self.api_key)

    async def run(self, jobs: Iterable[Job] | AsyncIterable[Job]) -> AsyncIterator[BatchResponse]:
        """Send the jobs and yield each one's BatchResponse as it arrives (completion order).

        Each job is a BatchRequest or a dict in the OpenAI batch input shape: {"custom_id", "url", "body"}
        (custom_id defaults to the job's index, url to /v1/completions; "method" is ignored).

        Raises:
            ValueError: a job's id is the id of one still unanswered.
            BatchServerGone: the server was silent for `server_timeout` seconds.
        """
        if self._channel is None:
            self._channel = AsyncChannel(self._ctx, zmq.DEALER, self.endpoint, bind=False,
                                         recv_type=BatchServerMessage)
        channel = self._channel
        beat = asyncio.create_task(self._beat(channel))
        source = _aiter(jobs)
        outstanding: dict[str, BatchRequest] = {}
        retries: list[tuple[float, int, BatchRequest]] = []
        order = itertools.count()
        exhausted = False
        last_heard = time.monotonic()
        instance = ""  # the server's, from its heartbeats
        shut_out: set[str] = set()  # jobs a shutting-down server refused: outstanding, sent to its next instance
        try:
            while True:
                now = time.monotonic()
                while retries and retries[0][0] <= now:
                    await channel.send(heapq.heappop(retries)[2])
                while not exhausted and len(outstanding) < self.max_in_flight:
                    try:
                        job = self._job(await anext(source), next(order))
                    except StopAsyncIteration:
                        exhausted = True
                        break
                    if job.job_id in outstanding:
                        raise ValueError(f"job id {job.job_id!r} is already in flight")
                    refusal = self._unsendable(job)
                    if refusal is not None:
                        yield refusal
                        continue
                    outstanding[job.job_id] = job
                    await channel.send(job)
                if not outstanding:
                    return
                wait = self.server_timeout - (now - last_heard)
                if retries:
                    wait = min(wait, retries[0][0] - now)
                try:
                    message = await asyncio.wait_for(channel.recv(), max(wait, 0.001))
                except TimeoutError:
                    if time.monotonic() - last_heard >= self.server_timeout:
                        held = len(shut_out & outstanding.keys())
                        refused = f", {held} of them refused as it shut down" if held else ""
                        raise BatchServerGone(
                            f"the shuttle batch endpoint {self.endpoint} sent nothing for {self.server_timeout:g} s "
                            f"(stopped or unreachable); {len(outstanding)} job(s) unanswered{refused}") from None
                    continue
                if message is None:
                    continue  # malformed (counted and logged by the channel): not a sign of a live server
                last_heard = time.monotonic()
                if isinstance(message, BatchHeartbeat):
                    if instance and message.instance != instance:  # a restarted server lost what it held
                        self.num_resent += await self._resend(channel, outstanding, retries)
                        shut_out.clear()
                    instance = message.instance
                    continue
                if message.job_id not in outstanding or _refused_as_running(message):
                    continue  # a resent job that had reached the new server after all: the first copy answers
                if message.status_code == 503 and not message.should_retry:
                    shut_out.add(message.job_id)  # shutting down: held for the next instance, not retried here
                    continue
                if message.status_code == 503:  # queue full, restarting: come back when told
                    self.num_retried += 1
                    due = last_heard + max(message.retry_after, MIN_RETRY_S)
                    heapq.heappush(retries, (due, next(order), outstanding[message.job_id]))
                    continue
                del outstanding[message.job_id]
                yield message
        finally:
            beat.cancel()

    def _unsendable(self, job: BatchRequest) -> BatchResponse | None:
        """The 400 for a job the server could not read (too large, nested too deep), or None: send it."""
        payload = msgspec.msgpack.encode(job)
        if len(payload) > self.max_message_bytes:
            why = (f"is {len(payload)} bytes encoded, over the server's {self.max_message_bytes} "
                   f"(--max-batch-message-bytes)")
        elif nesting_exceeds(payload, BATCH_MAX_DEPTH):
            why = f"nests deeper than the {BATCH_MAX_DEPTH} levels the server reads"
        else:
            return None
        message = f"job {job.job_id!r} {why}; not sent"
        return BatchResponse(job_id=job.job_id, status_code=400, body={"error": {
            "message": message, "type": "invalid_request_error", "param": "body", "code": 400}})

    @staticmethod
    async def _resend(channel: AsyncChannel, outstanding: dict[str, BatchRequest],
                      retries: list[tuple[float, int, BatchRequest]]) -> int:
        waiting_retry = {job.job_id for _, _, job in retries}
        resend = [job for job_id, job in outstanding.items() if job_id not in waiting_retry]
        for job in resend:
            await channel.send(job)
        return len(resend)

    async def _beat(self, channel: AsyncChannel) -> None:
        ping = BatchPing()
        while True:
            try:
                await channel.send(ping)
            except zmq.ZMQError:
                return  # closed under us
            await asyncio.sleep(self.heartbeat)

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._ctx.term()

    async def __aenter__(self) -> "AsyncBatchClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()


class BatchClient:
    """The synchronous BatchClient: AsyncBatchClient in a thread of its own, so its heartbeats keep going however
    long the caller takes over each result. Arguments as AsyncBatchClient."""

    def __init__(self, endpoint: str, max_in_flight: int = 64, api_key: str | None = None,
                 server_timeout: float = SERVER_TIMEOUT_S,
                 max_message_bytes: int = OpsConfig().max_batch_message_bytes):
        self.endpoint = endpoint
        self.max_in_flight = max_in_flight
        self.api_key = api_key
        self.server_timeout = server_timeout
        self.max_message_bytes = max_message_bytes

    def run(self, jobs: Iterable[Job]) -> Iterator[BatchResponse]:
        """Yield each job's BatchResponse as it arrives (see AsyncBatchClient.run; the same errors are raised
        here). Leaving the loop early stops sending and closes the connection."""
        results: queue.Queue = queue.Queue()
        done = object()
        started = threading.Event()
        holder: dict[str, Any] = {}

        async def pump() -> None:
            holder["task"] = asyncio.current_task()
            holder["loop"] = asyncio.get_running_loop()
            started.set()
            client = AsyncBatchClient(self.endpoint, self.max_in_flight, self.api_key, self.server_timeout,
                                      max_message_bytes=self.max_message_bytes)
            try:
                async for response in client.run(jobs):
                    results.put(response)
            except BaseException as exc:  # handed to the caller's thread, which raises it
                results.put(exc)
            finally:
                client.close()
                results.put(done)

        thread = threading.Thread(target=asyncio.run, args=(pump(),), name="batch-client", daemon=True)
        thread.start()
        started.wait()
        try:
            while (item := results.get()) is not done:
                if isinstance(item, BaseException):
                    if isinstance(item, asyncio.CancelledError):
                        continue
                    raise item
                yield item
        finally:
            if thread.is_alive():
                try:
                    holder["loop"].call_soon_threadsafe(holder["task"].cancel)
                except RuntimeError:  # the loop closed between the check and the call: the pump has ended
                    pass
            thread.join()

    def close(self) -> None:
        """Nothing to release between runs (each run has its own connection); kept for `with`."""

    def __enter__(self) -> "BatchClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refused_as_running(response: BatchResponse) -> bool:
    """The server's refusal of a job id it is still running. This client never sends such a job on purpose (run
    raises ValueError first), so it is a resend's echo and the running copy's answer is still to come."""
    body = response.body
    return (response.status_code == 400 and isinstance(body, dict)
            and (body.get("error") or {}).get("param") == "job_id")


async def _aiter(jobs: Iterable[Job] | AsyncIterable[Job]) -> AsyncIterator[Job]:
    if isinstance(jobs, AsyncIterable):
        async for job in jobs:
            yield job
    else:
        for job in jobs:
            yield job
