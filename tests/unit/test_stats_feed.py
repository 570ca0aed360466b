"""Issue 15: the dashboard's feed, without a server: per-step prefill/decode split from the scheduler, windowed
percentiles from the frontend's histograms, rates, and no work at all while nobody watches."""

import asyncio

import msgspec
import pytest

from shuttle.common.messages import SchedulerStats
from shuttle.frontend.observability.metrics import Metrics
from shuttle.frontend.observability.stats_feed import StatsFeed, _buckets, _total, histogram_quantile
from shuttle.scheduler.stats import StepStats
from tests.inprocess import FakeEngine, make_config
from tests.unit.test_scheduler import make_scheduler, run_step, submit

INF = float("inf")


def test_histogram_quantile_interpolates_in_buckets_like_prometheus():
    bounds = [0.01, 0.02, 0.04, INF]
    assert histogram_quantile(0.5, bounds, [0, 4, 8, 8]) == pytest.approx(0.02)
    assert histogram_quantile(0.25, bounds, [0, 4, 8, 8]) == pytest.approx(0.015)
    assert histogram_quantile(0.99, bounds, [0, 4, 8, 8]) == pytest.approx(0.02 + 0.02 * 3.92 / 4)
    assert histogram_quantile(0.5, bounds, [2, 2, 2, 2]) == pytest.approx(0.005)  # first bucket: from 0
    assert histogram_quantile(0.9, bounds, [0, 0, 1, 3]) == 0.04  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, bounds, [0, 0, 0, 0]) is None


def test_scheduler_counts_decode_tokens_apart_from_prefill():
    s = make_scheduler(max_num_batched_tokens=8)
    submit(s, "short", 3, max_tokens=10)
    step, _ = run_step(s)
    assert (step.num_tokens, step.num_decode_tokens) == (3, 0)
    submit(s, "long", 20)
    step, _ = run_step(s)
    assert step.num_scheduled == {"short": 1, "long": 7}
    assert (step.num_decode_tokens, step.num_prompt_tokens) == (1, 7)


def test_step_stats_attach_the_decode_counts_aligned_with_the_token_counts():
    steps = StepStats()
    steps.on_step(2, 9, 8, 1, num_decode_tokens=1)
    steps.on_step(3, 3, 0, 3, num_decode_tokens=3)
    message = steps.attach(SchedulerStats(num_running=3))
    assert message.step_token_counts == [9, 3] and message.step_decode_token_counts == [1, 3]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(message), type=SchedulerStats)
    assert decoded.step_decode_token_counts == [1, 3]
    assert steps.attach(message).step_decode_token_counts == [1, 3]  # nothing new: the same message


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_feed(clock: Clock, tick_s: float = 3600.0) -> tuple[StatsFeed, FakeEngine, Metrics]:
    engine = FakeEngine()
    metrics = Metrics(lambda: engine.stats)
    return StatsFeed(engine, metrics, make_config(), tick_s=tick_s, clock=clock), engine, metrics


async def test_nobody_watching_costs_nothing():
    clock = Clock()
    feed, engine, _ = make_feed(clock)
    engine.on_stats = feed.chain(engine.on_stats)
    engine._on_stats(SchedulerStats(num_running=2, step_token_counts=[5, 6], step_decode_token_counts=[2, 2]))
    assert engine.stats.num_running == 2  # the engine's own bookkeeping still runs
    assert not feed._steps and feed._ticker is None and not feed._snapshots
    async with feed.subscribe(5.0) as subscription:
        assert feed._ticker is not None
        first = msgspec.json.decode(await subscription.next())
    assert feed._ticker is None and not feed._snapshots and not feed.subscribers  # the last one left: all stops
    assert first["running"] == 2 and first["steps"] == []  # steps before anyone watched were not kept
    assert first["config"]["max_num_batched_tokens"] == 2048 and first["config"]["scheduling_policy"] == "fcfs"


async def test_frames_carry_steps_latency_percentiles_and_rates_over_the_window():
    clock = Clock()
    feed, engine, metrics = make_feed(clock)
    engine.on_stats = feed.chain(engine.on_stats)
    metrics.ttft.observe(0.5)  # before the window: must not count
    async with feed.subscribe(10.0) as subscription:
        first = msgspec.json.decode(await subscription.next())
        assert first["ttft_ms"] == {"count": 0, "p50": None, "p90": None, "p99": None}
        clock.now += 4.0
        for _ in range(4):
            metrics.ttft.observe(0.015)  # bucket (0.01, 0.02]
        metrics.itl.observe(0.05)  # bucket (0.04, 0.06]
        metrics.generation_tokens.inc(30)
        engine._on_stats(SchedulerStats(num_running=3, num_waiting=1, num_total_blocks=100, num_blocks_in_use=40,
                                        num_free_blocks=60, num_cached_blocks=12, prefix_cache_queries=50,
                                        prefix_cache_hits=20, num_scheduled_tokens=80, num_steps=4,
                                        step_token_counts=[64, 9, 3], step_decode_token_counts=[0, 1, 3]))
        feed.publish()
        frame = msgspec.json.decode(await subscription.next())
        assert frame["ttft_ms"]["count"] == 4 and frame["ttft_ms"]["p50"] == pytest.approx(15.0)
        assert frame["itl_ms"] == {"count": 1, "p50": pytest.approx(50.0), "p90": pytest.approx(58.0),
                                   "p99": pytest.approx(59.8)}
        assert [step[2:] for step in frame["steps"]] == [[64, 0], [8, 1], [0, 3]]
        assert frame["kv"] == {"in_use": 40, "cached": 12, "free": 60, "total": 100}
        assert frame["prefix_cache"]["hit_rate"] == 0.4 and frame["prefix_cache"]["queries"] == 50
        assert (frame["running"], frame["waiting"], frame["window_s"]) == (3, 1, 4.0)
        # rates over the last 2 s: the oldest snapshot within them is this one, so none yet
        clock.now += 1.0
        engine._on_stats(SchedulerStats(num_running=3, num_scheduled_tokens=120, num_steps=6, prefix_cache_queries=50,
                                        prefix_cache_hits=20, step_token_counts=[20, 20],
                                        step_decode_token_counts=[20, 20]))
        feed.publish()
        frame = msgspec.json.decode(await subscription.next())
        assert frame["throughput"]["scheduled_tokens_s"] == 40.0 and frame["throughput"]["steps_s"] == 2.0
        assert frame["throughput"]["generation_tokens_s"] == 0.0  # the 30 tokens came before the last 2 s began
        assert [step[2:] for step in frame["steps"]] == [[0, 20], [0, 20]]  # only the new ones
        assert "config" not in frame
        clock.now += 20.0  # the 4 TTFTs leave the 10 s window
        feed.publish()
        frame = msgspec.json.decode(await subscription.next())
        assert frame["ttft_ms"]["count"] == 0 and frame["steps"] == []


async def test_a_slow_reader_loses_old_frames_and_closing_ends_every_reader():
    clock = Clock()
    feed, _, _ = make_feed(clock)
    async with feed.subscribe(5.0) as subscription:
        await asyncio.sleep(0)
        for _ in range(10):
            clock.now += 1
            feed.publish()
        assert subscription.frames.qsize() == 4  # bounded: nothing piles up behind a reader that lags
        feed.close()
        frames = [await subscription.next() for _ in range(4)]
        assert frames[-1] is None


def test_reads_of_the_histograms_and_counters():
    metrics = Metrics(lambda: SchedulerStats())
    for seconds in (0.0005, 0.003, 0.003, 0.07, 700.0):
        metrics.ttft.observe(seconds)
    bounds, counts = _buckets(metrics.ttft)
    assert counts[0] == 1 and counts[-1] == 5 and bounds[-1] == INF
    metrics.generation_tokens.inc(7)
    metrics.finished.labels("stop").inc(2)
    metrics.finished.labels("length").inc(3)
    assert (_total(metrics.generation_tokens), _total(metrics.finished)) == (7, 5)


async def test_the_feed_says_degraded_while_a_group_is_down_and_another_serves():
    """As /health: a fresh-clone trial saw "ok" in every frame while one of two data-parallel groups restarted."""
    from shuttle.frontend.engine.router import Router

    router = Router([FakeEngine(), FakeEngine()], 128)
    feed = StatsFeed(router, Metrics(lambda: router.stats), make_config(), tick_s=3600.0, clock=Clock())
    async with feed.subscribe(5.0) as subscription:
        assert msgspec.json.decode(await subscription.next())["status"] == "ok"
        router.engine_down("worker (pid 7) was killed by signal SIGKILL", 5.0, group=1)
        feed.publish()
        assert msgspec.json.decode(await subscription.next())["status"] == "degraded"
        router.engine_down("worker (pid 8) was killed by signal SIGKILL", 5.0, group=0)
        feed.publish()
        assert msgspec.json.decode(await subscription.next())["status"] == "engine_down"
    router.close()
