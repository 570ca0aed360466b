"""SLO-aware admission (issue 12 acceptance 4): at an arrival rate 3x over capacity, the requests admitted meet
the TTFT objective at p90 and the rest are refused at arrival with 503 + Retry-After; without an objective
nothing changes. The real Scheduler is driven by the simulator (fabricated tokens, virtual time)."""

import pytest

from shuttle.capacity.simulator import Simulator
from shuttle.capacity.workload import synthetic
from shuttle.common.config import SchedulerConfig
from shuttle.common.messages import FinishReason, Submit
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.admission import SloAdmission
from shuttle.scheduler.step_cost import StepCostModel
from tests.unit.test_scheduler import make_scheduler

# A cost model shaped like stories260K's on this machine: a fixed step cost, per-sequence and per-token terms.
COST = StepCostModel({"step": 0.005, "sequence": 1.5e-4, "token": 4e-5, "prefill_attention": 2e-9,
                      "decode_attention": 1e-7}, client_s=0.002)
SLO_MS = 300.0
CONFIG = dict(max_num_seqs=32, max_num_batched_tokens=512)


def run(rate: float, n: int = 1200, seed: int = 7, **config):
    workload = synthetic(n, rate, input_len=128, output_len=48, vocab_size=512, seed=seed)
    return Simulator(SchedulerConfig(**{**CONFIG, **config}), 2000, 16, 512, COST).run(workload)


@pytest.fixture(scope="module")
def capacity() -> float:
    """Requests per second the configuration completes when everything arrives at once."""
    return run(float("inf"), n=600).summary()["request_throughput"]


def test_three_times_over_capacity_admitted_meet_the_objective_and_the_rest_are_refused_at_arrival(capacity):
    result = run(3 * capacity, ttft_slo_ms=SLO_MS)
    summary = result.summary(ttft_slo_ms=SLO_MS)
    admitted = result.completed
    refused = [r for r in result.records if r.status == 503]
    assert len(admitted) + len(refused) == 1200
    assert summary["ttft_ms"]["p90"] <= SLO_MS
    assert 0.4 < len(refused) / 1200 < 0.85  # about two thirds must go when three times capacity arrives
    for record in refused:  # answered at arrival (plus the way back to the client), never after waiting
        assert record.token_times == [] and record.finish == pytest.approx(record.arrival + COST.client_s)
        assert record.retry_after_s >= 1
    assert summary["request_throughput"] > 0.85 * capacity  # refusing does not starve the engine


def test_without_an_objective_nothing_is_refused_and_queueing_grows(capacity):
    result = run(3 * capacity)
    assert all(r.status == 0 for r in result.records)
    assert result.summary()["ttft_ms"]["p90"] > 10 * SLO_MS  # what admission prevents


def test_without_an_objective_the_plans_are_those_of_a_scheduler_without_admission(capacity):
    """The admission object of a server without --ttft-slo-ms watches nothing and refuses nothing: replacing it
    with one that can do nothing at all gives the very same steps."""

    class Inert(SloAdmission):
        def check(self, scheduler, request, slo_ms):
            return None

    workload = synthetic(300, 3 * capacity, input_len=128, output_len=48, vocab_size=512, seed=3)
    plain = Simulator(SchedulerConfig(**CONFIG), 2000, 16, 512, COST)
    inert = Simulator(SchedulerConfig(**CONFIG), 2000, 16, 512, COST)
    inert.scheduler.admission = Inert()
    a, b = plain.run(workload), inert.run(workload)
    assert [r.token_times for r in a.records] == [r.token_times for r in b.records]
    assert not plain.scheduler.admission.armed and plain.scheduler.admission._observed.maxlen


def test_a_request_carries_its_own_objective(capacity):
    """No server objective: only requests that carry one can be refused, each against its own."""
    workload = synthetic(600, 3 * capacity, input_len=128, output_len=48, vocab_size=512, seed=5)
    for i, item in enumerate(workload):
        item.ttft_slo_ms = SLO_MS if i % 2 else 0.0
    result = Simulator(SchedulerConfig(**CONFIG), 2000, 16, 512, COST).run(workload)
    statuses = [r.status for r in result.records]
    assert all(s == 0 for s in statuses[0::2])  # without an objective: always admitted
    assert statuses[1::2].count(503) > 100
    assert max(r.ttft for r in result.records[1::2] if r.status == 0) < 2 * SLO_MS / 1000


def test_online_cost_model_without_a_profile(capacity):
    """A server without a profile fits the cost model to its own measured steps; once it has, it refuses."""
    workload = synthetic(1200, 3 * capacity, input_len=128, output_len=48, vocab_size=512, seed=7)
    simulator = Simulator(SchedulerConfig(**CONFIG, ttft_slo_ms=SLO_MS), 2000, 16, 512, COST,
                          use_online_admission=True)
    result = simulator.run(workload)
    refused = [r for r in result.records if r.status == 503]
    assert len(refused) > 300
    late_admitted = [r for r in result.records[600:] if r.status == 0]  # after the model was fitted
    ttfts = sorted(r.ttft for r in late_admitted)
    # the online model is fitted to the steps seen so far, not given the truth: within 2% of the objective
    assert ttfts[int(0.9 * len(ttfts))] <= 1.02 * SLO_MS / 1000
    assert simulator.scheduler.admission.cost.meta["num_measurements"] >= 32


def test_the_refusal_output():
    s = make_scheduler(max_num_seqs=1, ttft_slo_ms=50.0)
    s.admission = SloAdmission(50.0, StepCostModel({"step": 0.010}))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    s.add_request(b"c", Submit(request_id="busy", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=0.0))
    s.add_request(b"c", Submit(request_id="late", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=1.0))  # behind 20 steps of 10 ms
    s.add_request(b"c", Submit(request_id="mine", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=2.0, ttft_slo_ms=5000.0))  # its own is lax
    [out] = s.take_outputs()[b"c"]
    assert out.request_id == "late" and out.finish_reason == FinishReason.ERROR and out.error_status == 503
    assert out.rejection == "slo" and out.retry_after_s >= 1 and "TTFT objective" in out.error_message
    assert sorted(s.requests) == ["busy", "mine"] and s.num_rejected == 1


def test_an_objective_no_idle_server_could_meet_is_a_400_not_a_503_to_retry_forever():
    """A fresh-clone trial: ttft_slo_ms below what its prompt's prefill takes on an idle server got 503 + Retry-After
    forever, and `shuttle batch` and background responses, which retry a 503, never ended. Refused for good instead
    (400), naming whose objective; an objective missed only because of the queue ahead stays a 503."""
    s = make_scheduler(max_num_seqs=1, ttft_slo_ms=50.0)
    s.admission = SloAdmission(50.0, StepCostModel({"step": 0.010, "token": 5e-4}))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    s.add_request(b"c", Submit(request_id="never", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=0.0, ttft_slo_ms=5.0))  # one step alone (12 ms) misses 5 ms
    s.add_request(b"c", Submit(request_id="long", prompt_token_ids=list(range(10, 110)), sampling=params,
                               arrival_time=0.0))  # 100 prompt tokens: 60 ms alone, over the server's 50 ms
    s.add_request(b"c", Submit(request_id="busy", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=1.0))
    s.add_request(b"c", Submit(request_id="late", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=2.0))  # behind 20 steps: later, not never
    never, long, late = s.take_outputs()[b"c"]
    assert (never.request_id, never.error_status, never.rejection) == ("never", 400, "slo")
    assert "its ttft_slo_ms 5 can never be met here" in never.error_message and never.retry_after_s == 0
    assert "idle server is 12 ms" in never.error_message  # one step of 10 ms and its 4 prompt tokens
    assert (long.request_id, long.error_status) == ("long", 400)
    assert "the server's --ttft-slo-ms 50 can never be met" in long.error_message
    assert (late.request_id, late.error_status, late.rejection) == ("late", 503, "slo") and late.retry_after_s >= 1
    assert sorted(s.requests) == ["busy"]


def test_a_cost_model_that_predicts_no_time_admits_instead_of_crashing():
    # An online fit can come out all zeros (its steps measured ~0 s); the prediction then says nothing about
    # waiting, so the request is admitted. It used to be refused with an infinite Retry-After, and the scheduler
    # died on math.ceil(inf).
    s = make_scheduler(max_num_seqs=1, ttft_slo_ms=50.0)
    s.admission = SloAdmission(50.0, StepCostModel({"step": 0.0}))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    s.add_request(b"c", Submit(request_id="busy", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=0.0))
    s.add_request(b"c", Submit(request_id="next", prompt_token_ids=list(range(10, 14)), sampling=params,
                               arrival_time=1.0, ttft_slo_ms=1.0))
    assert s.take_outputs() == {} and sorted(s.requests) == ["busy", "next"]
