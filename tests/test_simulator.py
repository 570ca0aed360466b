"""The discrete-event simulator: the real Scheduler in virtual time, with the overlapped loop's semantics."""

import pytest

from capacity.simulator import Simulator, percentiles
from capacity.workload import SimRequest, arrivals, synthetic
from common.config import SchedulerConfig
from common.step_cost import StepCostModel

TEN_MS = StepCostModel({"step": 0.010})  # every step takes 10 ms, whatever it computes


def sim(cost=TEN_MS, num_blocks=64, **config) -> Simulator:
    return Simulator(SchedulerConfig(**config), num_blocks, 4, 128, cost)


def request(arrival: float, prompt_len: int, output_len: int) -> SimRequest:
    return SimRequest(arrival, list(range(10, 10 + prompt_len)), output_len)


def test_one_request_by_hand():
    """Prefill samples token 1 at 10 ms; the decode planned meanwhile (two steps in flight) ends at 20 ms, the
    next at 30 ms."""
    result = sim().run([request(0.0, 4, 3)])
    [record] = result.records
    assert record.token_times == pytest.approx([0.010, 0.020, 0.030])
    assert record.ttft == pytest.approx(0.010) and record.itls == pytest.approx([0.010, 0.010])
    assert result.num_steps == 3 and result.duration == pytest.approx(0.030)


def test_a_request_waiting_for_a_slot_by_hand():
    """max_num_seqs 1: the second request (arriving at 5 ms) waits until the first finishes at 30 ms; its slot
    is taken at the next plan, its prefill runs 30-40 ms: TTFT 40 - 5 = 35 ms."""
    result = sim(max_num_seqs=1).run([request(0.0, 4, 3), request(0.005, 4, 2)])
    first, second = result.records
    assert first.token_times == pytest.approx([0.010, 0.020, 0.030])
    assert second.token_times == pytest.approx([0.040, 0.050])
    assert second.ttft == pytest.approx(0.035)


def test_one_step_in_flight_without_async_scheduling():
    """Without overlap the worker waits for each plan: with a scheduler cost of 2 ms per step (1 to plan, 1 to
    settle) every step takes 10 + 2 ms."""
    cost = StepCostModel({"step": 0.010}, scheduler_s=0.002)
    result = sim(cost, async_scheduling=False).run([request(0.0, 4, 3)])
    assert result.records[0].token_times == pytest.approx([0.011, 0.023, 0.035])


def test_client_latency_is_added_to_every_token():
    cost = StepCostModel({"step": 0.010}, client_s=0.003)
    [record] = sim(cost).run([request(0.0, 4, 2)]).records
    assert record.token_times == pytest.approx([0.013, 0.023])


def test_requests_sent_together_reach_the_scheduler_one_ingress_apart():
    """With 1 ms of frontend time per request, of three requests sent at 0 the first reaches the scheduler at 1 ms
    and is planned alone (1-11 ms), its decode is planned right after (11-21 ms); the other two (in at 2 and 3 ms)
    are prefilled together in the step after (21-31 ms). Without ingress time all three share the first step."""
    together = [request(0.0, 4, 2) for _ in range(3)]
    records = sim(StepCostModel({"step": 0.010}, ingress_s=0.001)).run(together).records
    assert [r.token_times for r in records] == [pytest.approx([0.011, 0.021])] + [pytest.approx([0.031, 0.041])] * 2
    assert [r.arrival for r in records] == [0.0] * 3  # TTFT counts from when the client sent it
    assert [r.token_times for r in sim().run(together).records] == [pytest.approx([0.010, 0.020])] * 3


def test_the_frontend_streams_tokens_and_takes_requests_in_through_one_queue():
    """2 ms of frontend time per token out: of two first tokens from the step ending at 10 ms one leaves at 12, the
    other at 14; a request sent at 11 ms waits for that and reaches the scheduler at 14 (prefill 14-24 ms, out at
    26 ms)."""
    cost = StepCostModel({"step": 0.010}, egress_s=0.002)
    a, b, c = sim(cost).run([request(0.0, 4, 1), request(0.0, 4, 1), request(0.011, 4, 1)]).records
    assert (a.token_times, b.token_times, c.token_times) == (
        pytest.approx([0.012]), pytest.approx([0.014]), pytest.approx([0.026]))
    assert c.ttft == pytest.approx(0.015)


def test_on_one_shared_core_a_step_slows_while_the_frontend_streams_the_one_before():
    """One core for all: 10 ms steps, 4 ms of frontend per token. Step 1 runs alone (0-10 ms); its token's egress
    and step 2 share the core, so the token leaves at 18 ms and step 2 (4 ms done by then) ends at 24; likewise
    token 2 leaves at 32 and step 3 ends at 38; token 3 then streams alone (38-42). Cores of their own: 14, 24,
    34 ms. The served steps are what the step log would have: 10, 14 and 14 ms."""
    alone = StepCostModel({"step": 0.010}, egress_s=0.004)
    [record] = sim(alone).run([request(0.0, 4, 3)]).records
    assert record.token_times == pytest.approx([0.014, 0.024, 0.034])
    shared = sim(StepCostModel({"step": 0.010}, egress_s=0.004, cores=1.0)).run([request(0.0, 4, 3)])
    assert shared.records[0].token_times == pytest.approx([0.018, 0.032, 0.042])
    assert [s.seconds for s in shared.served] == pytest.approx([0.010, 0.014, 0.014])


def test_the_machine_speed_trace_slows_every_step_in_its_slow_intervals():
    """10 ms steps; the machine runs at 1.0 then 0.5 for 25 ms each, the seed drawing where the trace starts.
    Starting fast: steps end at 10, 20, then 5 ms done by 25 and 5 ms left at half speed: 35. Starting slow: 20,
    then 2.5 ms by 25 and 7.5 at full speed: 32.5, then 42.5."""
    traced = StepCostModel({"step": 0.010}, speed_trace=[1.0, 0.5], speed_interval_s=0.025)
    seen = set()
    for seed in range(8):
        [record] = Simulator(SchedulerConfig(), 64, 4, 128, traced, seed=seed).run([request(0.0, 4, 3)]).records
        times = tuple(round(t, 9) for t in record.token_times)
        assert times in {(0.010, 0.020, 0.035), (0.020, 0.0325, 0.0425)}
        seen.add(times)
    assert len(seen) == 2  # both starting points occur


def test_chunked_prefill_under_the_token_budget():
    """A 10-token prompt under a budget of 4 tokens needs 3 steps: first token at 30 ms."""
    [record] = sim(max_num_batched_tokens=4).run([request(0.0, 10, 1)]).records
    assert record.token_times == pytest.approx([0.030])


def test_closed_loop_sends_the_next_request_when_one_finishes():
    """max_concurrency 1: the second request is sent when the first finishes (30 ms), however early it was due."""
    simulator = Simulator(SchedulerConfig(), 64, 4, 128, TEN_MS, max_concurrency=1)
    first, second = simulator.run([request(0.0, 4, 3), request(0.0, 4, 3)]).records
    assert second.arrival == pytest.approx(0.030)
    assert second.ttft == pytest.approx(0.010)


def test_preemption_is_the_real_schedulers():
    """A cache too small for both requests' outputs: the later one is preempted and recomputed."""
    result = Simulator(SchedulerConfig(), 6, 4, 128, TEN_MS).run([request(0.0, 8, 8), request(0.0, 8, 8)])
    assert result.num_preemptions >= 1
    assert [len(r.token_times) for r in result.records] == [8, 8]


def test_deterministic_with_a_seed():
    cost = StepCostModel({"step": 0.002, "token": 1e-5, "decode_seq": 1e-4, "prefill_attention": 1e-9})

    def run(seed):
        workload = synthetic(300, rate=200.0, input_len=40, output_len=20, vocab_size=500, seed=seed)
        return Simulator(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128), 400, 16, 512, cost).run(workload)

    a, b, c = run(1), run(1), run(2)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert a.summary() == b.summary()
    assert a.summary() != c.summary()
    assert a.summary()["completed"] == 300 and a.summary()["max_waiting"] > 0


def test_arrivals_have_the_asked_rate_and_burstiness():
    poisson = arrivals(4000, rate=50.0, seed=3)
    bursty = arrivals(4000, rate=50.0, burstiness=0.25, seed=3)
    assert poisson[-1] / 4000 == pytest.approx(1 / 50, rel=0.05)
    assert bursty[-1] / 4000 == pytest.approx(1 / 50, rel=0.15)
    gaps = sorted(b - a for a, b in zip(bursty, bursty[1:]))
    assert gaps[len(gaps) // 2] < 0.5 * sorted(b - a for a, b in zip(poisson, poisson[1:]))[len(gaps) // 2]
    assert arrivals(3, float("inf")) == [0.0, 0.0, 0.0]


def test_percentiles_are_bench_serves():
    from scripts.bench_serve import percentiles as bench_percentiles
    values = [0.001 * v for v in (5, 1, 9, 3, 7, 2, 8)]
    assert percentiles(values) == pytest.approx(bench_percentiles(values))


def test_step_jitter_is_seeded_and_keeps_the_mean():
    """A shared machine's heavy tail: each step scaled by a mean-one log-normal factor drawn from the seed."""
    noisy = StepCostModel({"step": 0.010}, jitter=0.5)
    workload = [request(0.0, 4, 400)]

    def run(seed):
        return Simulator(SchedulerConfig(), 200, 4, 512, noisy, seed=seed).run(workload).records[0].token_times

    a, b, c = run(1), run(1), run(2)
    assert a == b and a != c
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.010, rel=0.1)
    assert max(gaps) > 2 * 0.010 and min(gaps) < 0.5 * 0.010


def test_persistent_jitter_makes_runs_of_slow_steps():
    """The machine's speed drifts: with the whole spread persistent over 1 s, consecutive 10 ms steps take nearly
    the same time (independent ones do not), and the mean stays 10 ms."""
    import statistics

    workload = [request(0.0, 4, 2000)]

    def gaps(cost):
        times = Simulator(SchedulerConfig(), 1000, 4, 4096, cost, seed=3).run(workload).records[0].token_times
        return [y - x for x, y in zip(times, times[1:])]

    def lag1(values):
        mean = statistics.fmean(values)
        centred = [v - mean for v in values]
        return sum(a * b for a, b in zip(centred, centred[1:])) / sum(c * c for c in centred)

    fresh = gaps(StepCostModel({"step": 0.010}, jitter=0.3))
    slow = gaps(StepCostModel({"step": 0.010}, jitter=0.3, jitter_slow_share=1.0, jitter_memory_s=1.0))
    assert abs(lag1(fresh)) < 0.1 and lag1(slow) > 0.9
    assert statistics.fmean(slow) == pytest.approx(0.010, rel=0.15)


def test_a_busy_client_reads_the_tokens_waiting_in_a_stream_at_once():
    """10 ms steps, a client that needs 25 ms per token (its own core): token 1 (out at 10 ms) is read 10-35;
    token 2 (20 ms) waits for that read, and token 3 (30 ms) joins token 2's read, which has not started: both are
    read 35-85 and arrive together; token 4 (40 ms) comes when that read is under way: its own read, 85-110."""
    slow_client = StepCostModel({"step": 0.010}, client_cpu_token_s=0.025)
    [record] = sim(slow_client).run([request(0.0, 4, 4)]).records
    assert record.token_times == pytest.approx([0.035, 0.085, 0.085, 0.110])
    assert record.itls == pytest.approx([0.050, 0.0, 0.025])
