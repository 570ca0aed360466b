"""Issue 5 acceptance 2 (tiny version): bench_serve.py runs against a live server and writes its JSON."""

import json
import subprocess
import sys

from capacity import bench_serve
from tests.server import REPO


def test_bench_serve_tiny(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "launcher.cli", "bench", "--url", server.url,
                             "--num-prompts", "12", "--max-concurrency", "4", "--input-len", "32", "--output-len", "8",
                             "--ttft-slo-ms", "10000", "--result-json", str(out), "--no-progress",
                             "--save-requests", str(tmp_path / "requests.jsonl")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(out.read_text())
    assert summary["completed"] == 12 and summary["failed"] == 0
    workload = bench_serve.random_workload(12, 32, 8, 0.5, 0, 512, 0)
    # ignore_eos makes every request produce exactly its max_tokens
    assert summary["total_output_tokens"] == sum(w.max_tokens for w in workload)
    assert summary["total_input_tokens"] == sum(w.prompt_len for w in workload)
    assert summary["goodput"] == summary["request_throughput"]  # a 10 s TTFT SLO: every request meets it
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[key]) == {"mean", "median", "p90", "p99"} and summary[key]["p99"] >= summary[key]["median"]
    assert "TTFT" in result.stdout and "output throughput" in result.stdout
    # --save-requests: one line per request, in the order sent, each with its own lengths and latencies
    lines = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(lines) == 12 and lines[0]["sent_s"] == 0.0
    assert [line["sent_s"] for line in lines] == sorted(line["sent_s"] for line in lines)
    assert sorted(line["output_tokens"] for line in lines) == sorted(w.max_tokens for w in workload)
    assert all(len(line["itls_s"]) <= line["output_tokens"] - 1 and 0 < line["ttft_s"] <= line["e2e_s"]
               and line["error"] == "" for line in lines)
