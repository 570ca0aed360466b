"""The step-cost model: shapes of steps, the non-negative fit, the closed-form decode run, the JSON profile."""

import dataclasses
import random

import pytest

from common.cost_fitting import jitter_persistence, nonnegative_least_squares
from common.step_cost import FEATURES, StepCostModel, StepShape, shape_of

TRUE = {"step": 2e-3, "token": 3e-5, "prefill_seq": 4e-4, "decode_seq": 1e-4, "prefill_attention": 2e-9,
        "decode_attention": 5e-8, "sampled": 6e-5, "token_squared": 1e-9}


def random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        chunks = [(rng.randrange(0, 500), 1, True) for _ in range(rng.randrange(0, 64))]
        chunks += [(rng.randrange(0, 300), rng.randrange(2, 512), rng.random() < 0.5) for _ in range(rng.randrange(0, 4))]
        if not chunks:
            chunks = [(0, 7, True)]
        shapes.append(shape_of(chunks))
    return shapes


def test_shape_of_counts_tokens_sequences_and_attention_pairs():
    shape = shape_of([(10, 1, True), (0, 8, False), (8, 4, True), (99, 1, True)])
    assert shape == StepShape(num_tokens=14, num_prefill_seqs=2, num_decode_seqs=2,
                              prefill_attention=8 * 8 + 4 * 12, decode_attention=11 + 100, num_sampled=3)
    assert shape.features() == (1.0, 14, 2, 2, 112, 111, 3, 14 * 12)


def test_fit_recovers_the_coefficients_of_noiseless_data():
    truth = StepCostModel(TRUE)
    shapes = random_shapes(60)
    model = StepCostModel.fit(shapes, [truth.predict(s) for s in shapes])
    for name in FEATURES:
        assert model.coefficients[name] == pytest.approx(TRUE[name], rel=1e-6)
    assert model.meta["rel_rmse"] < 1e-9 and model.meta["num_measurements"] == 60


def test_fit_never_returns_negative_coefficients():
    """Data that a free least-squares fit explains with a negative per-token cost: NNLS clamps it to zero and
    refits the rest."""
    shapes = [StepShape(t, 0, t, 0, 0, t) for t in (1, 2, 4, 8, 16, 32, 64, 128)]
    seconds = [0.010 + 0.001 * s.num_decode_seqs - 0.0004 * s.num_tokens for s in shapes]
    model = StepCostModel.fit(shapes, seconds)
    assert all(value >= 0 for value in model.coefficients.values())
    assert model.coefficients["step"] == pytest.approx(0.010, rel=1e-6)
    assert model.coefficients["token"] + model.coefficients["decode_seq"] + model.coefficients["sampled"] == \
        pytest.approx(0.0006, rel=1e-6)


def test_nonnegative_least_squares_matches_a_known_solution():
    import numpy as np
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    b = np.array([2.0, -1.0, 1.0])  # unconstrained: (2, -1); with c >= 0: c2 = 0, c1 = mean(2, 1) = 1.5
    assert nonnegative_least_squares(a, b) == pytest.approx([1.5, 0.0])


def test_fit_rejects_too_few_or_non_positive_measurements():
    with pytest.raises(ValueError):
        StepCostModel.fit(random_shapes(3), [0.01] * 3)
    with pytest.raises(ValueError):
        StepCostModel.fit(random_shapes(10), [0.01] * 9 + [0.0])


def test_decode_run_is_the_sum_of_its_steps():
    model = StepCostModel(TRUE)
    seqs, contexts, steps = 5, 5 * 40, 7
    summed = sum(model.predict(StepShape(seqs, 0, seqs, 0, contexts + seqs * k, seqs)) for k in range(steps))
    assert model.decode_run(seqs, contexts, steps) == pytest.approx(summed, rel=1e-12)
    assert model.decode_run(seqs, contexts, 0) == 0.0 and model.predict(StepShape()) == 0.0


def test_serving_factors_scale_decode_and_prefill_work_apart():
    """A mixed step's served time is decode_factor x (fixed + decode work) + prefill_factor x prefill work +
    serving_step_s, the terms written out by hand from the in-process coefficients."""
    served = StepCostModel(TRUE, decode_factor=1.5, prefill_factor=0.8, serving_step_s=0.003, serving_token_s=4e-5)
    shape = shape_of([(10, 1, True), (0, 8, False), (8, 4, True), (99, 1, True)])
    decode = (TRUE["step"] + (TRUE["token"] + TRUE["decode_seq"]) * 2 + TRUE["decode_attention"] * 111
              + TRUE["sampled"] * 3)
    prefill = (TRUE["token"] * 12 + TRUE["prefill_seq"] * 2 + TRUE["prefill_attention"] * 112
               + TRUE["token_squared"] * 14 * 12)
    assert StepCostModel(TRUE).predict(shape) == pytest.approx(decode + prefill, rel=1e-12)
    assert served.predict(shape) == pytest.approx(1.5 * decode + 0.8 * prefill + 0.003 + 3 * 4e-5, rel=1e-12)
    decodes = shape_of([(50, 1, True)] * 4)
    assert served.decode_run(4, 200, 3) == pytest.approx(
        sum(served.predict(StepShape(4, 0, 4, 0, 200 + 4 * k, 4)) for k in range(3)), rel=1e-12)
    assert served.in_process().predict(decodes) == StepCostModel(TRUE).predict(decodes)


def test_fit_serving_recovers_the_factors_and_the_spread_of_served_steps():
    """Served steps made from the in-process model with known corrections: noiseless, the fit returns them; with
    a log-normal factor of sigma 0.25 on every step, it still finds them closely and measures the sigma."""
    import math

    truth = StepCostModel(TRUE, decode_factor=1.4, prefill_factor=0.9, serving_step_s=0.002, serving_token_s=5e-5)
    shapes = random_shapes(400, seed=3)
    fitted = StepCostModel(TRUE, client_s=0.005).fit_serving(shapes, [truth.predict(s) for s in shapes])
    assert (fitted.decode_factor, fitted.prefill_factor, fitted.serving_step_s, fitted.serving_token_s) == \
        pytest.approx((1.4, 0.9, 0.002, 5e-5))
    assert fitted.jitter == pytest.approx(0.0, abs=1e-9) and fitted.client_s == 0.005
    assert fitted.coefficients == TRUE and fitted.meta["num_served_steps"] == 400

    rng = random.Random(5)
    noisy = [truth.predict(s) * math.exp(0.25 * rng.gauss(0, 1) - 0.25 ** 2 / 2) for s in shapes]
    fitted = StepCostModel(TRUE).fit_serving(shapes, noisy)
    # the factors and the per-token term may trade (decode sequences all sample); the predictions may not
    truth_ms, fitted_ms = (sum(m.predict(s) for s in shapes) for m in (truth, fitted))
    assert fitted_ms == pytest.approx(truth_ms, rel=0.03)
    assert fitted.prefill_factor == pytest.approx(0.9, rel=0.1) and fitted.jitter == pytest.approx(0.25, rel=0.15)
    decodes_only = [shape_of([(40, 1, True)] * b) for b in (1, 2, 4, 8, 16)]  # no prefill work: its factor stays 1
    assert StepCostModel(TRUE).fit_serving(decodes_only, [truth.predict(s) for s in decodes_only]).prefill_factor == 1
    with pytest.raises(ValueError):
        StepCostModel(TRUE).fit_serving(shapes[:3], [0.01, 0.0, 0.01])
    # a plan that only releases finished requests (no tokens) is logged but is no step: it changes nothing
    with_release = StepCostModel(TRUE).fit_serving(shapes + [StepShape()], [truth.predict(s) for s in shapes] + [5e-4])
    assert with_release.serving_step_s == pytest.approx(0.002) and with_release.meta["num_served_steps"] == 400


def test_jitter_persistence_finds_the_slow_part_of_the_spread():
    """Steps of 10 ms whose log factor is a slow part (60% of the variance, correlation exp(-t / 0.3 s)) plus a
    fresh one: the share and the time constant come back; independent factors give none."""
    import math

    rng = random.Random(11)
    sigma, share, memory, step = 0.25, 0.6, 0.3, 0.01
    keep, slow, log_ratio = math.exp(-step / memory), 0.0, []
    for _ in range(20000):
        slow = keep * slow + math.sqrt(1 - keep * keep) * sigma * math.sqrt(share) * rng.gauss(0, 1)
        log_ratio.append(slow + sigma * math.sqrt(1 - share) * rng.gauss(0, 1))
    found_share, found_memory = jitter_persistence(log_ratio, [step] * len(log_ratio))
    assert found_share == pytest.approx(share, abs=0.08) and found_memory == pytest.approx(memory, rel=0.3)
    assert jitter_persistence([rng.gauss(0, 0.25) for _ in range(20000)], [step] * 20000) == (0.0, 0.0)


def test_profile_round_trips_through_json(tmp_path):
    model = StepCostModel(TRUE, scheduler_s=1e-4, client_s=2e-3, meta={"model": "x"}, jitter=0.3,
                          decode_factor=1.2, prefill_factor=0.9, serving_step_s=4e-3, serving_token_s=1e-5,
                          ingress_s=7e-4, egress_s=5e-5, jitter_slow_share=0.6, jitter_memory_s=0.3, cores=2.0,
                          cpu_decode_factor=0.8, cpu_prefill_factor=0.7, egress_step_s=3e-4,
                          client_cpu_request_s=1e-3, client_cpu_token_s=9e-5, cpu_weights={"worker": 1.5},
                          speed_trace=[1.1, 0.8, 1.1], speed_interval_s=0.5)
    model.save(tmp_path / "p.json")
    loaded = StepCostModel.load(tmp_path / "p.json")
    assert loaded == model  # every field, each set to a value other than its default
    assert all(getattr(model, f.name) != f.default for f in dataclasses.fields(StepCostModel)
               if f.default is not dataclasses.MISSING)
    shape = shape_of([(3, 1, True), (0, 30, True)])
    assert loaded.predict(shape) == model.predict(shape)


def test_worker_seconds_with_shared_cores_are_the_served_parts_scaled():
    """Without cores the simulator runs predict(); with them, the served fit's decode part (with its per-step and
    per-token terms) times cpu_decode_factor plus its prefill part times cpu_prefill_factor."""
    served = StepCostModel(TRUE, decode_factor=1.2, prefill_factor=1.5, serving_step_s=1e-3, serving_token_s=2e-5)
    shape = shape_of([(40, 1, True), (41, 1, True), (0, 30, True)])
    assert served.worker_seconds(shape) == served.predict(shape)
    shared = dataclasses.replace(served, cores=2.0, cpu_decode_factor=0.5, cpu_prefill_factor=0.25)
    decode, prefill = served.parts(shape)
    assert shared.worker_seconds(shape) == pytest.approx(
        0.5 * (1.2 * decode + 1e-3 + 2e-5 * 3) + 0.25 * 1.5 * prefill)
    assert shared.worker_seconds(shape_of([])) == 0.0
    with pytest.raises(ValueError):
        StepCostModel({"bogus": 1.0})
