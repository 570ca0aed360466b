"""The step-cost model: shapes of steps, the non-negative fit, the closed-form decode run, the JSON profile."""

import dataclasses
import json
import random

import pytest

from shuttle.scheduler.step_cost import (
    FEATURES,
    Roofline,
    StepCostModel,
    StepShape,
    features,
    fit_scheduler_seconds,
    shape_of,
    spread_of,
)

TRUE = {"step": 2e-3, "sequence": 1e-4, "prefill_sequence": 5e-4, "token": 3e-5, "dense": 1.5, "prefill_attention": 4.0,
        "decode_attention": 9.0}
# a small model on a small device, dimensions chosen so that each term is easy to write out by hand
ROOF = Roofline(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=32, dtype_bytes=2,
                peak_flops=1e9, bandwidth=1e8, device="test")


def random_shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    shapes = []
    for _ in range(n):
        chunks = [(rng.randrange(0, 500), 1, True) for _ in range(rng.randrange(0, 64))]
        chunks += [(rng.randrange(0, 300), rng.randrange(2, 512), rng.random() < 0.5) for _ in range(rng.randrange(0,
                                                                                                                   4))]
        if not chunks:
            chunks = [(0, 7, True)]
        shapes.append(shape_of(chunks))
    return shapes


def test_shape_of_counts_tokens_sequences_and_attention_pairs():
    shape = shape_of([(10, 1, True), (0, 8, False), (8, 4, True), (99, 1, True)])
    assert shape == StepShape(num_tokens=14, num_prefill_seqs=2, num_decode_seqs=2,
                              prefill_attention=8 * 8 + 4 * 12, decode_attention=11 + 100, num_sampled=3)
    assert features(shape, None) == (1.0, 4, 2, 14, 14, 112, 111)


def test_the_roofline_by_hand():
    """ROOF's layer: q 8x8, k and v 8x4 each, o 8x8, MLP 3 x 8x16: 576 weights; 2 layers + an LM head of 8x32:
    1,408 weights, 2,816 bytes. KV per token: 2 x 2 layers x 1 head x 4 x 2 bytes = 32 B. A decode of 4 sequences
    over 100 context tokens each: dense FLOPs 2 x (4 x 1,152 + 4 x 256) = 11,264 (11.3 us at 1 GFLOP/s), bytes
    2,816 + 4 x 32 + 4 x 4 x 32 = 3,456 (34.6 us at 100 MB/s): memory-bound. Its attention reads 400 x 32 B
    (128 us) for 4 x 2 x 2 x 4 x 400 = 25,600 FLOPs (25.6 us). A prefill of 1,000 tokens is compute-bound:
    2 x (1,000 x 1,152 + 256) FLOPs = 2.304512 ms against (2,816 + 32,000 + 128) B = 0.349 ms."""
    assert ROOF.layer_params == 576 and ROOF.kv_bytes_per_token == 32
    decode = StepShape(4, 0, 4, 0, 400, 4)
    assert ROOF.dense_flops(decode) == 11264 and ROOF.dense_bytes(decode) == 3456
    assert ROOF.seconds(decode) == pytest.approx((3456e-8, 0.0, 128e-6))
    prefill = StepShape(1000, 1, 0, 1000 * 1000, 0, 1)
    assert ROOF.seconds(prefill) == pytest.approx((2.304512e-3, 64e6 / 1e9, 0.0))
    model = StepCostModel(TRUE, ROOF)
    assert model.predict(decode) == pytest.approx(2e-3 + 4e-4 + 4 * 3e-5 + 1.5 * 3456e-8 + 9.0 * 128e-6)


def test_a_roofline_refuses_a_zero_dimension():
    with pytest.raises(ValueError, match="peak_flops 0"):
        dataclasses.replace(ROOF, peak_flops=0.0)


def test_fit_recovers_the_coefficients_of_noiseless_data():
    truth = StepCostModel(TRUE, ROOF)
    shapes = random_shapes(60)
    model = StepCostModel.fit(shapes, [truth.predict(s) for s in shapes], roofline=ROOF)
    assert model.roofline == ROOF
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
    # without a roofline the dense term counts tokens too: a decode's sequence, token and dense terms are one
    assert model.coefficients["sequence"] + model.coefficients["token"] + model.coefficients["dense"] == \
        pytest.approx(0.0006, rel=1e-6)


def test_fit_rejects_too_few_or_non_positive_measurements():
    with pytest.raises(ValueError):
        StepCostModel.fit(random_shapes(3), [0.01] * 3)
    with pytest.raises(ValueError):
        StepCostModel.fit(random_shapes(10), [0.01] * 9 + [0.0])


def test_decode_run_is_the_sum_of_its_steps():
    model = StepCostModel(TRUE, ROOF)
    seqs, contexts, steps = 5, 5 * 40, 7
    summed = sum(model.predict(StepShape(seqs, 0, seqs, 0, contexts + seqs * k, seqs)) for k in range(steps))
    assert model.decode_run(seqs, contexts, steps) == pytest.approx(summed, rel=1e-12)
    assert model.decode_run(seqs, contexts, 0) == 0.0 and model.predict(StepShape()) == 0.0


def test_profile_round_trips_through_json(tmp_path):
    model = StepCostModel(TRUE, ROOF, scheduler_s=1e-4, scheduler_sequence_s=3e-6, client_s=2e-3,
                          spread=(0.9, 1.0, 1.25), meta={"model": "x"})
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


def test_the_spread_is_quantiles_of_the_step_ratios_and_is_read_back_by_probability():
    spread = spread_of([1.0, 3.0, 2.0, 5.0, 4.0], quantiles=4)  # sorted 1..5: probabilities 1/8, 3/8, 5/8, 7/8
    assert spread == pytest.approx((1.5, 2.5, 3.5, 4.5))
    model = StepCostModel({"step": 1e-3}, spread=spread)
    assert model.spread_factor(1 / 8) == pytest.approx(1.5)  # at a quantile's probability: that quantile
    assert model.spread_factor(0.5) == pytest.approx(3.0)  # between two: linear
    assert (model.spread_factor(0.0), model.spread_factor(0.999)) == (1.5, 4.5)  # ends held
    assert StepCostModel({"step": 1e-3}).spread_factor(0.9) == 1.0  # no spread: every step its prediction
    assert spread_of([]) == ()
    for bad in [(1.2, 1.0), (0.0, 1.0), (-1.0,)]:
        with pytest.raises(ValueError, match="spread must be ascending positive"):
            StepCostModel({"step": 1e-3}, spread=bad)


def test_scheduler_seconds_per_step_and_per_sequence_are_fitted_from_measured_steps():
    shapes = [shape_of([(0, 1, True)] * n) for n in (1, 4, 16, 64)]
    seconds = [5e-5 + 4e-6 * n for n in (1, 4, 16, 64)]
    per_step, per_sequence = fit_scheduler_seconds(shapes, seconds)
    assert (per_step, per_sequence) == (pytest.approx(5e-5), pytest.approx(4e-6))
    model = StepCostModel({"step": 1e-3}, scheduler_s=per_step, scheduler_sequence_s=per_sequence)
    assert model.scheduler_seconds(shape_of([(0, 1, True)] * 10 + [(0, 32, True)])) == pytest.approx(5e-5 + 44e-6)
    assert fit_scheduler_seconds([], []) == (0.0, 0.0)


def test_a_profile_with_a_bad_roofline_is_named(tmp_path):
    path = tmp_path / "p.json"
    StepCostModel(TRUE, ROOF).save(path)
    data = json.loads(path.read_text())
    del data["roofline"]["vocab"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not a step-cost profile.*vocab"):
        StepCostModel.load(path)
