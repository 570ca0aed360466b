"""Small HTTP/SSE/WebSocket helpers for end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp


async def post_completion(session: aiohttp.ClientSession, url: str, **body) -> tuple[int, dict]:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.json()


async def stream_completion(session: aiohttp.ClientSession, url: str, **body) -> list[dict]:
    """POST with stream=true; returns the decoded `data:` events, checking the stream ends with [DONE]."""
    events: list = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/event-stream")
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events and events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


async def stream_until_end(session: aiohttp.ClientSession, url: str, body: dict, started: asyncio.Event) -> list[dict]:
    """A streamed completion's decoded `data:` events to its end, [DONE] left out (an error event included);
    `started` is set at the first one."""
    events = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
    return events


async def health(session: aiohttp.ClientSession, url: str) -> dict:
    async with session.get(f"{url}/health") as response:
        assert response.status == 200
        return await response.json()


async def wait_idle(session: aiohttp.ClientSession, url: str, within: float = 30.0) -> dict:
    """Poll /health until nothing runs or waits and every KV block is free; returns the scheduler's stats then.
    `within` seconds bound only a hang (an AssertionError with the last stats)."""
    deadline = time.monotonic() + within
    while True:
        stats = (await health(session, url))["scheduler"]
        if stats["num_running"] == stats["num_waiting"] == 0 and stats["num_free_blocks"] == stats["num_total_blocks"]:
            return stats
        assert time.monotonic() < deadline, f"not idle with every block free within {within} s: {stats}"
        await asyncio.sleep(0.05)
