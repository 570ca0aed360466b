"""The step-cost model: shapes of steps, the non-negative fit, the closed-form decode run, the JSON profile."""

import dataclasses
import random

import pytest

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


def test_profile_round_trips_through_json(tmp_path):
    model = StepCostModel(TRUE, scheduler_s=1e-4, client_s=2e-3, meta={"model": "x"})
    model.save(tmp_path / "p.json")
    loaded = StepCostModel.load(tmp_path / "p.json")
    assert loaded == model  # every field, each set to a value other than its default
    assert all(getattr(model, f.name) != f.default for f in dataclasses.fields(StepCostModel)
               if f.default is not dataclasses.MISSING)
    shape = shape_of([(3, 1, True), (0, 30, True)])
    assert loaded.predict(shape) == model.predict(shape)


def test_unknown_features_and_negative_values_are_refused():
    with pytest.raises(ValueError, match="unknown cost model features"):
        StepCostModel({"bogus": 1.0})
    with pytest.raises(ValueError, match="scheduler_s"):
        StepCostModel({"step": 1e-3}, scheduler_s=-1.0)
