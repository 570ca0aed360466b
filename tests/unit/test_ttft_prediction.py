"""SLO admission's TTFT prediction (scheduler/admission.py's predict_ttft) against the simulator (capacity/simulator.py,
the real Scheduler in virtual time) on the same state: when a request arrives, the prediction made at its admission
check equals the time its first token reaches its client in the simulation that follows, for any queue of requests
and any budgets, with one step in flight and with two, for queues that arrive together and for arrivals spread over
time (requests prefilling, decoding and finishing in the steps in flight when it arrives)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shuttle.capacity.simulator import Simulator
from shuttle.capacity.workload import SimRequest
from shuttle.common.config import SchedulerConfig
from shuttle.scheduler.step_cost import StepCostModel

COST = StepCostModel({"step": 0.004, "token": 2e-5, "sequence": 3e-4, "prefill_attention": 1e-8}, client_s=0.001)
NEVER = 1e9  # a TTFT objective no request misses: it arms admission (which then times the steps in flight)


def predicted_and_simulated(requests: list[SimRequest], config: SchedulerConfig) -> tuple[float, float]:
    """The last request's predicted TTFT at its admission check, and its TTFT in the simulation (seconds)."""
    simulator = Simulator(config, 1000, 16, 512, COST)
    admission = simulator.scheduler.admission
    check, predicted = admission.check, []

    def check_and_predict(view, request, slo_ms):
        if request.request_id == str(len(requests) - 1):
            predicted.append(admission.predict_ttft(view, request))
        return check(view, request, slo_ms)
    admission.check = check_and_predict
    [*_, last] = simulator.run(requests).records
    assert last.status == 0  # served (not refused)
    return predicted[0], last.ttft


requests_st = st.lists(st.tuples(st.integers(1, 90), st.integers(1, 20)), min_size=1, max_size=8)
budgets_st = st.tuples(st.integers(1, 6), st.sampled_from([16, 32, 64, 256]))


@settings(max_examples=200, deadline=None)
@given(shapes=requests_st, budgets=budgets_st, overlapped=st.booleans())
def test_a_queue_that_arrives_together(shapes, budgets, overlapped):
    config = SchedulerConfig(max_num_seqs=budgets[0], max_num_batched_tokens=budgets[1], async_scheduling=overlapped,
                             ttft_slo_ms=NEVER)
    requests = [SimRequest(0.0, [10 + (i + j) % 50 for j in range(p)], o) for i, (p, o) in enumerate(shapes)]
    predicted, simulated = predicted_and_simulated(requests, config)
    assert predicted == pytest.approx(simulated, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(shapes=requests_st, budgets=budgets_st, gaps=st.lists(st.floats(0, 0.03), min_size=8, max_size=8),
       overlapped=st.booleans())
def test_arrivals_while_others_run(shapes, budgets, gaps, overlapped):
    config = SchedulerConfig(max_num_seqs=budgets[0], max_num_batched_tokens=budgets[1], async_scheduling=overlapped,
                             ttft_slo_ms=NEVER)
    arrivals = [math.fsum(gaps[:i]) for i in range(len(shapes))]
    requests = [SimRequest(arrivals[i], [10 + (i + j) % 50 for j in range(p)], o) for i, (p, o) in enumerate(shapes)]
    predicted, simulated = predicted_and_simulated(requests, config)
    assert predicted == pytest.approx(simulated, rel=1e-9)


def test_a_newcomer_waits_behind_queued_requests_of_the_same_rank():
    """Ties in arrival time: the queue keeps arrival order, so a newcomer is predicted behind all of them."""
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, async_scheduling=False, ttft_slo_ms=NEVER)
    requests = [SimRequest(0.0, [10 + i] * 40, 10) for i in range(3)]  # no shared prefix: no cache hits
    predicted, simulated = predicted_and_simulated(requests, config)
    assert predicted == pytest.approx(simulated, rel=1e-9) and predicted > 20 * 0.004  # two requests' decodes first
