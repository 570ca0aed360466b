"""Acceptance: the frontend never waits on model work, and a client that leaves frees its KV blocks at once.

On the suite's `slow_server` (tests/conftest.py): every step is slowed by the worker's test hook, so requests
stay in flight. Waits
are bounds that only a hang exceeds.
"""

import asyncio
import os
import signal
import time

import aiohttp

from tests.client import health, wait_idle
from tests.conftest import SLOW_STEP_DELAY

STEP_DELAY = SLOW_STEP_DELAY


LONG = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True}


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
        await wait_idle(session, slow_server.url, within=30.0)


async def test_non_streaming_disconnect_frees_blocks(slow_server):
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(f"{slow_server.url}/v1/completions", json=LONG))
        deadline = time.monotonic() + 10
        while (await health(session, slow_server.url))["scheduler"]["num_running"] == 0:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        task.cancel()
        await wait_idle(session, slow_server.url, within=30.0)


async def test_websocket_cancel_and_close_free_blocks(slow_server):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{slow_server.url}/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": "c", **LONG})
            assert (await ws.receive_json(timeout=30))["type"] == "delta"
            await ws.send_json({"type": "cancel", "id": "c"})
            while (msg := await ws.receive_json(timeout=10))["type"] == "delta":
                pass
            assert msg["type"] == "done" and msg["finish_reason"] == "abort"
            await wait_idle(session, slow_server.url, within=30.0)

            await ws.send_json({"type": "generate", "id": "d", **LONG})
            assert (await ws.receive_json(timeout=30))["type"] == "delta"
        # the socket is closed now, with "d" still generating
        await wait_idle(session, slow_server.url, within=30.0)
