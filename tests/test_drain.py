"""Issue 9 acceptance 2: SIGTERM drains. Admission stops at once (503 with Connection: close and no Retry-After,
/health 503 "draining"), running streams finish up to --shutdown-timeout, the rest end with an error event, and
the exit status is 0. Waits are bounds that only a hang exceeds."""

import asyncio
import json
import signal

import aiohttp

from tests.server import ShuttleServer

HANG = 120.0


async def stream(session, url, body: dict, started: asyncio.Event) -> list[dict]:
    events = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"data: "):
                started.set()
                data = line[6:].decode().strip()
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def twenty_streams_then_sigterm(srv: ShuttleServer, body: dict):
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=HANG))
    started = [asyncio.Event() for _ in range(20)]
    tasks = [asyncio.create_task(stream(session, srv.url, body, e)) for e in started]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), HANG)
    srv.proc.send_signal(signal.SIGTERM)
    return session, tasks


async def test_sigterm_lets_20_streams_finish_and_refuses_newcomers_at_once():
    srv = ShuttleServer("--shutdown-timeout", "60", step_delay=0.02)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 80, "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}
        session, tasks = await twenty_streams_then_sigterm(srv, body)
        async with session:
            while True:  # the frontend hears of the SIGTERM through the launcher
                async with session.get(f"{srv.url}/health") as response:
                    if response.status == 503:
                        assert (await response.json())["status"] == "draining"
                        break
                await asyncio.sleep(0.01)
            async with session.post(f"{srv.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3}) as response:
                # going away for good: no promise to come back, and the official clients are told not to retry
                assert response.status == 503 and "Retry-After" not in response.headers
                assert response.headers["Connection"] == "close" and response.headers["x-should-retry"] == "false"
                assert "shutting down" in (await response.json())["error"]["message"]
            results = await asyncio.wait_for(asyncio.gather(*tasks), HANG)
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 80
            assert all("error" not in e for e in events[:-1])
        assert srv.proc.wait(HANG) == 0
        assert srv.wait_gone(HANG) == []
    finally:
        srv.stop()


async def test_sigterm_with_a_short_timeout_ends_the_rest_with_an_error_event():
    srv = ShuttleServer("--shutdown-timeout", "1", step_delay=0.05)
    try:
        body = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        session, tasks = await twenty_streams_then_sigterm(srv, body)
        async with session:
            results = await asyncio.wait_for(asyncio.gather(*tasks), HANG)
        for events in results:
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
            assert all("error" not in e for e in events[:-2])
        assert srv.proc.wait(HANG) == 0
        assert srv.wait_gone(HANG) == []
    finally:
        srv.stop()
