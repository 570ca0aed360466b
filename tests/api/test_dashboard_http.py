"""Issue 15: /dashboard and /v1/stats/stream over real HTTP in-process (a scripted engine, no model): the page is
self-contained and open, the feed needs the API key, streams frames and stops its work when the watcher leaves."""

import asyncio
import logging
import re

import aiohttp
import msgspec
import pytest

from shuttle.common.messages import SchedulerStats
from shuttle.frontend.observability.dashboard import FEED
from tests.inprocess import start_app

KEY = "sk-dashboard-secret-4711"


@pytest.fixture(scope="module")
async def app():
    app = await start_app(api_key=KEY, step_delay=0.01)
    yield app
    await app.close()


async def read_frames(response: aiohttp.ClientResponse, count: int) -> list[dict]:
    frames = []
    async for line in response.content:
        if line.startswith(b"data: "):
            frames.append(msgspec.json.decode(line[6:]))
            if len(frames) == count:
                break
    return frames


async def test_page_is_one_self_contained_document_open_without_the_key(app):
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{app.url}/dashboard") as response:
            assert response.status == 200
            assert response.content_type == "text/html"
            html = await response.text()
            csp = response.headers["Content-Security-Policy"]
    assert "/*SCRIPT*/" not in html and "/*STYLE*/" not in html  # inlined
    assert "/v1/stats/stream" in html and "getContext(\"2d\")" in html
    # nothing fetched from elsewhere: no src= or href= at all, and the policy allows this origin only
    assert not re.search(r"""\s(src|href)\s*=""", html)
    assert "connect-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    assert KEY not in html


async def test_feed_needs_the_key_and_streams_frames_with_it(app, caplog):
    caplog.set_level(logging.DEBUG)
    feed = app.state.engine  # the hook is chained onto the engine's stats
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{app.url}/v1/stats/stream") as response:
            assert response.status == 401
            assert (await response.json())["error"]["code"] == 401
        async with session.get(f"{app.url}/v1/stats/stream?window=0") as response:
            assert response.status == 401  # auth comes first
        headers = {"Authorization": f"Bearer {KEY}"}
        async with session.get(f"{app.url}/v1/stats/stream?window=abc", headers=headers) as response:
            assert response.status == 400 and (await response.json())["error"]["param"] == "window"
        async with session.get(f"{app.url}/v1/stats/stream?window=2", headers=headers) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "text/event-stream"
            [first] = await read_frames(response, 1)
            assert first["config"]["model"] == "stories260K" and first["status"] == "ok"
            # the scheduler's stats arrive: the next frames show them
            feed._on_stats(SchedulerStats(num_running=2, num_waiting=5, num_total_blocks=1000, num_blocks_in_use=7,
                                          num_free_blocks=993, step_token_counts=[12, 2],
                                          step_decode_token_counts=[2, 2]))
            frames = await read_frames(response, 2)
            assert {(f["running"], f["waiting"]) for f in frames} == {(2, 5)}
            assert [s[2:] for f in frames for s in f["steps"]] == [[10, 2], [0, 2]]
            assert "config" not in frames[-1]
            assert len(app.runner.app[FEED].subscribers) == 1
    for _ in range(100):  # the client left: its handler is cancelled and the ticker stops
        if not app.runner.app[FEED].subscribers:
            break
        await asyncio.sleep(0.02)
    dashboard = app.runner.app[FEED]
    assert not dashboard.subscribers and dashboard._ticker is None
    assert KEY not in caplog.text


async def test_two_watchers_each_get_their_frames(app):
    headers = {"Authorization": f"Bearer {KEY}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        async with session.get(f"{app.url}/v1/stats/stream") as a, session.get(f"{app.url}/v1/stats/stream") as b:
            frames_a, frames_b = await asyncio.gather(read_frames(a, 3), read_frames(b, 3))
    assert frames_a[-1]["time"] > frames_a[0]["time"] and frames_b[-1]["time"] > frames_b[0]["time"]
    feed = app.runner.app[FEED]
    assert feed.tick_s <= 0.5  # the page's promise: at least two updates a second
