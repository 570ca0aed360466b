"""`shuttle simulate` and `shuttle tune` end to end on a synthetic profile (no model, no server): the
simulation reproduces bench_serve.py's workload, and the sweep writes its plots and a recommendation."""

import json
import random
from pathlib import Path

import pytest

from shuttle.capacity import bench_serve, simulate, tune
from shuttle.scheduler.step_cost import StepCostModel
from tests.server import MODEL_DIR


@pytest.fixture
def profile(tmp_path) -> Path:
    path = tmp_path / "profile.json"
    StepCostModel({"step": 0.003, "token": 2e-5, "sequence": 1e-4, "prefill_attention": 1e-9}, client_s=0.001,
                  meta={"max_model_len": 512, "vocab_size": 512, "kv_bytes_per_token": 1280}).save(path)
    return path


def test_bench_serve_workload_is_bench_serves_own():
    workload = simulate.bench_serve_workload(50, 20.0, 64, 16, 0.5, 4, 512, seed=3)
    specs = bench_serve.random_workload(50, 64, 16, 0.5, 4, 512, 3)
    rng, gaps = random.Random(4), []
    assert [w.prompt_token_ids for w in workload] == [s.prompt for s in specs]
    assert [w.output_len for w in workload] == [s.max_tokens for s in specs]
    for _ in range(49):
        gaps.append(rng.expovariate(20.0))
    assert [b.arrival - a.arrival for a, b in zip(workload, workload[1:])] == pytest.approx(gaps)


def test_simulate_prints_and_writes_the_summary(profile, tmp_path, capsys):
    out = tmp_path / "sim.json"
    assert simulate.main(["--profile", str(profile), "--num-prompts", "40", "--request-rate", "30",
                          "--result-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["completed"] == 40 and data["timeline"] and data["ttft_ms"]["p99"] > 0
    assert "TTFT" in capsys.readouterr().out


def test_tune_writes_plots_and_recommends(profile, tmp_path):
    assert tune.main(["--model", str(MODEL_DIR), "--profile", str(profile), "--ttft-slo-ms", "400",
                      "--itl-slo-ms", "60", "--num-prompts", "40", "--budgets", "128", "512", "--seqs", "4", "32",
                      "--rates", "5", "20", "80", "--verify", "0", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "tune.json").read_text())
    assert len(result["points"]) == 12
    chosen = result["recommendation"]
    meeting = [p for p in result["points"] if p["attainment"] >= 0.9]
    top = max(meeting, key=lambda p: p["goodput"])
    setting = (top["max_num_batched_tokens"], top["max_num_seqs"])
    assert (chosen["max_num_batched_tokens"], chosen["max_num_seqs"]) == setting
    # operated with headroom: the highest rate within 80% of the best one where the setting still meets them
    assert chosen["request_rate"] == max(p["request_rate"] for p in meeting if p["request_rate"] <= 0.8 * top[
        "request_rate"] and (p["max_num_batched_tokens"], p["max_num_seqs"]) == setting)
    for name in ("pareto.png", "timeline.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pareto_front():
    def point(thru, ttft):
        return tune.Point(1, 1, 1.0, {"request_throughput": thru, "ttft_ms": {"p99": ttft}})

    points = [point(1, 10), point(2, 20), point(2, 30), point(3, 15), point(0.5, 50)]
    front = tune.pareto(points, lambda p: p.summary["ttft_ms"]["p99"])
    assert [(p.throughput, p.summary["ttft_ms"]["p99"]) for p in front] == [(1, 10), (3, 15)]
