"""Issue 13, acceptance 4: a frontend "host" on 127.0.0.2 and a serving group "host" on 127.0.0.3, over tcp://
with CURVE keys shared by both (as two machines would share them), each its own launcher.

The frontend starts first with `--data-parallel-size 0 --engine-endpoint tcp://127.0.0.3:PORT` and answers 503
until the group joins; `shuttle engine --listen tcp://127.0.0.3:PORT` then joins it, and a streamed request is
served end to end, token-exact. A kill -9 of the remote scheduler is noticed by the frontend through the dropped
connection; the remote launcher restarts its group, which joins again. A frozen group (its processes stopped, its
connection open) is noticed by its silence to ZeroMQ's heartbeat.
"""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import pytest

from shuttle.common.ipc import CURVE_ENV, CurveKeys
from shuttle.frontend.engine.client import lost_connection_reason
from tests.client import stream_completion, stream_until_end
from tests.conftest import hf_greedy
from tests.server import MODEL_DIR, REPO, ShuttleServer

HANG = 120.0
STREAM_TOKENS = 400  # long enough to be in flight when the group freezes or drains
SILENCE_S = 8.0  # the frontend's --heartbeat-timeout: how long a frozen group goes unnoticed
IDS = [1, 403, 407, 261, 378]  # "Once upon a time"
LONG = {"prompt": IDS, "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0, "return_token_ids": True}


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def hosts():
    env = {CURVE_ENV: CurveKeys.generate().to_env()}
    endpoint = f"tcp://127.0.0.3:{free_port('127.0.0.3')}"
    frontend = ShuttleServer("--host", "127.0.0.2", "--data-parallel-size", "0", "--engine-endpoint", endpoint,
                             "--heartbeat-timeout", str(SILENCE_S), env=env)
    try:
        yield frontend, endpoint, lambda: ShuttleServer("--listen", endpoint, command="engine", env=env)
    finally:
        frontend.stop()


async def wait_health(session, url, status: int) -> dict:
    deadline = time.monotonic() + HANG
    while True:
        async with session.get(f"{url}/health") as response:
            if response.status == status:
                return await response.json()
        assert time.monotonic() < deadline, f"/health never answered {status}"
        await asyncio.sleep(0.05)


async def streams_greedy(session, url: str) -> None:
    """A streamed request is served end to end, token for token as transformers' greedy generate."""
    events = await stream_completion(session, url, prompt=IDS, max_tokens=16, temperature=0, return_token_ids=True)
    assert [t for e in events for c in e["choices"] for t in c.get("token_ids") or []] == hf_greedy(IDS, 16)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


async def test_remote_group_joins_serves_a_stream_and_comes_back(hosts):
    frontend, endpoint, start_engine = hosts
    assert frontend.url.startswith("http://127.0.0.2:")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        waiting = await wait_health(session, frontend.url, 503)  # no group yet
        assert waiting["status"] == "engine_down" and waiting["groups"][0]["endpoint"] == endpoint
        engine = start_engine()
        try:
            assert engine.ready_info["endpoint"] == endpoint and "frontend" not in engine.pids
            body = await wait_health(session, frontend.url, 200)
            assert body["groups"][0]["status"] == "ok"
            await streams_greedy(session, frontend.url)
            os.kill(engine.pids["scheduler"], signal.SIGKILL)
            down = await wait_health(session, frontend.url, 503)
            assert down["groups"][0]["reason"] == lost_connection_reason(endpoint, SILENCE_S)
            engine.wait_restarts(1)
            await wait_health(session, frontend.url, 200)
            await streams_greedy(session, frontend.url)

            # A frozen host: the group's processes stop, its connection stays open. The frontend notices within
            # its --heartbeat-timeout, ends the stream in flight with one error, and takes the group back once it
            # runs again.
            started = asyncio.Event()
            stream = asyncio.create_task(stream_until_end(session, frontend.url, LONG, started))
            await asyncio.wait_for(started.wait(), HANG)
            group = os.getpgid(engine.pids["scheduler"])
            os.killpg(group, signal.SIGSTOP)
            try:
                frozen = time.monotonic()
                down = await wait_health(session, frontend.url, 503)
                assert time.monotonic() - frozen >= SILENCE_S * 0.9
                assert down["groups"][0]["reason"] == lost_connection_reason(endpoint, SILENCE_S)
                ended = await asyncio.wait_for(stream, HANG)
                assert ended[-1]["error"]["code"] == 503 and all("error" not in e for e in ended[:-1])
            finally:
                os.killpg(group, signal.SIGCONT)
            await wait_health(session, frontend.url, 200)
            await streams_greedy(session, frontend.url)

            # SIGTERM drains the group: the stream in flight finishes whole, new requests are refused meanwhile.
            started = asyncio.Event()
            stream = asyncio.create_task(stream_until_end(session, frontend.url, LONG, started))
            await asyncio.wait_for(started.wait(), HANG)
            os.killpg(os.getpgid(engine.proc.pid), signal.SIGTERM)  # the whole group, as systemd stops it
            draining = await wait_health(session, frontend.url, 503)
            assert "draining" in draining["groups"][0]["reason"]
            async with session.post(f"{frontend.url}/v1/completions", json={"prompt": IDS, "max_tokens": 2}) as refused:
                assert refused.status == 503
            ended = await asyncio.wait_for(stream, HANG)
            assert ended[-1]["choices"][0]["finish_reason"] == "length", ended[-1]
            assert sum(len(e["choices"][0]["token_ids"]) for e in ended) == STREAM_TOKENS
            assert engine.proc.wait(HANG) == 0
        finally:
            engine.stop()


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != CURVE_ENV} | (env or {})
    return subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", *args], cwd=REPO, capture_output=True,
                          text=True,
                          timeout=60, env=env)


def test_tcp_between_hosts_needs_curve_keys():
    for args in (["serve", str(MODEL_DIR), "--engine-endpoint", "tcp://127.0.0.3:7100"],
                 ["engine", str(MODEL_DIR), "--listen", "tcp://127.0.0.3:7100"]):
        result = run_cli(*args)
        assert result.returncode == 2 and "SHUTTLE_CURVE_KEYS" in result.stderr, result.stderr
        assert result.stderr.strip().count("\n") == 0
    result = run_cli("serve", str(MODEL_DIR), "--data-parallel-size", "0")
    assert result.returncode == 2 and "--engine-endpoint" in result.stderr
    result = run_cli("serve", str(MODEL_DIR), "--engine-endpoint", "ipc:///tmp/x", "--engine-endpoint", "ipc:///tmp/x")
    assert result.returncode == 2 and "--engine-endpoint ipc:///tmp/x is given twice" in result.stderr


def test_curve_keys_are_made_for_the_environment():
    result = run_cli("curve-keys")
    assert result.returncode == 0
    keys = CurveKeys(**json.loads(result.stdout))
    assert len(keys.server_public) == len(keys.client_secret) == 40
