"""Issue 9 acceptance 2: SIGTERM drains, also sent to the launcher's whole process group (as a service manager
sends it). Admission stops at once (503 with Connection: close and no Retry-After,
/health 503 "draining"), running streams finish up to --shutdown-timeout, the rest end with an error event, and
the exit status is 0. One server, since SIGTERM ends it: short streams that finish within the timeout and long
ones that cannot (the step delay is a floor under their time, whatever the machine's speed). Waits are bounds that
only a hang exceeds. Before the SIGTERM the whole group is paused for longer than --heartbeat-timeout, which must
restart nothing."""

import asyncio
import json
import os
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


SHUTDOWN_TIMEOUT_S = 10
HEARTBEAT_TIMEOUT_S = 4
STEP_DELAY_S = 0.05  # a floor under every step: 400 tokens take at least 20 s, twice the shutdown timeout
SHORT = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "temperature": 0, "return_token_ids": True}
LONG = {**SHORT, "max_tokens": 400}


async def test_sigterm_finishes_short_streams_ends_long_ones_with_an_error_and_refuses_newcomers_at_once():
    """20 short streams and 4 that cannot finish within --shutdown-timeout run when SIGTERM comes: the short ones
    end normally (40 tokens, finish_reason "length"), the long ones with one error event at the timeout."""
    srv = ShuttleServer("--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S), "--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S),
                        step_delay=STEP_DELAY_S)
    try:
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                        timeout=aiohttp.ClientTimeout(total=HANG))
        async with session:
            started = [asyncio.Event() for _ in range(24)]
            tasks = [asyncio.create_task(stream(session, srv.url, SHORT if i < 20 else LONG, e))
                     for i, e in enumerate(started)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), HANG)
            # First the whole group is paused for longer than --heartbeat-timeout (a `docker pause`, a stalled VM):
            # the launcher, paused too, takes none of it for its children's silence, so nothing restarts (a restart
            # would end the short streams below with errors).
            group = os.getpgid(srv.proc.pid)
            os.killpg(group, signal.SIGSTOP)
            await asyncio.sleep(HEARTBEAT_TIMEOUT_S + 3)
            os.killpg(group, signal.SIGCONT)
            await asyncio.sleep(1)
            assert srv.restarts == 0
            # to the whole process group, as a service manager stops it (systemd's default KillMode): every child
            # gets it too, and still only the launcher acts on it
            os.killpg(group, signal.SIGTERM)
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
        for events in results[:20]:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-1]) == 40
            assert all("error" not in e for e in events[:-1])
        for events in results[20:]:
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == 503
            assert all("error" not in e for e in events[:-2])
            assert 0 < sum(len(e["choices"][0]["token_ids"]) for e in events[:-2]) < 400
        assert srv.proc.wait(HANG) == 0
        assert srv.wait_gone(HANG) == []
    finally:
        srv.stop()
