"""scripts/gpu_check.sh --dry-run: the whole GPU check on the CPU with tiny shapes, so that a GPU run is not spent
on the script's own bugs. Slow: its bench stage starts `shuttle serve` (about a minute and a half on two cores)."""

import json
import os
import subprocess

import pytest

from tests.server import MODEL_DIR, REPO

STAGES = ("exact", "bf16", "compiles", "graphs", "spec", "roofline", "bench")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_dry_run_passes_every_stage(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "SHUTTLE_TEST_MODEL": str(MODEL_DIR)}
    done = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    log = (tmp_path / "gpu_check.log").read_text()
    table = log[log.rindex("\nshuttle GPU check ("):]  # the table ends the log
    assert any(line.startswith("torch ") and " transformers " in line for line in log.splitlines()), log[:2000]
    assert "shuttle GPU check (dry run, device cpu)" in table
    for stage in STAGES:
        record = json.loads((tmp_path / f"{stage}.json").read_text())
        assert record["status"] in ("pass", "skipped"), record
        assert f"\n{stage:<10}{record['status']:<9}" in table
    assert json.loads((tmp_path / "exact.json").read_text())["mismatched"] == []
    assert json.loads((tmp_path / "compiles.json").read_text())["second_run_graphs"] == 0
    roofline = json.loads((tmp_path / "roofline.json").read_text())
    assert [row["batch"] for row in roofline["rows"]] == [1, 4]
    assert all(row["step_ms"] > 0 and row["floor_ms"] > 0 and row["ratio"] > 0 for row in roofline["rows"])
    assert roofline["rows"][-1]["profile"]["gemm"] > 0  # the largest step profiled
    bench = json.loads((tmp_path / "bench.json").read_text())
    shuttle = bench["rows"][0]
    assert shuttle["method"] == "shuttle" and shuttle["ttft_p50_ms"] > 0 and shuttle["itl_p50_ms"] > 0
    assert bench["engine"]["kv_blocks"] == 256 and bench["engine"]["step_over_bare"] > 0
    # what comes back from the device tool's $OUT: at most 8 plain files, none deeper than two folders
    assert len([p for p in tmp_path.rglob("*") if p.is_file()]) <= 8
