"""The scheduler's busy loop: drain inbox, schedule, send plan, receive result, update, publish."""

from __future__ import annotations

import logging
import time

import msgspec
import zmq

from common.config import ShuttleConfig
from common.ipc import Channel
from common.messages import (
    Abort, FrontendMessage, Hello, SchedulerInfo, StepOutputs, StepResult, Submit, WorkerFailed, WorkerMessage,
    WorkerReady,
)
from common.process import HeartbeatSender
from scheduler.kv_cache import KVCacheManager
from scheduler.liveness import FrontendWatch, StepWatchdog
from scheduler.scheduler import ScheduledStep, Scheduler
from scheduler.stats import StepStats

log = logging.getLogger("shuttle.scheduler")

IDLE_POLL_MS = 100  # how long an idle scheduler sleeps on its inbox before re-checking
STATS_INTERVAL_S = 0.5  # stats go out at least this often while anything changes, and after every step


class SchedulerLoop:
    """Connects the Scheduler to its sockets. Construct, then `run()` until Shutdown or a signal."""

    def __init__(self, config: ShuttleConfig, ctx: zmq.Context):
        self.config = config
        curve = config.ipc.curve
        self.frontends: Channel[FrontendMessage] = Channel(ctx, zmq.ROUTER, config.ipc.requests, bind=True,
                                                           recv_type=FrontendMessage, curve=curve)
        self.plans = Channel(ctx, zmq.PUSH, config.ipc.plans, bind=True, curve=curve)
        self.results: Channel[WorkerMessage] = Channel(ctx, zmq.PULL, config.ipc.results, bind=True,
                                                       recv_type=WorkerMessage, curve=curve)
        self.clients: set[bytes] = set()
        self.scheduler: Scheduler | None = None
        self.worker: WorkerReady | None = None
        self._last_stats = None
        self._last_stats_time = 0.0
        self.step_stats = StepStats()
        # Issue 9 liveness: heartbeats to the launcher from this loop, the worker's step watchdog, and
        # frontends that stop heartbeating (their requests are aborted, freeing their blocks).
        self.heartbeat = HeartbeatSender(config, "scheduler")
        self.watchdog = StepWatchdog(config.ops.step_timeout)
        self.frontend_watch = FrontendWatch()

    def wait_for_worker(self) -> WorkerReady:
        """Block until the worker reports its KV capacity, then build the scheduler around it."""
        msg = self.results.recv()
        if not isinstance(msg, WorkerReady):
            raise RuntimeError(f"expected WorkerReady from the worker, got {type(msg).__name__}")
        self.worker = msg
        cache = self.config.cache
        kv = KVCacheManager(msg.num_kv_blocks, cache.block_size, cache.enable_prefix_caching)
        model = self.config.model
        self.scheduler = Scheduler(self.config.scheduler, kv, model.max_model_len, model.eos_token_ids)
        return msg

    def run(self) -> None:
        assert self.scheduler is not None, "wait_for_worker() first"
        while True:
            self.heartbeat.beat()  # issue 9 hook: proves this loop turns
            self._reap_gone_frontends()  # issue 9 hook
            self._drain_inbox(0 if self.scheduler.has_work else IDLE_POLL_MS)
            self.scheduler.expire(time.time())
            if self.scheduler.has_work and not self._step():
                self._drain_inbox(IDLE_POLL_MS)  # nothing fits this step: wait for a change, don't spin
            self._publish()

    def _step(self) -> bool:
        """Run one step; False when the plan was empty and nothing was sent."""
        step = self.scheduler.schedule()
        if not step.num_scheduled and not step.plan.finished_ids and not step.plan.preempted_ids:
            return False
        self.plans.send(step.plan)
        self.watchdog.sent(step.plan.step_id)  # issue 9 hook: the step watchdog starts timing this step
        self.step_stats.on_plan(step.plan)  # issue 9 hook: admissions, for the frontend's Retry-After
        result = self._wait_for_result(step)
        if isinstance(result, WorkerFailed):
            log.error("worker failed step %d: %s", result.step_id, result.message)
            self.scheduler.fail(list(step.num_scheduled), 500, f"model execution failed: {result.message}")
        else:
            self.scheduler.update_from_output(step, result)
            self.step_stats.on_step(len(step.num_scheduled), sum(step.num_scheduled.values()),
                                    step.num_prompt_tokens, len(result.token_ids))
        return True

    def _wait_for_result(self, step: ScheduledStep) -> StepResult | WorkerFailed:
        """Wait for the step's result while still taking in Submits and Aborts.

        Raises:
            WorkerHung: no result within --step-timeout (scheduler/__main__.py exits; the launcher restarts).
        """
        poller = zmq.Poller()
        poller.register(self.results.socket, zmq.POLLIN)
        poller.register(self.frontends.socket, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(self.watchdog.poll_ms()))  # issue 9 hook: bounded wait, then check
            self.watchdog.check()
            self.heartbeat.beat()
            if self.frontends.socket in ready:
                self._drain_inbox(0)
            if self.results.socket in ready:
                msg = self.results.recv()
                if isinstance(msg, (StepResult, WorkerFailed)) and msg.step_id == step.plan.step_id:
                    return msg
                log.warning("ignoring unexpected worker message %r", type(msg).__name__)

    def _drain_inbox(self, timeout_ms: int) -> None:
        if not self.frontends.poll(timeout_ms):
            return
        while self.frontends.poll(0):
            client, msg = self.frontends.recv_from()
            self.frontend_watch.seen(client)  # issue 9 hook: any message (Heartbeat included) proves it alive
            if client not in self.clients:
                self.clients.add(client)
            if isinstance(msg, Submit):
                self.scheduler.add_request(client, msg)
            elif isinstance(msg, Abort):
                self.scheduler.abort(msg.request_ids)
            elif isinstance(msg, Hello):
                kv = self.scheduler.kv
                self.frontends.send(SchedulerInfo(kv.pool.num_blocks, kv.block_size, self.scheduler.max_model_len),
                                    identity=client)
                self._last_stats = None  # make sure the newcomer gets stats at once

    def _reap_gone_frontends(self) -> None:
        """Issue 9: a frontend silent past FRONTEND_TIMEOUT_S is gone; abort its requests, stop sending to it."""
        for client in self.frontend_watch.gone():
            self.clients.discard(client)
            aborted = self.scheduler.abort_client(client)
            log.warning("a frontend went silent; aborted its %d request(s) and freed their blocks", len(aborted))

    def _publish(self) -> None:
        for client, outputs in self.scheduler.take_outputs().items():
            self.frontends.send(StepOutputs(outputs), identity=client)
        now = time.monotonic()
        stats = self.scheduler.stats()
        self.step_stats.maybe_log(stats)
        if stats != self._last_stats or now - self._last_stats_time > STATS_INTERVAL_S:
            self._last_stats, self._last_stats_time = stats, now
            message = self.step_stats.attach(msgspec.structs.replace(stats))
            for client in self.clients:
                self.frontends.send(message, identity=client)
