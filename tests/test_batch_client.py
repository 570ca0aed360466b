"""The ZeroMQ batch endpoint: text in, text out, the same validation and the same greedy tokens as HTTP."""

import json
import subprocess
import sys

import msgspec

from common.batch_client import BatchClient
from tests.conftest import hf_greedy, hf_tokenizer
from tests.server import REPO

PROMPTS = ["Once upon a time", "Tom had a dog", "Lily saw a big", "The sun was"]


def test_batch_jobs_match_transformers_and_bad_jobs_get_errors(server):
    jobs = [{"job_id": f"j{i}", "prompt": p, "max_tokens": 20 + i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    jobs.append({"job_id": "ids", "prompt": [1, 403, 407], "max_tokens": 5, "temperature": 0})
    jobs.append({"job_id": "bad", "prompt": "Hi", "max_tokens": -3})
    jobs.append({"job_id": "huge", "prompt": "Hi", "max_tokens": 100_000})
    with BatchClient(server.batch_endpoint, window=3) as client:
        results = {r.job_id: r for r in client.run(jobs)}
    assert sorted(results) == sorted(j["job_id"] for j in jobs)
    for i, prompt in enumerate(PROMPTS):
        ids = hf_tokenizer()(prompt).input_ids
        result = results[f"j{i}"]
        assert result.token_ids == hf_greedy(ids, 20 + i) and result.error_status == 0
        assert result.prompt_tokens == len(ids) and result.completion_tokens == len(result.token_ids)
        assert hf_tokenizer().decode(ids, skip_special_tokens=True) + result.text == hf_tokenizer().decode(
            ids + result.token_ids, skip_special_tokens=True)
    assert results["ids"].token_ids == hf_greedy([1, 403, 407], 5)
    assert results["bad"].error_status == 400 and "max_tokens" in results["bad"].error_message
    assert results["huge"].error_status == 400


def test_batch_script_round_trip(server, tmp_path):
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text("\n".join(msgspec.json.encode({"prompt": p, "max_tokens": 8, "temperature": 0}).decode()
                              for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "scripts/batch_client.py", str(jobs), str(out), "--endpoint",
                           server.batch_endpoint], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["job_id"] for r in results) == ["0", "1", "2", "3"]
    for r in results:
        assert r["error_status"] == 0 and r["text"] and (r["completion_tokens"] == 8 or r["finish_reason"] == "stop")
