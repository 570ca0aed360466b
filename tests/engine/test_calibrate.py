"""The in-process engine that the simulator is judged against (capacity/calibrate.py's Calibrator.serve), and the
report of step predictions against measured steps (scripts/dev/compare_inprocess.py)."""

import sys
from pathlib import Path

import pytest

from shuttle.capacity.calibrate import Calibrator, grid
from shuttle.capacity.workload import SimRequest
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.model_config import ModelConfig
from shuttle.scheduler.step_cost import StepCostModel, StepShape
from shuttle.worker.worker import ModelRunner
from tests.server import MODEL_DIR

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "dev"))

import compare_inprocess  # noqa: E402


def test_the_in_process_engine_serves_every_request_its_tokens():
    """Three requests, the last arriving later: each gets its output_len tokens, in time order, after it arrived;
    every step is recorded with its shape, and the steps sum to the tokens computed (prompts + outputs but the
    last, which is sampled, not fed back)."""
    calibrator = Calibrator(str(MODEL_DIR), num_kv_blocks=64)
    workload = [SimRequest(0.0, list(range(10, 30)), 4), SimRequest(0.0, list(range(40, 45)), 3),
                SimRequest(0.05, list(range(50, 58)), 2)]
    run = calibrator.serve(workload, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), 64)
    records = run.result.records
    assert [len(r.token_times) for r in records] == [4, 3, 2]
    for record in records:
        assert record.token_times == sorted(record.token_times) and record.token_times[0] >= record.arrival
    assert sum(shape.num_tokens for shape, _ in run.steps) == (20 + 3) + (5 + 2) + (8 + 1)
    assert all(seconds > 0 for _, seconds in run.steps) and run.result.summary()["completed"] == 3


def test_step_errors_by_kind():
    cost = StepCostModel({"step": 0.010})
    decode, prefill = StepShape(2, 0, 2, 0, 20, 2), StepShape(30, 1, 0, 900, 0, 1)
    report = compare_inprocess.step_errors(cost, [(decode, 0.008), (decode, 0.0125), (prefill, 0.020)])
    # 1.25 and 0.8: errors 0.25 and 0.2
    assert report["decode"]["steps"] == 2 and report["decode"]["median_abs_error"] == pytest.approx(0.225)
    assert report["prefill"] == {"steps": 1, "median_abs_error": pytest.approx(0.5),
                                 "p90_abs_error": pytest.approx(0.5),
                                 "median_ratio": pytest.approx(0.5), "time_weighted_ratio": pytest.approx(0.5),
                                 "measured_s": pytest.approx(0.020)}
    assert report["mixed"]["steps"] == 0 and report["all"]["steps"] == 3
    # predicted 0.030 s over measured 0.0405 s: what decides how fast a queue drains
    assert report["all"]["time_weighted_ratio"] == pytest.approx(0.030 / 0.0405)


def test_a_mixed_configuration_measures_decodes_beside_each_chunk_of_a_prompt():
    """4 decodes at context 32 (and growing) beside a 64-token prompt (4 x the chunk) in chunks of 16: four steps,
    each 4 decodes and one chunk, the chunk's context growing by 16 a step; the grid has such configurations."""
    calibrator = Calibrator(str(MODEL_DIR), num_kv_blocks=64)
    found = calibrator.measure("mixed", 4, 32, 16)
    assert [(m.shape.num_tokens, m.shape.num_prefill_seqs, m.shape.num_decode_seqs) for m in found] == [(20, 1, 4)] * 4
    assert [m.shape.prefill_attention for m in found] == [16 * 16, 16 * 32, 16 * 48, 16 * 64]
    assert all(m.seconds > 0 for m in found)
    assert ("mixed", 64, 128, 256) in grid(512, 2048, 128)


@pytest.mark.parametrize("max_model_len", [2, 7])
def test_a_tiny_max_model_len_passes_the_start_up_exactness_check(max_model_len):
    """A trial: `shuttle calibrate --max-model-len 1` (and serve with 1 to 7) was refused as "the model fails on
    shuttle's paged attention path": the check's probe sequences were cut to max_model_len, too short to split."""
    model = ModelConfig.from_dir(MODEL_DIR, max_model_len=max_model_len)
    runner = ModelRunner(ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                                       cache=CacheConfig(16, 8)))
    assert runner.check_difference <= 1e-3
