"""Acceptance: Ctrl-C stops every process; a dying child stops the group with a non-zero exit; bad model dirs
are a one-line error with status 2."""

import os
import signal
import subprocess
import sys
import time

import aiohttp

from tests.client import post_completion
from tests.server import REPO, ShuttleServer, pid_alive


def test_ctrl_c_leaves_no_process():
    srv = ShuttleServer()
    try:
        assert all(pid_alive(p) for p in srv.all_pids)
        started = time.monotonic()
        os.killpg(srv.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert srv.proc.wait(10) == 0
        assert srv.wait_gone(5.0) == [], "processes left behind"
        assert time.monotonic() - started < 5.0
    finally:
        srv.stop()


def test_killed_worker_stops_everything_nonzero():
    srv = ShuttleServer()
    try:
        os.kill(srv.pids["worker"], signal.SIGKILL)
        assert srv.proc.wait(10) == 1
        assert srv.wait_gone(5.0) == []
        assert any("worker" in line and "SIGKILL" in line for line in srv.output), srv.output
    finally:
        srv.stop()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "common.cli", "serve", *args, "--port", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_missing_model_dir_is_one_line_error(tmp_path):
    result = run_cli(str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr


def test_malformed_config_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    result = run_cli(str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "config.json" in result.stderr


async def test_tcp_transport_serves():
    srv = ShuttleServer("--zmq-transport", "tcp")
    try:
        async with aiohttp.ClientSession() as session:
            status, body = await post_completion(session, srv.url, prompt="Hello", max_tokens=4, temperature=0)
        assert status == 200 and body["usage"]["completion_tokens"] <= 4
    finally:
        srv.stop()


async def test_in_flight_requests_get_an_error_when_the_worker_dies():
    import asyncio
    import json

    srv = ShuttleServer("--debug-step-delay", "0.2")
    try:
        async with aiohttp.ClientSession() as session:
            long_job = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
            plain = asyncio.create_task(post_completion(session, srv.url, **long_job))
            async with session.post(f"{srv.url}/v1/completions", json={**long_job, "stream": True}) as response:
                await response.content.readline()
                os.kill(srv.pids["worker"], signal.SIGKILL)
                events = [line.decode().strip() async for line in response.content if line.startswith(b"data: ")]
            status, body = await plain
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == 503
        assert status == 503 and body["error"]["code"] == 503
        assert srv.proc.wait(10) == 1
    finally:
        srv.stop()
