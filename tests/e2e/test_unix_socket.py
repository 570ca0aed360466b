"""Issue 43: `shuttle serve --uds PATH --root-path /llm` for real: the launcher reports the socket it serves on (no
TCP URL it does not listen on) and its batch endpoint beside it (ipc://PATH.batch), a killed frontend comes back on the
same socket, and a stopped server removes both."""

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp

from shuttle.batch_jobs.client import BatchClient
from tests.conftest import hf_greedy
from tests.server import ShuttleServer

HANG = 120.0
PROMPT = [1, 403, 407, 261, 378]  # "Once upon a time"


async def _health(path: str, route: str = "/llm/health") -> int:
    connector = aiohttp.UnixConnector(path=path)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        async with session.get(f"http://localhost{route}") as response:
            return response.status


async def _greedy(path: str) -> list[int]:
    connector = aiohttp.UnixConnector(path=path)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        async with session.post("http://localhost/llm/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}) as response:
            assert response.status == 200, await response.text()
            return (await response.json())["choices"][0]["token_ids"]


async def _wait_serving(path: str) -> None:
    deadline = time.monotonic() + HANG
    while True:
        try:
            if await _health(path) == 200:
                return
        except aiohttp.ClientError:
            pass  # the frontend is restarting
        assert time.monotonic() < deadline, "no answer on the socket"
        await asyncio.sleep(0.1)


async def test_serve_on_a_unix_socket_under_a_root_path(tmp_path):
    path = str(tmp_path / "shuttle.sock")
    with ShuttleServer("--uds", path, "--root-path", "/llm", "--uvicorn-log-level", "warning") as server:
        assert server.url == f"unix:{path}"
        # the batch endpoint beside the HTTP socket, not on TCP PORT+1, where two --uds servers would collide
        assert server.batch_endpoint == f"ipc://{path}.batch"
        assert any(line.startswith(f"shuttle: serving stories260K at unix:{path}, batch jobs at ipc://{path}.batch ")
                   for line in server.output), server.output
        expected = hf_greedy(PROMPT, 12)
        assert await _greedy(path) == expected
        with BatchClient(server.batch_endpoint, 1) as client:  # the ipc:// endpoint serves batch jobs
            (result,) = client.run([{"custom_id": "b", "url": "/v1/completions", "body": {
                "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}}])
        assert (result.status_code, result.body["choices"][0]["token_ids"]) == (200, expected)
        assert await _health(path, "/health") == 200  # without the prefix too
        restarts = server.restarts
        os.kill(server.pids["frontend"], signal.SIGKILL)
        server.wait_restarts(restarts + 1)  # on the same socket, which the dead frontend left behind
        await _wait_serving(path)
        assert await _greedy(path) == expected
    assert not Path(path).exists() and not Path(f"{path}.batch").exists()
