"""The frontend's link to one serving group's scheduler: submit, one listener fanning outputs to per-request
queues, abort.

It also carries the frontend's side of supervision: while the engine is down (the launcher said so)
`generate` refuses at once with a 503 and the expected restart time as Retry-After, while the server drains with
a 503 and no promise (it is going away: frontend/engine/backpressure.py); when the engine goes down every
in-flight request gets one terminal error and the link starts over with a fresh socket, which is up again as
soon as the new scheduler answers its Hello.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import os
import time
from typing import AsyncGenerator

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shuttle.common.errors import GenerationError
from shuttle.common.ipc import CURVE_ENV, AsyncChannel
from shuttle.common.messages import (
    Abort,
    FinishReason,
    Heartbeat,
    Hello,
    RequestOutput,
    SchedulerInfo,
    SchedulerMessage,
    SchedulerStats,
    StepOutputs,
    Submit,
)
from shuttle.frontend.engine.api import GroupState
from shuttle.frontend.engine.backpressure import RestartClock, RetryAfterEstimator
from shuttle.frontend.observability.stat_totals import StatTotals

log = logging.getLogger("shuttle.frontend")

HEARTBEAT_INTERVAL_S = 1.0  # the scheduler takes a frontend silent for 10 s as gone (scheduler/liveness.py)
REMOTE_RESTART_GUESS_S = 10.0  # a remote group away for the first time: about one engine start-up on a CPU
GROUP_DRAINING = "its shuttle engine is shutting down (draining)"  # down_reason while a remote group drains
# what a socket monitor reports when a peer refuses the connection's CURVE handshake (wrong server key: no detail;
# wrong client key: auth)
HANDSHAKE_FAILURES = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                      | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
# Handshakes failed in a row before the keys are blamed. "No detail" is also what a connection cut mid-handshake
# gives (a scheduler killed or restarting as the socket reconnects): once is a cut, while other keys fail every one of
# libzmq's retries (ten a second). A refusal of this frontend's key (auth) is the keys' at once.
KEY_FAILURES_IN_A_ROW = 3
REMOTE_SILENCE_S = 30.0  # --heartbeat-timeout's default: a remote group silent to ZeroMQ's heartbeat this long is lost


def lost_connection_reason(endpoint: str, silence_timeout: float) -> str:
    """A remote group's down_reason once its connection dropped: closed by its host, or dropped by libzmq after
    `silence_timeout` seconds without an answer to heartbeats (the host stopped, or the network between)."""
    return f"lost the connection to {endpoint} (closed, or no answer to heartbeats for {silence_timeout:g} s)"


class ServingGroup(abc.ABC):
    """One serving group's standing as the frontend sees it, and what it tells a new request: up or down (and
    why), its latest stats, its sequences in flight and their failure at once. Implements frontend.engine_api.Engine
    for the group alone; a subclass carries the requests (EngineClient over its socket; tests/fake_engine.py's
    FakeEngine over a script), keeping each in-flight sequence's queue in `_queues`, which fail_all reaches.

    Attributes:
        info: the scheduler's cache geometry (from its answer to Hello).
        stats: the scheduler's latest stats, its counters totals over every scheduler the group has had
            (frontend/observability/stat_totals.py).
        down_reason: why the group is down, or None while it serves.
        draining: set by the shutdown drain; new requests are refused.
        times_down: failures seen since the frontend started. routed: sequences the router sent here.
    """

    def __init__(self, endpoint: str, max_model_len: int | None = None, lora: bool | None = None):
        self._endpoint = endpoint
        # the frontend's: a group must take every request the frontend admits (None: not checked)
        self._max_model_len = max_model_len
        self._lora = lora
        self.info: SchedulerInfo | None = None
        self.stats = SchedulerStats()
        self._totals = StatTotals()
        self.on_stats = None  # called with every SchedulerStats message (the metrics' per-step histograms)
        self.down_reason: str | None = None
        # why down_reason is a misconfiguration no retry helps: "config" (another max_model_len, LoRA or not), "keys"
        # (the CURVE handshake fails); "" when it is not one
        self._kept_out = ""
        self.draining = False
        self.times_down = 0
        self.routed = 0
        self._up = asyncio.Event()
        self._restart = RestartClock()
        self._retry_after = RetryAfterEstimator()
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}  # in flight: where failures are delivered

    @abc.abstractmethod
    def generate(self, request: Submit) -> AsyncGenerator[RequestOutput, None]:
        """frontend.engine_api.Engine.generate, for this group: refused at once while admission_error() says so."""

    @abc.abstractmethod
    async def start(self, timeout: float = 120.0, wait: bool = True) -> SchedulerInfo | None:
        """Reach the scheduler; `wait`: until it has answered (within `timeout` seconds, else TimeoutError)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop talking to the scheduler."""

    async def wait_up(self) -> None:
        """Return once the scheduler has answered Hello."""
        await self._up.wait()

    @property
    def is_up(self) -> bool:
        """The group takes new work: its scheduler answered, and no failure was reported since."""
        return self.down_reason is None and self._up.is_set()

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def group_state(self, group: int = 0) -> GroupState:
        return GroupState(group, self._endpoint, self.is_up, self.down_reason if not self.is_up else None,
                          self.num_in_flight, self.times_down, self.routed, self.stats)

    def group_states(self) -> list[GroupState]:
        """The one serving group (a Router lists several)."""
        return [self.group_state()]

    def admission_error(self) -> GenerationError | None:
        """The 503 a new request gets now, or None: admit. Draining: no Retry-After (the server is going away);
        engine down: the time until it is expected back (frontend/engine/backpressure.py's RestartClock)."""
        if self.draining:
            return GenerationError(503, "the server is shutting down", retry_after=None)
        if self.down_reason is None and not self._up.is_set():  # never joined yet: nothing is restarting
            return GenerationError(503, f"the engine at {self._endpoint} has not joined yet (its scheduler has not "
                                   "answered); retry shortly", retry_after=self._restart.retry_after(time.monotonic()))
        if self._kept_out:  # no time to promise: it serves once an operator restarts it to match
            return GenerationError(503, f"the engine at {self._endpoint} is kept out: {self.down_reason}",
                                   retry_after=None)
        if self.down_reason is not None:
            return GenerationError(503, f"the engine is restarting ({self.down_reason}); retry shortly",
                                   retry_after=self._restart.retry_after(time.monotonic()))
        return None

    def refusal_retry_after(self) -> float | None:
        """Seconds a client whose request ended with a 503 should wait: until the engine is back, or else (a full
        waiting queue) its place in frontend/engine/backpressure.py's line of promises; None while draining."""
        error = self.admission_error()
        if error is not None:
            return error.retry_after
        return self._retry_after.refused(time.monotonic())

    def fail_all(self, status: int, message: str) -> None:
        """End every in-flight request with an error output (the engine is going away), so each client gets a
        terminal answer instead of a dropped connection."""
        for request_id, queue in self._queues.items():
            queue.put_nowait(error_output(request_id, status, message))

    def engine_down(self, reason: str, retry_after: float, group: int = 0, restarting: bool = True) -> None:
        """The launcher says the engine stopped (a lone group is group 0; another number is not this one): fail
        what is in flight and refuse new requests until a new scheduler answers (`restarting` False: none will,
        the launcher stops)."""
        if group != 0:
            return
        log.warning("the engine at %s stopped (%s); failing %d in-flight request(s), %s", self._endpoint, reason,
                    len(self._queues), f"restart expected in {retry_after:.1f} s" if restarting else "no restart")
        self.down_reason = reason
        self.times_down += 1
        self._restart.down(time.monotonic(), retry_after)
        self._up.clear()
        self.stats = self._totals.restarted()  # its queues are gone; its counts stay in the totals
        self.fail_all(503, f"the engine stopped ({reason}); " + (
            "it is restarting, retry shortly" if restarting else "it will not restart: the server is stopping"))

    def _serving(self, info: SchedulerInfo) -> None:
        """A scheduler answered Hello with its cache geometry: the group takes work (again). Unless it drains (its
        `shuttle engine` is stopping): then it takes none, and what it runs finishes."""
        self.info = info
        reason = None
        if self._max_model_len is not None and info.max_model_len != self._max_model_len:
            reason = (f"its max_model_len {info.max_model_len} differs from this frontend's {self._max_model_len} "
                      f"(start both with the same --max-model-len)")
        elif self._lora is not None and info.lora != self._lora:
            reason = (f"it {'serves' if info.lora else 'does not serve'} LoRA adapters and this frontend "
                      f"{'does' if self._lora else 'does not'} (start both with or without --enable-lora)")
        if reason is not None:
            if self.down_reason != reason:
                log.error("the engine at %s is not used: %s", self._endpoint, reason)
                self.down_reason, self._kept_out = reason, "config"
                self._up.clear()
            return
        self._kept_out = ""
        if info.draining:
            if self.down_reason != GROUP_DRAINING:
                log.info("the engine at %s is draining: no new requests go there; its %d in flight finish",
                         self._endpoint, len(self._queues))
                self.down_reason = GROUP_DRAINING
                self._restart.down(time.monotonic(), self._restart.last_restart_s or REMOTE_RESTART_GUESS_S)
                self._up.clear()
            return
        if self.down_reason is not None:
            self._restart.up(time.monotonic())
            log.info("the engine at %s is serving again (%.1f s after it stopped)", self._endpoint,
                     self._restart.last_restart_s)
        self.down_reason = None
        self._up.set()

    def _on_stats(self, stats: SchedulerStats) -> None:
        stats = self.stats = self._totals.add(stats)
        self._retry_after.observe(time.monotonic(), stats.num_admitted, stats.num_waiting, stats.num_running,
                                  stats.num_preemptions)
        if self.on_stats is not None:
            self.on_stats(stats)


def error_output(request_id: str, status: int, message: str) -> RequestOutput:
    return RequestOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error_status=status,
                         error_message=message)


class EngineClient(ServingGroup):
    """One serving group over one DEALER socket to its scheduler: submit, one listener task putting each output on
    its request's queue, abort when the consumer leaves early (client gone, cancel, stop string).

    Every request yields RequestOutputs until exactly one carries a finish_reason.

    Args:
        endpoint: the scheduler's ROUTER (ipc:// for the launcher's own groups, tcp:// for a remote one).
        curve: authenticate a tcp:// endpoint with the launch's CURVE keys.
        remote: another host's `shuttle engine` (no launcher here reports its failures): the group is down when
            its connection drops or stays silent.
        silence_timeout: seconds a remote group's connection may leave ZeroMQ's heartbeat unanswered before it is
            taken as lost (--heartbeat-timeout; common/ipc.py's peer_timeout; 0: only a dropped connection).
        max_model_len, lora: the frontend's --max-model-len and --enable-lora; a group that answers with others is
            kept out (ServingGroup._serving).
    """

    def __init__(self, endpoint: str, curve: bool = False, remote: bool = False,
                 silence_timeout: float = REMOTE_SILENCE_S, max_model_len: int | None = None,
                 lora: bool | None = None):
        super().__init__(endpoint, max_model_len, lora)
        self._curve = curve
        # A remote group (another host's `shuttle engine`) has no launcher here to say it died: a dropped
        # connection on the socket monitor says it instead, and so does a connection that stays open but answers
        # nothing (a stopped host, a partition): see _connect.
        self._remote = remote
        self._silence_timeout = silence_timeout
        self._monitor: asyncio.Task | None = None
        self._channel: AsyncChannel[SchedulerMessage] = self._connect()
        self._listener: asyncio.Task | None = None
        self._heartbeat: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._last_hello = 0.0  # when a Hello was last queued for a reconnection (monotonic seconds)

    def _connect(self) -> AsyncChannel[SchedulerMessage]:
        channel: AsyncChannel[SchedulerMessage] = AsyncChannel(
            zmq.asyncio.Context.instance(), zmq.DEALER, self._endpoint, bind=False, recv_type=SchedulerMessage,
            curve=self._curve, peer_timeout=self._silence_timeout if self._remote else 0.0)
        if self._remote:
            monitor = channel.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILURES
                                                        | zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._monitor = asyncio.get_running_loop().create_task(self._watch(channel, monitor),
                                                                   name="engine-client-monitor")
        return channel

    async def _watch(self, channel: AsyncChannel, monitor) -> None:
        """A remote group's connection dropped (its scheduler died, or the network), or answered no heartbeat for
        `silence_timeout` seconds (libzmq then drops it): the group is down."""
        failures = 0  # handshakes failed since the last one that succeeded
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if channel is not self._channel:
                    return
                if event & zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    failures = 0
                    continue
                if event & HANDSHAKE_FAILURES:  # the connection is refused before a word: say why, once
                    failures += 1
                    if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH or failures >= KEY_FAILURES_IN_A_ROW:
                        self._handshake_failed()
                    continue
                if self.is_up or self.down_reason == GROUP_DRAINING:
                    break
                if self._kept_out == "config":  # the misconfigured group went away: say so, not its old config
                    self.down_reason, self._kept_out = lost_connection_reason(self._endpoint, self._silence_timeout), ""
                # Not serving (down already, not yet joined, or kept out): nothing new to report. libzmq reconnects
                # this socket itself; a Hello queued for the next connection gets the group's answer then (one that
                # was in flight on the lost connection may be gone with it). At most one a second: a peer that
                # refuses every handshake is retried by libzmq ten times a second.
                if time.monotonic() - self._last_hello >= HEARTBEAT_INTERVAL_S:
                    self._last_hello = time.monotonic()
                    self._spawn(channel.send(Hello()))
        finally:
            monitor.close(linger=0)
        # no launcher here to estimate its restart: the last one measured, if any
        self.engine_down(lost_connection_reason(self._endpoint, self._silence_timeout),
                         self._restart.last_restart_s or REMOTE_RESTART_GUESS_S)

    def _handshake_failed(self) -> None:
        reason = (f"the handshake with {self._endpoint} failed: it does not take this frontend's CURVE keys "
                  f"(${CURVE_ENV} must hold the same keys on both hosts)")
        if self.down_reason != reason and not self.is_up:
            log.error("the engine at %s is not reached: %s", self._endpoint, reason)
            self.down_reason, self._kept_out = reason, "keys"

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

    async def _listen(self, channel: AsyncChannel[SchedulerMessage]) -> None:
        """Deliver every scheduler message. A message that cannot be taken (a stats hook that raised) is logged and
        skipped: were this task to end, every request in flight and to come would wait forever."""
        while True:
            msg = await channel.recv()
            try:
                self._take(msg)
            except Exception:
                log.exception("could not take a %s from the scheduler; skipped", type(msg).__name__)

    def _take(self, msg: SchedulerMessage | None) -> None:
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
            self._serving(msg)

    async def _beat(self) -> None:
        """Tell the scheduler this frontend is alive; a silent one is taken as gone and its requests aborted."""
        message = Heartbeat(name="frontend", pid=os.getpid())
        while True:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            if self._remote and not self.is_up and self.down_reason != GROUP_DRAINING:
                # Nothing of ours runs there (not joined, lost, or kept out), and an unreachable group's socket would
                # queue every beat (its queues are unbounded) to deliver them all stale on reconnection; it learns
                # of this frontend again from the Hello that rejoins it.
                continue
            try:
                await self._channel.send(message)
            except zmq.ZMQError:
                pass  # the socket was swapped under us (engine restart): the next beat uses the new one

    async def generate(self, request: Submit) -> AsyncGenerator[RequestOutput, None]:
        """Submit `request` and yield its outputs; the last one has a finish_reason.

        Raises:
            GenerationError: 503 at once while the server drains or the engine is down.
        """
        error = self.admission_error()
        if error is not None:
            raise error
        request_id = request.request_id
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[request_id] = queue
        channel = self._channel
        finished = False
        try:
            try:
                await channel.send(request)
            except zmq.ZMQError:  # the engine went down while this was being sent
                if queue.empty():
                    queue.put_nowait(error_output(request_id, 503, "the engine stopped; retry shortly"))
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            del self._queues[request_id]
            if not finished and channel is self._channel:
                self._spawn(channel.send(Abort(request_ids=[request_id])))  # safe from a cancelled task

    def engine_down(self, reason: str, retry_after: float, group: int = 0, restarting: bool = True) -> None:
        """ServingGroup.engine_down, then reconnect on a fresh socket (nothing queued for the dead one is replayed);
        the group is up again as soon as the new scheduler answers its Hello."""
        if group != 0:
            return
        super().engine_down(reason, retry_after, restarting=restarting)
        if self._listener is not None:
            self._listener.cancel()
        self._close_channel()
        self._channel = self._connect()
        self._listener = asyncio.create_task(self._listen(self._channel), name="engine-client-listener")
        self._spawn(self._channel.send(Hello()))

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
