"""The live stats feed behind /dashboard: frames of what the frontend already knows, a few times a second.

Sources, all already in the frontend's memory: the scheduler's latest SchedulerStats (riding on step outputs),
the per-step token counts those stats carry, and the frontend's own Prometheus histograms and counters (TTFT,
ITL, tokens, finished requests). Nothing is asked of the scheduler, so it never waits on a watcher.

It costs nothing when nobody watches: with no subscriber the per-stats hook returns at once and no timer runs.
While someone watches, one ticker task takes a snapshot every `tick_s` seconds and hands each subscriber a
JSON frame computed over its own sliding window; a subscriber that reads too slowly loses old frames, never
holds anything up.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

import msgspec

from shuttle.common.config import ShuttleConfig
from shuttle.common.messages import SchedulerStats
from shuttle.frontend.engine.api import Engine
from shuttle.frontend.observability.metrics import Metrics

log = logging.getLogger("shuttle.frontend")

TICK_S = 0.25  # frames per second: 4 (the page must update at least twice a second)
MAX_STEPS = 240  # per-step (prefill, decode) pairs kept between frames; the page shows at most this many bars
MAX_WINDOW_S = 300.0  # longest sliding window a subscriber may ask for (snapshots older than this are dropped)
RATE_WINDOW_S = 2.0  # throughput is averaged over this much of the latest history
QUANTILES = (0.5, 0.9, 0.99)


def histogram_quantile(q: float, bounds: list[float], cumulative: list[float]) -> float | None:
    """The q-quantile (0 < q <= 1) of observations counted in cumulative histogram buckets, interpolated linearly
    inside the bucket it falls in, as Prometheus' `histogram_quantile` does; one in the +Inf bucket is given
    the highest finite bound. `bounds` are the buckets' upper bounds (the last may be inf), `cumulative` the
    counts of observations <= each bound. None when there are no observations."""
    total = cumulative[-1] if cumulative else 0
    if total <= 0:
        return None
    rank = q * total
    i = bisect.bisect_left(cumulative, rank)
    if math.isinf(bounds[i]):
        return bounds[i - 1] if i else None
    lower, below = (bounds[i - 1], cumulative[i - 1]) if i else (0.0, 0.0)
    return lower + (bounds[i] - lower) * (rank - below) / (cumulative[i] - below)


@dataclass(slots=True)
class _Snapshot:
    """Cumulative figures at one instant (time.monotonic() seconds)."""

    time: float
    ttft: list[float]  # cumulative bucket counts of shuttle:time_to_first_token_seconds
    itl: list[float]  # ... of shuttle:inter_token_latency_seconds
    prompt_tokens: float
    generation_tokens: float
    finished: float
    stats: SchedulerStats


@dataclass(eq=False)
class Subscription:
    """One watcher: frames computed over its `window_s`, queued for it to read."""

    window_s: float
    frames: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=4))
    last_step: int = 0  # sequence number of the last step sent
    sent_config: bool = False

    def offer(self, frame: bytes | None) -> None:
        """Queue a frame (None: the feed closed), dropping the oldest one when the reader lags."""
        if self.frames.full():
            self.frames.get_nowait()
        self.frames.put_nowait(frame)

    async def next(self) -> bytes | None:
        """The next frame as JSON bytes; None once the feed has closed."""
        return await self.frames.get()


def _buckets(histogram) -> tuple[list[float], list[float]]:
    """(upper bounds, cumulative counts) of an unlabelled prometheus_client Histogram, through its public collect()
    (a few microseconds a histogram: nothing at a few frames a second)."""
    bounds, counts = [], []
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bounds.append(float(sample.labels["le"]))
                counts.append(sample.value)
    return bounds, counts


def _total(counter) -> float:
    """The total of a prometheus_client Counter over all its labels."""
    return sum(s.value for m in counter.collect() for s in m.samples if s.name.endswith("_total"))


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 3)


class StatsFeed:
    """Fans live dashboard frames out to subscribers.

    Args:
        engine: frontend.engine_api.Engine (its `stats`, `num_in_flight`, `info`, `draining`, `down_reason`).
        metrics: the frontend's Metrics (TTFT/ITL histograms, token and finish counters).
        config: the server's configuration (the flags the page shows).
        tick_s: seconds between frames.
        clock: time source (time.monotonic; tests pass their own).
    """

    def __init__(self, engine: Engine, metrics: Metrics, config: ShuttleConfig, tick_s: float = TICK_S,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.metrics = metrics
        self.config = config
        self.tick_s = tick_s
        self.clock = clock
        self.subscribers: set[Subscription] = set()
        self._steps: deque[tuple[int, float, int, int]] = deque(maxlen=MAX_STEPS)  # (seq, time, prefill, decode)
        self._step_seq = 0
        self._snapshots: deque[_Snapshot] = deque()
        self._ticker: asyncio.Task | None = None
        self._encoder = msgspec.json.Encoder()
        self._bounds = {"ttft": _buckets(metrics.ttft)[0], "itl": _buckets(metrics.itl)[0]}
        self.closed = False

    # ---- inputs -------------------------------------------------------------------------------------------

    def on_stats(self, stats: SchedulerStats) -> None:
        """Engine hook, called with every stats message: keeps the per-step token split while anyone watches."""
        if not self.subscribers or not stats.step_token_counts:
            return
        now = self.clock()
        decodes = stats.step_decode_token_counts
        for i, total in enumerate(stats.step_token_counts):
            decode = decodes[i] if i < len(decodes) else 0
            self._step_seq += 1
            self._steps.append((self._step_seq, now, total - decode, decode))

    def chain(self, previous: Callable[[SchedulerStats], None] | None) -> Callable[[SchedulerStats], None]:
        """An engine `on_stats` hook that calls `previous` (if any), then this feed."""
        if previous is None:
            return self.on_stats

        def both(stats: SchedulerStats) -> None:
            previous(stats)
            self.on_stats(stats)

        return both

    # ---- subscribers --------------------------------------------------------------------------------------

    @asynccontextmanager
    async def subscribe(self, window_s: float) -> AsyncIterator[Subscription]:
        """Watch the feed for the life of the `async with`; the first frame comes at once."""
        subscription = Subscription(min(window_s, MAX_WINDOW_S))
        if self.closed:
            subscription.offer(None)
            yield subscription
            return
        self.subscribers.add(subscription)
        if self._ticker is None:
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="stats-feed")
        elif self._snapshots:
            subscription.offer(self.frame(subscription, self._snapshots[-1]))
        try:
            yield subscription
        finally:
            self.subscribers.discard(subscription)
            if not self.subscribers:
                self._stop()

    def close(self) -> None:
        """End every subscription (server shutdown): each reader gets None."""
        self.closed = True
        for subscription in self.subscribers:
            subscription.offer(None)
        self.subscribers.clear()
        self._stop()

    def _stop(self) -> None:
        """Nobody watches: stop the timer and forget history, so idle costs nothing."""
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
        self._snapshots.clear()
        self._steps.clear()

    async def _tick(self) -> None:
        while self.subscribers:
            try:
                self.publish()
            except Exception:  # a bug here must not silence the page for good: log it, try again next tick
                log.exception("stats feed: making a frame failed")
            await asyncio.sleep(self.tick_s)

    def publish(self) -> None:
        """Take a snapshot and send every subscriber its frame (the ticker calls this every tick_s)."""
        snapshot = self.snapshot()
        self._snapshots.append(snapshot)
        while self._snapshots[0].time < snapshot.time - MAX_WINDOW_S - self.tick_s:
            self._snapshots.popleft()
        for subscription in list(self.subscribers):
            subscription.offer(self.frame(subscription, snapshot))

    # ---- frames -------------------------------------------------------------------------------------------

    def snapshot(self) -> _Snapshot:
        """The cumulative figures now."""
        m = self.metrics
        return _Snapshot(self.clock(), _buckets(m.ttft)[1], _buckets(m.itl)[1], _total(m.prompt_tokens),
                         _total(m.generation_tokens), _total(m.finished), self.engine.stats)

    def _since(self, now: float, seconds: float) -> _Snapshot:
        """The oldest snapshot taken within `seconds` before `now` (the latest one when none is older)."""
        index = bisect.bisect_left(self._snapshots, now - seconds - 1e-9, key=lambda snapshot: snapshot.time)
        return self._snapshots[min(index, len(self._snapshots) - 1)]

    def frame(self, subscription: Subscription, now: _Snapshot) -> bytes:
        """One subscriber's frame as JSON bytes (the keys are documented in frontend/observability/dashboard.py)."""
        stats = now.stats
        start = self._since(now.time, subscription.window_s)
        rate_start = self._since(now.time, RATE_WINDOW_S)
        latency = {}
        for name, current, past in (("ttft", now.ttft, start.ttft), ("itl", now.itl, start.itl)):
            window = [c - p for c, p in zip(current, past)]
            latency[name] = {"count": int(window[-1]) if window else 0,
                             **{f"p{round(q * 100)}": _ms(histogram_quantile(q, self._bounds[name], window))
                                for q in QUANTILES}}
        elapsed = now.time - rate_start.time
        old = rate_start.stats

        def rate(current: float, before: float) -> float | None:
            return round((current - before) / elapsed, 2) if elapsed > 0 else None

        queries = stats.prefix_cache_queries - start.stats.prefix_cache_queries
        hits = stats.prefix_cache_hits - start.stats.prefix_cache_hits
        steps = [[seq, round(t - now.time, 3), prefill, decode] for seq, t, prefill, decode in self._steps
                 if seq > subscription.last_step]
        if self._steps:
            subscription.last_step = self._steps[-1][0]
        engine = self.engine
        frame = {
            "time": round(now.time, 3), "window_s": round(now.time - start.time, 3),
            "status": _status(engine),
            "waiting": stats.num_waiting, "running": stats.num_running, "in_flight": engine.num_in_flight,
            "kv": {"in_use": stats.num_blocks_in_use, "cached": stats.num_cached_blocks,
                   "free": stats.num_free_blocks, "total": stats.num_total_blocks},
            "prefix_cache": {"hit_rate": round(hits / queries, 4) if queries else None,
                             "hit_rate_total": round(stats.prefix_cache_hits / stats.prefix_cache_queries, 4)
                             if stats.prefix_cache_queries else None,
                             "queries": queries, "hits": hits},
            "preemptions": {"total": stats.num_preemptions,
                            "window": stats.num_preemptions - start.stats.num_preemptions},
            "throughput": {"generation_tokens_s": rate(now.generation_tokens, rate_start.generation_tokens),
                           "prompt_tokens_s": rate(now.prompt_tokens, rate_start.prompt_tokens),
                           "scheduled_tokens_s": rate(stats.num_scheduled_tokens, old.num_scheduled_tokens),
                           "requests_s": rate(now.finished, rate_start.finished),
                           "steps_s": rate(stats.num_steps, old.num_steps)},
            "ttft_ms": latency["ttft"], "itl_ms": latency["itl"],
            "num_steps": stats.num_steps, "steps": steps,
            "rejected": stats.num_rejected, "timed_out": stats.num_timed_out,
        }
        if not subscription.sent_config:
            frame["config"] = self.flags()
            subscription.sent_config = True
        return self._encoder.encode(frame)

    def flags(self) -> dict:
        """The server's flags that shape scheduling, as the page shows them."""
        config, info = self.config, self.engine.info
        sched, cache = config.scheduler, config.cache
        return {"model": config.model.served_model_name, "max_model_len": config.model.max_model_len,
                "max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens,
                "max_waiting_requests": sched.max_waiting_requests, "scheduling_policy": sched.scheduling_policy,
                "priority_aging_seconds": sched.priority_aging_seconds,
                "long_prefill_token_threshold": sched.long_prefill_token_threshold,
                "async_scheduling": sched.async_scheduling, "ttft_slo_ms": sched.ttft_slo_ms,
                "request_timeout": sched.request_timeout, "enable_prefix_caching": cache.enable_prefix_caching,
                "block_size": info.block_size if info else cache.block_size,
                "num_kv_blocks": info.num_kv_blocks if info else cache.num_kv_blocks,
                "dtype": config.model.dtype}


def _status(engine) -> str:
    """As /health says it: "draining", "engine_down" (no group serves), "degraded" (some group is down while
    another serves) or "ok"."""
    if engine.draining:
        return "draining"
    if engine.down_reason:
        return "engine_down"
    return "ok" if all(group.up for group in engine.group_states()) else "degraded"
