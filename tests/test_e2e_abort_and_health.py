"""Acceptance: the frontend never waits on model work, and a client that leaves frees its KV blocks at once.

The worker is slowed by the SHUTTLE_DEBUG_STEP_DELAY test hook (ShuttleServer's step_delay) so steps are long and requests stay in flight. Waits
are bounds that only a hang exceeds.
"""

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from tests.client import health
from tests.server import ShuttleServer

STEP_DELAY = 0.4


@pytest.fixture(scope="module")
def slow_server():
    srv = ShuttleServer(step_delay=STEP_DELAY)
    yield srv
    srv.stop()


LONG = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}


async def wait_all_blocks_free(session, url, within: float) -> dict:
    deadline = time.monotonic() + within
    while True:
        stats = (await health(session, url))["scheduler"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0 and \
                stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        assert time.monotonic() < deadline, f"blocks not freed within {within} s: {stats}"
        await asyncio.sleep(0.05)


async def blocks_in_use(session, url) -> int:
    stats = (await health(session, url))["scheduler"]
    return stats["num_total_blocks"] - stats["num_free_blocks"]


async def test_health_answers_while_the_worker_is_stopped(slow_server):
    """With the worker frozen mid-step (SIGSTOP; well within the default 60 s step timeout), /health still
    answers: it never waits on the model. No clock is involved, only a bound that a hang would exceed."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{slow_server.url}/v1/completions", json={**LONG, "stream": True}) as response:
            await response.content.readline()  # the first token: steps are running now
            os.kill(slow_server.pids["worker"], signal.SIGSTOP)
            try:
                for _ in range(10):
                    stats = await asyncio.wait_for(health(session, slow_server.url), 10)
                    assert stats["status"] == "ok" and stats["scheduler"]["num_running"] == 1
            finally:
                os.kill(slow_server.pids["worker"], signal.SIGCONT)


async def test_sse_disconnect_frees_blocks(slow_server):
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{slow_server.url}/v1/completions", json={**LONG, "stream": True})
        for _ in range(4):
            await response.content.readline()
        assert await blocks_in_use(session, slow_server.url) > 0
        response.close()  # drop the connection mid-stream
        await wait_all_blocks_free(session, slow_server.url, within=30.0)


async def test_non_streaming_disconnect_frees_blocks(slow_server):
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(f"{slow_server.url}/v1/completions", json=LONG))
        deadline = time.monotonic() + 10
        while (await health(session, slow_server.url))["scheduler"]["num_running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        task.cancel()
        await wait_all_blocks_free(session, slow_server.url, within=30.0)


async def test_websocket_cancel_and_close_free_blocks(slow_server):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{slow_server.url}/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": "c", **LONG})
            assert (await ws.receive_json(timeout=30))["type"] == "delta"
            await ws.send_json({"type": "cancel", "id": "c"})
            while (msg := await ws.receive_json(timeout=10))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["finish_reason"] == "abort"
            await wait_all_blocks_free(session, slow_server.url, within=30.0)

            await ws.send_json({"type": "generate", "id": "d", **LONG})
            assert (await ws.receive_json(timeout=30))["type"] == "delta"
        # the socket is closed now, with "d" still generating
        await wait_all_blocks_free(session, slow_server.url, within=30.0)
