"""The fits of the simulator's shared cores to real runs (capacity/serving_fit.py), on synthetic runs whose truth
is known."""

from types import SimpleNamespace

import pytest

from capacity import serving_fit
from capacity.simulator import ServedSeconds
from common.step_cost import StepCostModel, StepShape

DECODE = StepShape(8, 0, 8, 0, 800, 8)
PREFILL = StepShape(100, 1, 0, 5000, 0, 1)


def served(shape: StepShape, seconds: float):
    return SimpleNamespace(shape=shape, seconds=seconds, num_tokens=shape.num_tokens,
                           num_prefill_seqs=shape.num_prefill_seqs)


def test_cpu_per_request_token_and_step_are_recovered_from_three_runs():
    """Frontend CPU = 2 ms per request + 100 us per token + 0.5 ms per step, client 1 ms + 80 us: exact runs give
    exactly these back; the scheduler's CPU per step is its total over all steps."""
    runs = {}
    for name, requests, tokens, steps in (("low", 32, 2048, 300), ("high", 512, 32768, 400), ("prefill", 32, 64, 40)):
        cpu = {"frontend": 2e-3 * requests + 1e-4 * tokens + 5e-4 * steps, "client": 1e-3 * requests + 8e-5 * tokens,
               "scheduler": 1e-3 * steps, "worker": 1.0}
        runs[name] = ({"completed": requests, "total_output_tokens": tokens}, [served(DECODE, 0.01)] * steps, cpu)
    fitted = serving_fit.fit_cpu(StepCostModel({"step": 1e-3}), runs)
    assert (fitted.ingress_s, fitted.egress_s, fitted.egress_step_s) == pytest.approx((2e-3, 1e-4, 5e-4), rel=1e-6)
    assert (fitted.client_cpu_request_s, fitted.client_cpu_token_s) == pytest.approx((1e-3, 8e-5), rel=1e-6)
    assert fitted.scheduler_s == pytest.approx(1e-3) and fitted.cores >= 1


def test_worker_work_is_scaled_until_the_simulated_steps_last_what_the_servers_logged():
    """A stand-in simulation whose steps last 2x (decode) and 4x (prefill) the worker's work: the factors settle
    where the simulated steps last the logged 10 ms and 40 ms (a prefill step's fixed part is decode work: the
    iteration converges to it)."""
    model = StepCostModel({"step": 1e-3, "token": 1e-5, "prefill_attention": 1e-8}, cores=2.0)

    def simulated_run(candidate, name):
        steps = [ServedSeconds(DECODE, 2 * candidate.worker_seconds(DECODE)),
                 ServedSeconds(PREFILL, 4 * candidate.worker_seconds(PREFILL))]
        return SimpleNamespace(served=steps), {}

    logged = {"run": [served(DECODE, 0.010), served(PREFILL, 0.040)]}
    fitted = serving_fit.fit_worker_work(model, logged, simulated_run, iterations=20)
    assert 2 * fitted.worker_seconds(DECODE) == pytest.approx(0.010)
    assert 4 * fitted.worker_seconds(PREFILL) == pytest.approx(0.040, rel=1e-6)
    assert serving_fit.fit_worker_work(StepCostModel({"step": 1e-3}), logged, simulated_run).cpu_decode_factor == 1.0


def test_worker_work_is_judged_against_the_prediction_of_each_steps_own_shape():
    """The servers logged only small decode steps, each lasting exactly its served prediction; the simulation also
    runs large ones (another mix of steps, as a simulated run has), each lasting 2x the worker's work: the fit makes
    every simulated step last its prediction, where matching plain means would have made them all too fast."""
    model = StepCostModel({"step": 1e-3, "decode_seq": 1e-4, "decode_attention": 1e-7}, cores=2.0)
    large = StepShape(100, 0, 100, 0, 20000, 100)

    def simulated_run(candidate, name):
        return SimpleNamespace(served=[ServedSeconds(shape, 2 * candidate.worker_seconds(shape))
                                       for shape in (DECODE, large)]), {}

    logged = {"run": [served(DECODE, model.predict(DECODE))] * 3}
    fitted = serving_fit.fit_worker_work(model, logged, simulated_run)
    for shape in (DECODE, large):
        assert 2 * fitted.worker_seconds(shape) == pytest.approx(model.predict(shape))


def test_weights_are_chosen_to_match_the_measured_waits():
    """A stand-in whose worker waits 0.3 / weight seconds per second: measured 0.1 picks the worker's weight 3."""
    def simulated_run(candidate, name):
        weight = candidate.cpu_weights.get("worker", 1.0)
        return None, {"worker": 0.3 / weight, "frontend": 0.2, "client": 0.1, "scheduler": 0.0}

    waits = {"run": {"worker": 0.1, "frontend": 0.2, "client": 0.1, "scheduler": 0.5}}
    fitted = serving_fit.fit_cpu_weights(StepCostModel({"step": 1e-3}, cores=2.0), waits, simulated_run)
    assert fitted.cpu_weights["worker"] == 3.0 and fitted.meta["cpu_weights_rms_wait"] == pytest.approx(0.0)
