"""The scheduler's busy loop: drain inbox, schedule, send plan, receive result, settle, publish.

With overlapped scheduling (the default) up to two plans are in flight: step N+1 is planned and sent while the
worker runs step N, so the worker never waits for the scheduler and the scheduler never waits for the worker
while it could plan. `--no-async-scheduling` keeps one plan in flight (plan, wait, settle) for comparison.
"""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from shuttle.common.config import ShuttleConfig
from shuttle.common.ipc import Channel, MalformedMessage
from shuttle.common.messages import (
    Abort,
    CompileGrammars,
    FrontendMessage,
    GrammarsCompiled,
    Hello,
    SchedulerInfo,
    SchedulerStats,
    StepOutputs,
    StepResult,
    Submit,
    WorkerFailed,
    WorkerMessage,
    WorkerReady,
)
from shuttle.common.process import HeartbeatSender
from shuttle.scheduler.admission import make_admission
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.liveness import FrontendWatch, StepWatchdog, WorkerCpuClocks
from shuttle.scheduler.lora_slots import lora_slots_for
from shuttle.scheduler.pipeline import StepPipeline
from shuttle.scheduler.scheduler import Scheduler
from shuttle.scheduler.stats import StepStats
from shuttle.scheduler.step_log import StepLog

log = logging.getLogger("shuttle.scheduler")

IDLE_POLL_MS = 100  # how long an idle scheduler sleeps on its inbox before re-checking
STATS_INTERVAL_S = 0.5  # stats go out on their own at most this often; otherwise they ride on step outputs


class SchedulerLoop:
    """Connects the Scheduler to its sockets. Construct, then `wait_for_worker()` and `run()`."""

    # built by wait_for_worker() around the group's KV capacity; nothing reads them before
    scheduler: Scheduler
    pipeline: StepPipeline

    def __init__(self, config: ShuttleConfig, ctx: zmq.Context):
        self.config = config
        curve = config.ipc.curve
        self.frontends: Channel[FrontendMessage] = Channel(ctx, zmq.ROUTER, config.ipc.requests, bind=True,
                                                           recv_type=FrontendMessage, curve=curve)
        # One PUSH per worker rank (tensor parallel): every rank must run every plan, in order.
        self.plans: list[Channel[None]] = [Channel(ctx, zmq.PUSH, endpoint, bind=True, curve=curve)  # send-only
                                           for endpoint in config.ipc.all_plans]
        self.results: Channel[WorkerMessage] = Channel(ctx, zmq.PULL, config.ipc.results, bind=True,
                                                       recv_type=WorkerMessage, curve=curve)
        self.clients: set[bytes] = set()
        self.worker: WorkerReady | None = None
        self.step_stats = StepStats()
        self.step_log = StepLog(config.scheduler.step_log) if config.scheduler.step_log else None
        self._last_broadcast: SchedulerStats | None = None
        self._last_broadcast_time = 0.0
        self._poller = zmq.Poller()
        self._poller.register(self.results.socket, zmq.POLLIN)
        self._poller.register(self.frontends.socket, zmq.POLLIN)
        # Liveness: heartbeats to the launcher from this loop, the worker's step watchdog, and frontends that stop
        # heartbeating (their requests are aborted, freeing their blocks).
        self.heartbeat = HeartbeatSender(config, "scheduler")
        self.watchdog = StepWatchdog(config.ops.step_timeout)
        self.frontend_watch = FrontendWatch()
        # A `shuttle engine` drains on DRAIN_SIGNAL (scheduler/__main__.py sets drain_requested from its handler):
        # new requests are refused, the frontends told to route around this group, the rest finish, run() returns.
        self.drain_requested = False
        self.draining = False

    def wait_for_worker(self) -> WorkerReady:
        """Block until every worker rank reports its KV capacity, then build the scheduler around the group's.

        The group's capacity is the smallest of its ranks' (a block id must exist on every rank). Returns rank 0's
        report with that block count (its bytes per token and weight bytes are one rank's).
        """
        ready: dict[int, WorkerReady] = {}
        while len(ready) < len(self.plans):
            msg = self.results.recv()
            if msg is None:
                continue  # malformed: counted and logged by the channel
            if not isinstance(msg, WorkerReady):
                raise RuntimeError(f"expected WorkerReady from the worker, got {type(msg).__name__}")
            ready[msg.rank] = msg
        num_blocks = min(r.num_kv_blocks for r in ready.values())
        if len(ready) > 1:
            log.info("tensor parallel: %d ranks report %s KV blocks; the group uses %d", len(ready),
                     [ready[r].num_kv_blocks for r in sorted(ready)], num_blocks)
        msg = msgspec.structs.replace(ready[0], num_kv_blocks=num_blocks)
        self.worker = msg
        # slow is not hung: the watchdog reads the ranks' CPU time (scheduler/liveness.py)
        processes = [(ready[r].boot_id, ready[r].pid) for r in sorted(ready)]
        self.watchdog = StepWatchdog(self.config.ops.step_timeout, work=WorkerCpuClocks(processes))
        cache = self.config.cache
        kv = KVCacheManager(msg.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
        model = self.config.model
        config = self.config.scheduler
        self.scheduler = Scheduler(config, kv, model.max_model_len, model.eos_token_ids,
                                   make_admission(config.ttft_slo_ms, config.step_cost_profile),
                                   lora_slots_for(self.config.lora))
        self.pipeline = StepPipeline(self.scheduler, max_in_flight=2 if config.async_scheduling else 1)
        return msg

    def run(self) -> None:
        """Serve until drained (see drain_requested); returns then, every request ended and answered."""
        assert hasattr(self, "pipeline"), "wait_for_worker() first"
        scheduler, pipeline = self.scheduler, self.pipeline
        while True:
            self.heartbeat.beat()  # proves this loop turns
            if self.drain_requested and not self.draining:
                self._start_draining()
            idle = not pipeline.in_flight and not scheduler.has_work
            self._drain_inbox(IDLE_POLL_MS if idle else 0)
            self._reap_gone_frontends()  # after reading the inbox: a heartbeat queued there counts
            scheduler.expire(time.time())
            sent = pipeline.can_plan and self._plan_and_send()
            if pipeline.must_settle(sent):
                self._settle(self._wait_for_result())
            elif not sent and scheduler.has_work:
                self._drain_inbox(IDLE_POLL_MS)  # nothing fits and nothing runs: wait for a change, don't spin
            self._publish()
            if self.draining and not pipeline.in_flight and not scheduler.has_work:
                log.info("drained: every request has ended")
                return

    def _start_draining(self) -> None:
        self.draining = True
        log.info("draining: new requests are refused; %d running and %d waiting finish, then the group stops",
                 len(self.scheduler.running), self.scheduler.num_waiting)
        for client in self.clients:
            self.frontends.send(self._info(), identity=client)

    def _info(self) -> SchedulerInfo:
        kv = self.scheduler.kv
        return SchedulerInfo(num_kv_blocks=kv.pool.num_blocks, block_size=kv.block_size,
                             max_model_len=self.scheduler.max_model_len, draining=self.draining,
                             lora=self.scheduler.lora is not None)

    def _plan_and_send(self) -> bool:
        """Plan one step and send it; False when the plan was empty and nothing was sent."""
        step = self.pipeline.plan()
        if step is None:
            return False
        for plans in self.plans:
            plans.send(step.plan)
        step.sent_at = time.monotonic()
        return True

    def _settle(self, result: StepResult | WorkerFailed) -> None:
        """Settle the oldest step in flight with its result (or fail its requests, when the worker failed it)."""
        if isinstance(result, WorkerFailed):
            log.error("worker failed step %d: %s", result.step_id, result.message)
            self.pipeline.fail_oldest(500, f"model execution failed: {result.message}")
            return
        settled_at = time.monotonic()
        step = self.pipeline.settle(result)
        if self.step_log is not None:
            self.step_log.record(step.scheduled, step.sent_at, settled_at)
        self.step_stats.on_step(len(step.scheduled), step.num_tokens, step.num_prompt_tokens, len(result.token_ids),
                                step.num_decode_tokens)

    def _wait_for_result(self) -> StepResult | WorkerFailed:
        """Wait for the oldest step in flight to return, still taking in Submits and Aborts meanwhile.

        Raises:
            WorkerHung: no result within --step-timeout of sending it (scheduler/__main__.py exits; the launcher
                restarts the engine).
        """
        oldest = self.pipeline.oldest
        expected = oldest.plan.step_id
        self.watchdog.sent(expected, oldest.sent_at)
        while True:
            ready = dict(self._poller.poll(self.watchdog.poll_ms()))  # bounded: the watchdog checks every pass
            self.watchdog.check()
            self.heartbeat.beat()
            if self.frontends.socket in ready:
                self._drain_inbox(0)
            self._reap_gone_frontends()  # on every turn, so that FrontendWatch sees no gap a long step would make
            if self.results.socket in ready:
                msg = self.results.recv()
                if msg is None:
                    continue  # malformed: counted and logged by the channel
                if isinstance(msg, (StepResult, WorkerFailed)) and msg.step_id == expected:
                    return msg
                if isinstance(msg, GrammarsCompiled):
                    self.scheduler.on_grammars_compiled(msg)
                    continue
                log.warning("ignoring unexpected worker message %s", type(msg).__name__)

    def _drain_inbox(self, timeout_ms: int) -> None:
        """Take in what the frontends sent, waiting up to timeout_ms for the first message. With no step in flight
        the worker's grammar answers are taken in too (while steps run, _wait_for_result takes them)."""
        if self.pipeline.in_flight:
            if not self.frontends.poll(timeout_ms):
                return
        else:
            ready = dict(self._poller.poll(timeout_ms))
            if self.results.socket in ready:
                self._take_grammar_answers()
            if self.frontends.socket not in ready:
                return
        while self.frontends.poll(0):
            try:
                client, msg = self.frontends.recv_from()
            except MalformedMessage:
                continue  # counted and logged by the channel; a frontend cannot be answered about it
            self.frontend_watch.seen(client)  # any message (Heartbeat included) proves it alive
            self.clients.add(client)
            if isinstance(msg, Submit):
                if self.draining:  # sent before this frontend heard of the drain
                    self.scheduler.reject(client, msg.request_id, 503, "this serving group is shutting down; retry")
                else:
                    self.scheduler.add_request(client, msg)
            elif isinstance(msg, Abort):
                self.scheduler.abort(msg.request_ids)
            elif isinstance(msg, Hello):
                self.frontends.send(self._info(), identity=client)
                self._last_broadcast = None  # make sure the newcomer gets stats at once
        self._send_grammar_work()

    def _send_grammar_work(self) -> None:
        """Compiles and evictions for rank 0 (it alone samples, so it alone holds grammars), sent before any plan
        that could hold these requests."""
        gate = self.scheduler.grammars
        specs, evict = gate.take_requests(), gate.take_evictions()
        if specs or evict:
            self.plans[0].send(CompileGrammars(specs=specs, evict=evict))

    def _take_grammar_answers(self) -> None:
        while self.results.poll(0):
            msg = self.results.recv()
            if isinstance(msg, GrammarsCompiled):
                self.scheduler.on_grammars_compiled(msg)
            elif msg is not None:
                log.warning("ignoring unexpected worker message %s", type(msg).__name__)

    def _reap_gone_frontends(self) -> None:
        """A frontend silent past FRONTEND_TIMEOUT_S is gone; end its requests (each with a 503 it gets
        if it is alive after all) and stop sending it stats."""
        for client in self.frontend_watch.gone():
            self.clients.discard(client)
            aborted = self.scheduler.abort_client(
                client, f"the scheduler heard nothing from this frontend for {self.frontend_watch.timeout:g} s and "
                        f"ended its requests; retry")
            log.warning("a frontend went silent; ended its %d request(s) and freed their blocks", len(aborted))

    def _publish(self) -> None:
        """Send each frontend its outputs with the stats riding along; stats go out on their own only when they
        changed and nobody got outputs for a while (so an idle engine's /health stays current)."""
        outputs = self.scheduler.take_outputs()
        now = time.monotonic()
        due = self._last_broadcast is None or now - self._last_broadcast_time >= STATS_INTERVAL_S
        if not outputs and not due:
            return
        stats = self.scheduler.stats()
        if not self.config.observability.disable_log_stats:
            self.step_stats.maybe_log(stats)
        with_steps = self.step_stats.attach(stats)  # the per-step lists go to one frontend, once
        for client, client_outputs in outputs.items():
            self.frontends.send(StepOutputs(outputs=client_outputs, stats=with_steps), identity=client)
            with_steps = stats
        if due:
            if stats != self._last_broadcast or with_steps is not stats:
                for client in self.clients:
                    if client not in outputs:
                        self.frontends.send(with_steps, identity=client)
                        with_steps = stats
                self._last_broadcast = stats
            self._last_broadcast_time = now
