"""The ZeroMQ batch endpoint end to end on stories260K: completions and chat bodies in, the same greedy texts and
tokens as HTTP out (HTTP's greedy tokens are checked against transformers' in test_e2e_greedy.py), and
`shuttle batch` on an OpenAI batch file."""

import json
import subprocess
import sys
import urllib.request

from shuttle.batch_jobs.client import BatchClient
from tests.server import REPO

PROMPTS = ["Once upon a time", "Tom had a dog", "Lily saw a big", "The sun was"]


def http(server, path: str, body: dict) -> dict:
    request = urllib.request.Request(f"{server.url}{path}", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_batch_jobs_match_http(server):
    jobs = [{"custom_id": f"j{i}", "url": "/v1/completions",
             "body": {"prompt": p, "max_tokens": 20 + i, "temperature": 0, "return_token_ids": True}}
            for i, p in enumerate(PROMPTS)]
    jobs.append({"custom_id": "chat", "url": "/v1/chat/completions",
                 "body": {"messages": [{"role": "user", "content": "Tom had a red ball."}], "max_tokens": 12,
                          "temperature": 0}})
    jobs.append({"custom_id": "huge", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 100_000}})
    with BatchClient(server.batch_endpoint, 3) as client:
        results = {r.job_id: r for r in client.run(jobs)}
    assert sorted(results) == sorted(j["custom_id"] for j in jobs)
    for i in range(len(PROMPTS)):
        choice, expected = results[f"j{i}"].body["choices"][0], http(server, "/v1/completions", jobs[i]["body"])
        assert results[f"j{i}"].status_code == 200 and choice["token_ids"]
        assert (choice["text"], choice["token_ids"]) == (expected["choices"][0]["text"],
                                                         expected["choices"][0]["token_ids"])
    chat = results["chat"].body["choices"][0]["message"]
    assert chat == http(server, "/v1/chat/completions", jobs[4]["body"])["choices"][0]["message"]
    assert results["huge"].status_code == 400 and results["huge"].body["error"]["param"] == "max_tokens"


def test_shuttle_batch_round_trip(server, tmp_path):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": p, "max_tokens": 8, "temperature": 0}} for i, p in enumerate(PROMPTS)]
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "batch", str(tmp_path / "in.jsonl"), str(out),
                           "--endpoint", server.batch_endpoint], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "4/4" in done.stderr  # the progress bar's last state
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(records) == ["c0", "c1", "c2", "c3"]
    for i, line in enumerate(lines):
        response = records[f"c{i}"]["response"]
        assert response["status_code"] == 200 and records[f"c{i}"]["error"] is None
        assert response["request_id"] == response["body"]["id"]
        assert response["body"]["choices"][0]["text"] == http(server, "/v1/completions",
                                                              line["body"])["choices"][0]["text"]
