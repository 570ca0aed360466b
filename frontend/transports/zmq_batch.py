"""The frontend's ZeroMQ endpoint for batch jobs: a ROUTER in the same event loop as the HTTP server.

A batch client (batch_jobs/client.py, `shuttle batch`) sends BatchRequest messages, each the body of a
/v1/completions or /v1/chat/completions call addressed by `url`, and receives one BatchResponse per job with the
status code and body that HTTP call would have got (the serving core, frontend/serving.py, does the work).

- Every job gets exactly one response. A message that is not one well-formed BatchRequest (extra frames, bad
  msgpack, a missing or wrongly typed field, nesting deeper than MAX_DEPTH) is answered with status 400 naming the
  field, under the job's id when it can be read, else under ""; it is counted (stats(), the
  shuttle:batch_malformed_messages counter) and warned about at most once per client per minute. A second job with
  the id of one still running from the same client gets 400.
- A frame larger than --max-batch-message-bytes (default: the HTTP body limit) is never buffered: libzmq drops
  that client's connection as soon as the frame's header announces it (no answer can be sent on it).
- With an API key, every job must carry it (else 401 and no work is done).
- Heartbeats both ways: the server sends each client it has heard from within CLIENT_TIMEOUT_S a BatchHeartbeat
  every HEARTBEAT_S; a client silent for CLIENT_TIMEOUT_S (no job, no BatchPing) is taken as gone (killed,
  crashed, cut off) and its running jobs are aborted, freeing their KV blocks.
- Batch jobs run as background work by default: the scheduler ranks them behind every interactive request.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from shuttle.common.ipc import AsyncChannel, MalformedMessage
from shuttle.common.messages import (
    BATCH_MAX_DEPTH,
    BatchClientMessage,
    BatchHeartbeat,
    BatchRequest,
    BatchResponse,
)
from shuttle.frontend.open_call import open_call
from shuttle.frontend.request.errors import client_error, error_body
from shuttle.frontend.state import FrontendState
from shuttle.frontend.web.off_loop import convert

log = logging.getLogger("shuttle.frontend")

HEARTBEAT_S = 1.0  # the server's heartbeat period to each live client
CLIENT_TIMEOUT_S = 3.0  # a client silent this long is gone: its jobs are aborted
MAX_DEPTH = BATCH_MAX_DEPTH
_FIELD = re.compile(r"at `\$\.([A-Za-z_]\w*)`|missing required field `([A-Za-z_]\w*)`")


@dataclass
class _Client:
    """One connected batch client (a ZeroMQ identity): when it was last heard and its running jobs."""

    last_seen: float
    jobs: dict[str, asyncio.Task] = field(default_factory=dict)
    lost: bool = False  # taken as gone for its silence: its jobs were aborted


class BatchEndpoint:
    """Binds `endpoint` (tcp://host:port, tcp://host:* for any port, or ipc://path).

    Args:
        api_key: when set, every job must carry it.
        background: run batch jobs behind interactive requests (the scheduler's background service class).
        client_timeout: seconds of silence after which a client's jobs are aborted.
    """

    def __init__(self, state: FrontendState, endpoint: str, api_key: str | None = None, background: bool = True,
                 client_timeout: float = CLIENT_TIMEOUT_S, heartbeat: float = HEARTBEAT_S):
        self.state = state
        self.channel: AsyncChannel[BatchClientMessage] = AsyncChannel(
            zmq.asyncio.Context.instance(), zmq.ROUTER, endpoint, bind=True, recv_type=BatchClientMessage,
            max_message_bytes=state.config.ops.max_batch_message_bytes, max_depth=MAX_DEPTH)
        self.endpoint = self.channel.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._api_key = api_key.encode() if api_key else None
        self.background = background
        self.client_timeout = client_timeout
        self.heartbeat = heartbeat
        self.clients: dict[bytes, _Client] = {}
        self.num_clients_lost = 0  # clients that went silent with jobs running (their jobs were aborted)
        self.instance = uuid.uuid4().hex  # told in every heartbeat: a client learns of a restart from it
        self._tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        self._spawn(self._watch())
        while True:
            try:
                identity, message = await self.channel.recv_from()
            except MalformedMessage as exc:  # counted and logged (rate-limited) by the channel
                self._heard(exc.identity)
                self.state.metrics.batch_malformed.labels(exc.kind).inc()
                self.state.metrics.on_invalid_request()
                job_id, param = _salvage(exc.payload, str(exc))
                self._spawn(self._answer(exc.identity, _error(job_id, 400, f"malformed message: {exc}", param)))
                continue
            client = self._heard(identity)  # any message (a BatchPing too) proves the client alive
            if isinstance(message, BatchRequest):
                self._start(identity, client, message)

    def _heard(self, identity: bytes) -> _Client:
        client = self.clients.get(identity)
        if client is None:
            client = self.clients[identity] = _Client(time.monotonic())
        client.last_seen = time.monotonic()
        return client

    def _start(self, identity: bytes, client: _Client, job: BatchRequest) -> None:
        if not self._authorized(job):
            self._spawn(self._answer(identity, _error(job.job_id, 401, "invalid or missing API key")))
            return
        if job.job_id in client.jobs:
            self.state.metrics.on_invalid_request()
            self._spawn(self._answer(identity, _error(job.job_id, 400, f"job id {job.job_id!r} is already running",
                                                      "job_id")))
            return
        task = asyncio.create_task(self._run(identity, client, job))
        client.jobs[job.job_id] = task
        task.add_done_callback(lambda done: _release(client, job.job_id, done))

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _answer(self, identity: bytes, message: BatchResponse | BatchHeartbeat) -> None:
        try:
            await self.channel.send(message, identity=identity)
        except zmq.ZMQError as exc:  # the endpoint closed under us (shutdown)
            log.debug("batch message to %r not sent: %s", identity, exc)

    def _authorized(self, job: BatchRequest) -> bool:
        return self._api_key is None or hmac.compare_digest(job.api_key.encode(), self._api_key)

    async def _run(self, identity: bytes, client: _Client, job: BatchRequest) -> None:
        call = None  # once made, errors are answered under its request_id
        try:
            call = await convert(lambda: open_call(self.state, job.url, job.body, self.background), None)
            response = BatchResponse(job_id=job.job_id, status_code=200, body=await call.collect(),
                                     request_id=call.request_id)
        except asyncio.CancelledError:
            if not client.lost:
                return  # the server closes: the generations were aborted, and nobody waits on this socket any more
            # Still answered, in case the client was only slow (not dead): it gets a terminal error, not silence.
            response = _error(job.job_id, 408, f"job aborted: the batch client was silent for more than "
                                               f"{self.client_timeout:g} s (it must send a BatchPing every second)",
                              request_id=call.request_id if call else "")
        except Exception as exc:
            known = client_error(exc)
            self.state.metrics.on_client_error(exc)
            if known is None:
                log.exception("batch job %s failed", job.job_id)
            status, param = known or (500, None)
            response = _error(job.job_id, status, str(exc) if known else "internal server error", param,
                              getattr(exc, "retry_after", None) or 0.0, call.request_id if call else "",
                              should_retry=not (status == 503 and self.state.engine.draining))
        # the id is free before the answer goes out: a 503's retry may come back before this task ends, and
        # refused as "already running" it would never be answered (the client waits for the running copy's answer)
        _release(client, job.job_id, asyncio.current_task())
        await self._answer(identity, response)

    async def _watch(self) -> None:
        """Every heartbeat period: a heartbeat to each live client; clients silent too long are dropped and their
        jobs aborted (cancelling a job's task closes its generations, which sends Abort to the scheduler). Nobody is
        taken as silent while messages wait unread: a busy event loop (thousands of jobs arriving) reads them late,
        and a client's ping may be among them."""
        beat = BatchHeartbeat(instance=self.instance)
        while True:
            await asyncio.sleep(self.heartbeat)
            now = time.monotonic()
            behind = self.channel.has_unread()
            for identity, client in list(self.clients.items()):
                if now - client.last_seen <= self.client_timeout or behind:
                    await self._answer(identity, beat)
                    continue
                del self.clients[identity]
                client.lost = True
                if client.jobs:
                    self.num_clients_lost += 1
                    log.info("batch client %r silent for %.1f s; aborting its %d running job(s)", identity,
                             now - client.last_seen, len(client.jobs))
                    for task in list(client.jobs.values()):
                        task.cancel()

    def stats(self) -> dict:
        """For /health: live clients, their running jobs, clients taken as gone with jobs running, and messages
        refused as malformed."""
        return {"clients": len(self.clients), "jobs_in_flight": sum(len(c.jobs) for c in self.clients.values()),
                "clients_lost": self.num_clients_lost, "malformed_messages": self.channel.num_malformed}

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for client in self.clients.values():
            for task in client.jobs.values():
                task.cancel()
        self.channel.close()


def _release(client: _Client, job_id: str, task: asyncio.Task | None) -> None:
    """Forget `job_id` as running, if `task` is what runs under it (not a later job of the same id)."""
    if client.jobs.get(job_id) is task:
        del client.jobs[job_id]


def _error(job_id: str, status: int, message: str, param: str | None = None, retry_after: float = 0.0,
           request_id: str = "", should_retry: bool = True) -> BatchResponse:
    return BatchResponse(job_id=job_id, status_code=status, body=error_body(status, message, param),
                         request_id=request_id, retry_after=retry_after, should_retry=should_retry)


class _JobId(msgspec.Struct):
    """All _salvage reads of a message: its job id, whatever else it holds (other fields are skipped)."""

    job_id: str = ""


_JOB_ID = msgspec.msgpack.Decoder(_JobId)


def _salvage(payload: bytes | None, reason: str) -> tuple[str, str | None]:
    """The job id (or "") and the field at fault (or None) of a message that did not decode as a BatchRequest.
    `payload` is None unless the channel's size and depth checks passed, so this second decoding is bounded too."""
    match = _FIELD.search(reason)
    param = (match.group(1) or match.group(2)) if match else None
    try:
        return (_JOB_ID.decode(payload).job_id if payload is not None else ""), param
    except Exception:  # any failure of these bytes (not a map, job_id not a string, ...): no id to answer under
        return "", param

