"""The discrete-event simulator: the real Scheduler in virtual time, with the overlapped loop's semantics."""

import pytest

from shuttle.capacity.simulator import Simulator, percentiles
from shuttle.capacity.workload import SimRequest, arrivals, synthetic
from shuttle.common.config import SchedulerConfig
from shuttle.scheduler.step_cost import StepCostModel

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


def test_the_schedulers_time_grows_with_the_steps_sequences():
    """1 ms a step and 1 ms a sequence: two requests prefilled together cost 4 ms of scheduling (2 to plan, 2 to
    settle) around their 10 ms step."""
    cost = StepCostModel({"step": 0.010}, scheduler_s=0.001, scheduler_sequence_s=0.001)
    result = sim(cost, async_scheduling=False).run([request(0.0, 4, 1), request(0.0, 4, 1)])
    assert [r.token_times for r in result.records] == [pytest.approx([0.0115])] * 2


def test_requests_sent_together_share_the_first_step():
    """In process there is no frontend between the client and the scheduler: three requests sent at 0 are
    prefilled together in the first step (0-10 ms) and decode together (10-20 ms)."""
    together = [request(0.0, 4, 2) for _ in range(3)]
    assert [r.token_times for r in sim().run(together).records] == [pytest.approx([0.010, 0.020])] * 3


def test_client_latency_is_added_to_every_token():
    cost = StepCostModel({"step": 0.010}, client_s=0.003)
    [record] = sim(cost).run([request(0.0, 4, 2)]).records
    assert record.token_times == pytest.approx([0.013, 0.023])


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


def test_deterministic_for_a_workload():
    cost = StepCostModel({"step": 0.002, "token": 1e-5, "sequence": 1e-4, "prefill_attention": 1e-9})

    def run(seed):
        workload = synthetic(300, rate=200.0, input_len=40, output_len=20, vocab_size=500, seed=seed)
        return Simulator(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=128), 400, 16, 512, cost).run(workload)

    a, b, c = run(1), run(1), run(2)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert a.summary() == b.summary()
    assert a.summary() != c.summary()
    assert a.summary()["completed"] == 300 and a.summary()["max_waiting"] > 0


def test_each_step_lasts_its_prediction_times_a_factor_drawn_from_the_spread():
    """A spread of nine quantiles at 1 and one at 3: a lone request's inter-token times (each one step) are 10 ms
    below probability 0.85, 30 ms from 0.95 up and in between linearly; the same for the same seed, not for
    another."""
    cost = StepCostModel({"step": 0.010}, spread=(1.0,) * 9 + (3.0,))

    def itls(seed):
        [record] = Simulator(SchedulerConfig(), 200, 4, 1024, cost, seed=seed).run([request(0.0, 4, 400)]).records
        return [round(i / 0.010, 6) for i in record.itls]

    first = itls(0)
    assert all(1.0 <= f <= 3.0 for f in first)
    assert 0.80 < first.count(1.0) / len(first) < 0.90
    assert 0.02 < first.count(3.0) / len(first) < 0.08
    assert first == itls(0) and first != itls(1)
    assert sim().run([request(0.0, 4, 50)]).records[0].itls == pytest.approx([0.010] * 49)  # no spread: exact


def test_arrivals_have_the_asked_rate_and_burstiness():
    poisson = arrivals(4000, rate=50.0, seed=3)
    bursty = arrivals(4000, rate=50.0, burstiness=0.25, seed=3)
    assert poisson[-1] / 4000 == pytest.approx(1 / 50, rel=0.05)
    assert bursty[-1] / 4000 == pytest.approx(1 / 50, rel=0.15)
    gaps = sorted(b - a for a, b in zip(bursty, bursty[1:]))
    assert gaps[len(gaps) // 2] < 0.5 * sorted(b - a for a, b in zip(poisson, poisson[1:]))[len(gaps) // 2]
    assert arrivals(3, float("inf")) == [0.0, 0.0, 0.0]


def test_percentiles_are_bench_serves():
    from shuttle.capacity.bench_serve import percentiles as bench_percentiles
    values = [0.001 * v for v in (5, 1, 9, 3, 7, 2, 8)]
    assert percentiles(values) == pytest.approx(bench_percentiles(values))
