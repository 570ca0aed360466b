"""Issue 9 acceptance 1: the engine fails and comes back while the frontend keeps its socket.

One real server for the module, slowed by the SHUTTLE_DEBUG_STEP_DELAY test hook (ShuttleServer's step_delay) so
requests stay in flight. In turn: kill -9 of the worker, SIGSTOP of the worker (found by the scheduler's step
watchdog, --step-timeout 3, which exits 3), kill -9 of the frontend. Each time every open request ends with exactly
one terminal error, /health answers 503 and then 200 again, and a greedy request is token-exact afterwards. Waits
are bounds that only a hang exceeds; the measured times are printed.

The launcher's side of the other faults is tested without a server (tests/unit/test_supervised_unit.py): a dead process
of any role fails its unit the same way, and a stopped one is found by its missing heartbeat and killed; after that
the restart is the one exercised here.
"""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.client import post_completion
from tests.conftest import hf_greedy
from tests.server import ShuttleServer

HANG = 120.0
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


SCHEDULER_COUNTERS = {"shuttle:prefix_cache_queries_total", "shuttle:prefix_cache_hits_total",
                      "shuttle:num_preemptions_total"}


@pytest.fixture(scope="module")
def srv():
    srv = ShuttleServer("--step-timeout", "3", "--heartbeat-timeout", "6", "--max-restarts", "10", step_delay=0.05)
    yield srv
    srv.stop()


async def sse(session, url, started: asyncio.Event) -> list[str]:
    """A long stream's `data:` payloads, to its end."""
    events = []
    async with session.post(f"{url}/v1/completions", json={**LONG, "stream": True}) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: "):
                events.append(line[6:].decode().strip())
                started.set()
    return events


async def websocket(session, url, started: asyncio.Event) -> dict:
    async with session.ws_connect(f"{url}/v1/ws") as ws:
        await ws.send_json({"type": "generate", "id": "w", **LONG})
        while (frame := await ws.receive_json(timeout=HANG))["type"] == "delta":
            started.set()
        return frame


async def plain(session, url, started: asyncio.Event) -> tuple[int, dict, str | None]:
    started.set()  # no event before the end; its request is in flight once the scheduler counts it
    async with session.post(f"{url}/v1/completions", json=LONG) as response:
        return response.status, await response.json(), response.headers.get("Retry-After")


async def health_status(session, url) -> tuple[int, dict]:
    async with session.get(f"{url}/health") as response:
        return response.status, await response.json()


async def wait_health(session, url, status: int) -> dict:
    deadline = time.monotonic() + HANG
    while True:
        try:
            code, body = await health_status(session, url)
            if code == status:
                return body
        except aiohttp.ClientError:
            pass  # the frontend itself is restarting
        assert time.monotonic() < deadline, f"/health never answered {status}"
        await asyncio.sleep(0.05)


async def assert_greedy_exact(session, url) -> None:
    ids = [1, 403, 407, 261, 378]  # "Once upon a time"
    status, body = await post_completion(session, url, prompt=ids, max_tokens=24, temperature=0, return_token_ids=True)
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == hf_greedy(ids, 24)


async def scheduler_counters(session, url) -> dict[str, float]:
    """The scheduler's counters on /metrics (shuttle:*_total series that come from its stats)."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name in SCHEDULER_COUNTERS}


async def fail_and_recover(srv: ShuttleServer, fault) -> None:
    """Open five requests, apply `fault`, check each ends with exactly one terminal error, the engine comes back
    exact, and no counter on /metrics went down across the restart (the frontend carries the dead scheduler's)."""
    restarts = srv.restarts
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        await wait_health(session, srv.url, 200)
        await assert_greedy_exact(session, srv.url)  # counts something in every counter but preemptions
        before = await scheduler_counters(session, srv.url)
        assert before["shuttle:prefix_cache_queries_total"] > 0 and len(before) == len(SCHEDULER_COUNTERS)
        started = [asyncio.Event() for _ in range(5)]
        tasks = [asyncio.create_task(sse(session, srv.url, started[i])) for i in range(3)]
        tasks.append(asyncio.create_task(websocket(session, srv.url, started[3])))
        tasks.append(asyncio.create_task(plain(session, srv.url, started[4])))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), HANG)
        while (await health_status(session, srv.url))[1]["scheduler"]["num_running"] < 5:
            await asyncio.sleep(0.02)
        faulted = time.monotonic()
        fault()
        *streams, ws_end, (status, body, retry_after) = await asyncio.wait_for(asyncio.gather(*tasks), HANG)
        print(f"every open request ended {time.monotonic() - faulted:.2f} s after the fault")
        for events in streams:
            assert events[-1] == "[DONE]"
            assert json.loads(events[-2])["error"]["code"] == 503
            assert all("error" not in json.loads(e) for e in events[:-2])  # exactly one terminal error
        assert ws_end["type"] == "error" and ws_end["error"]["code"] == 503
        assert status == 503 and body["error"]["code"] == 503 and int(retry_after) >= 1
        down = await wait_health(session, srv.url, 503)
        assert down["status"] == "engine_down" and down["reason"]
        await wait_health(session, srv.url, 200)
        print(f"/health 200 again {time.monotonic() - faulted:.2f} s after the fault")
        srv.wait_restarts(restarts + 1)
        after = await scheduler_counters(session, srv.url)  # before the new scheduler counted anything
        assert all(after[name] >= before[name] for name in before), (before, after)
        await assert_greedy_exact(session, srv.url)


async def test_kill_worker(srv):
    await fail_and_recover(srv, lambda: os.kill(srv.pids["worker"], signal.SIGKILL))
    assert any("worker" in line and "SIGKILL" in line and "restarts in" in line for line in srv.output)


async def test_stopped_worker_is_found_by_the_step_watchdog(srv):
    await fail_and_recover(srv, lambda: os.kill(srv.pids["worker"], signal.SIGSTOP))
    assert any("scheduler" in line and "exited with status 3" in line for line in srv.output), srv.output[-5:]


async def test_killed_frontend_frees_all_its_blocks(srv):
    restarts = srv.restarts
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        await wait_health(session, srv.url, 200)
        doomed = [asyncio.create_task(plain(session, srv.url, asyncio.Event())) for _ in range(4)]
        while (stats := (await health_status(session, srv.url))[1]["scheduler"])["num_running"] < 4:
            await asyncio.sleep(0.02)
        assert stats["num_blocks_in_use"] > 0
        os.kill(srv.pids["frontend"], signal.SIGKILL)
        results = await asyncio.gather(*doomed, return_exceptions=True)
        assert all(isinstance(r, aiohttp.ClientError) for r in results), results  # their connection died
        srv.wait_restarts(restarts + 1)  # the same URL: the launcher restarts the frontend on the same port
        deadline = time.monotonic() + HANG
        while True:  # the scheduler notices the silent frontend and aborts its requests
            code, body = await health_status(session, srv.url)
            stats = body["scheduler"]
            if code == 200 and stats["num_running"] == stats["num_waiting"] == stats["num_blocks_in_use"] == 0:
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.1)
        await assert_greedy_exact(session, srv.url)


async def test_a_replaced_frontend_ends_every_open_stream_with_one_error(srv):
    """SIGSTOP of the frontend: its heartbeat stops, and after --heartbeat-timeout the launcher replaces it, first
    asking for its last words (SIGUSR2, SIGCONT): each open SSE stream ends with exactly one error event and
    [DONE], the WebSocket generate with an error frame, instead of a cut connection. Then it serves again, exact."""
    restarts = srv.restarts
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        await wait_health(session, srv.url, 200)
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(sse(session, srv.url, started[i])) for i in range(3)]
        tasks.append(asyncio.create_task(websocket(session, srv.url, started[3])))
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), HANG)
        os.kill(srv.pids["frontend"], signal.SIGSTOP)
        *streams, ws_end = await asyncio.wait_for(asyncio.gather(*tasks), HANG)
        for events in streams:
            assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503, events[-3:]
            assert all("error" not in json.loads(e) for e in events[:-2])  # exactly one terminal error
        assert ws_end["type"] == "error" and ws_end["error"]["code"] == 503, ws_end
        srv.wait_restarts(restarts + 1)
        await wait_health(session, srv.url, 200)
        await assert_greedy_exact(session, srv.url)
    assert any("frontend" in line and "sent no heartbeat" in line for line in srv.output), srv.output[-5:]


async def test_a_killed_launcher_leaves_no_request_unanswered(srv):
    """Last, as it ends the module's server: SIGKILL of the launcher (the OOM killer's way; Ray's client aborts a
    launcher whose cluster went away the same way) takes the engine with it. The frontend, told by its parent-death
    signal, ends each open request with exactly one error instead of a cut connection, and exits."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        await wait_health(session, srv.url, 200)
        started = [asyncio.Event() for _ in range(3)]
        tasks = [asyncio.create_task(sse(session, srv.url, started[0])),
                 asyncio.create_task(websocket(session, srv.url, started[1])),
                 asyncio.create_task(plain(session, srv.url, started[2]))]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), HANG)
        while (await health_status(session, srv.url))[1]["scheduler"]["num_running"] < 3:
            await asyncio.sleep(0.02)
        srv.proc.kill()
        srv.proc.wait()
        events, ws_end, (status, body, _) = await asyncio.wait_for(asyncio.gather(*tasks), HANG)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == 503, events[-3:]
    assert all("error" not in json.loads(e) for e in events[:-2])  # exactly one terminal error
    assert ws_end["type"] == "error" and ws_end["error"]["code"] == 503, ws_end
    assert status == 503 and body["error"]["code"] == 503, body
    assert srv.wait_gone(10) == []  # the frontend exited after its answers; the engine died with the launcher
