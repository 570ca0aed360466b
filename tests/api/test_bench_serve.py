"""`shuttle bench` (capacity/bench_serve.py): against a live server (counts and its JSON), and against a raw server
that behaves as llama.cpp's llama-server does (no vocab_size, connections closed after each response)."""

import asyncio
import json
import subprocess
import sys

import pytest

from shuttle.capacity import bench_serve
from tests.server import REPO


def test_bench_serve_tiny(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "bench", "--url", server.url,
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


class ClosingServer:
    """A raw HTTP server as llama.cpp's llama-server behaves: /v1/models without vocab_size, and each streamed
    completion answered with `Connection: keep-alive` and then the connection closed. Counts connections."""

    STREAM = b"".join(b'data: {"choices": [{"text": "%s"}]}\n\n' % t for t in (b"a", b"b")) + \
        b'data: {"choices": [], "usage": {"completion_tokens": 2, "prompt_tokens": 3}}\n\ndata: [DONE]\n\n'

    def __init__(self):
        self.connections = 0

    async def handle(self, reader, writer):
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length")), 0)
        await reader.readexactly(length)
        if head.startswith(b"GET /v1/models"):
            body, kind = b'{"data": [{"id": "m"}]}', b"application/json"
        else:
            body, kind = self.STREAM, b"text/event-stream"
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (kind, len(body), body))
        await writer.drain()
        writer.close()


async def test_one_connection_per_request_against_a_server_that_closes_them(unused_tcp_port):
    fake = ClosingServer()
    listening = await asyncio.start_server(fake.handle, "127.0.0.1", unused_tcp_port)
    async with listening:
        specs = bench_serve.random_workload(6, 4, 2, 0.0, 0, 100, 0)
        results, _ = await bench_serve.run_benchmark(f"http://127.0.0.1:{unused_tcp_port}", specs, float("inf"), 2,
                                                     0, False, keep_alive=False)
    assert [(r.ok, r.output_tokens, r.error) for r in results] == [(True, 2, "")] * 6
    assert fake.connections == 1 + 6  # /v1/models, then one per request


async def test_a_server_that_reports_no_vocab_size_needs_the_flag(unused_tcp_port, monkeypatch, capsys):
    listening = await asyncio.start_server(ClosingServer().handle, "127.0.0.1", unused_tcp_port)
    async with listening:
        assert await bench_serve.served_vocab_size(f"http://127.0.0.1:{unused_tcp_port}", None) is None

    async def reports_none(url, api_key):
        return None
    monkeypatch.setattr(bench_serve, "served_vocab_size", reports_none)
    with pytest.raises(SystemExit) as exited:
        await asyncio.to_thread(bench_serve.main, ["--url", "http://127.0.0.1:1", "--no-progress"])
    assert exited.value.code == 2
    assert "reports no vocab_size: pass --vocab-size" in capsys.readouterr().err.strip().splitlines()[-1]
