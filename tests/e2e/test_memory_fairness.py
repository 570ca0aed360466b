"""Issue 3 acceptance: prefix caching, preemption, never-fitting requests, bounded admission, timeouts, and no leaked
blocks, each against real processes. Priority with aging is ordering inside the Scheduler, tested on fabricated clocks
(tests/unit/test_scheduler.py, tests/unit/test_batch_priority.py); that `priority` reaches it from HTTP and the
websocket is tests/api/test_api_details.py."""

import asyncio
import json
import random
import time

import aiohttp
import pytest

from tests.client import health, post_completion, wait_idle
from tests.conftest import hf_greedy
from tests.server import ShuttleServer


def unlimited_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=300))


async def greedy_ids(session, url, prompt_ids, max_tokens) -> dict:
    status, body = await post_completion(session, url, prompt=prompt_ids, max_tokens=max_tokens, temperature=0,
                                         return_token_ids=True)
    assert status == 200, body
    return body


# ---- 1. prefix caching ----------------------------------------------------------------------------------------

async def test_shared_prefix_is_cached_and_outputs_match_with_caching_on_and_off(server, chunked_server):
    """The prefix of the second prompt is the first's: the shared server (caching on) serves its full blocks from
    the cache, `chunked_server` (--no-enable-prefix-caching) computes them again; outputs are the same."""
    rng = random.Random(1)
    prefix = [1] + [rng.randrange(3, 512) for _ in range(199)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(n)] for n in (17, 40)]
    outputs = {}
    for caching, srv in ((True, server), (False, chunked_server)):
        async with unlimited_session() as session:
            before = (await wait_idle(session, srv.url))["prefix_cache_hits"]
            first = await greedy_ids(session, srv.url, prompts[0], 50)
            second = await greedy_ids(session, srv.url, prompts[1], 50)
            hits = (await wait_idle(session, srv.url))["prefix_cache_hits"] - before
        cached = [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, second)]
        # These prompts are new to the server, and 200 shared tokens are 12 full blocks of 16.
        assert cached == ([0, 192] if caching else [0, 0]) and hits == cached[1]
        outputs[caching] = [first["choices"][0]["token_ids"], second["choices"][0]["token_ids"]]
    assert outputs[True] == outputs[False] == [hf_greedy(p, 50) for p in prompts]


# ---- 2, 3, 7. a KV cache far too small: preemption, rejection, no leaks -----------------------------------------

@pytest.fixture(scope="module")
def small_cache_server():
    srv = ShuttleServer("--num-kv-blocks", "48", "--block-size", "16")
    yield srv
    srv.stop()


async def test_preemption_under_memory_pressure_keeps_outputs_exact(small_cache_server):
    rng = random.Random(2)
    # 16 x ~115 tokens against 48 x 16 slots of KV; test_engine_inprocess checks preemption's exactness more widely
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(30, 100))] for _ in range(16)]
    max_tokens = [rng.randrange(30, 70) for _ in prompts]
    assert sum(len(p) + m for p, m in zip(prompts, max_tokens)) > 2 * 48 * 16
    async with unlimited_session() as session:
        before = (await health(session, small_cache_server.url))["scheduler"]["num_preemptions"]
        results = await asyncio.gather(*(greedy_ids(session, small_cache_server.url, p, m)
                                         for p, m in zip(prompts, max_tokens)))
        stats = await wait_idle(session, small_cache_server.url)
    for prompt, m, result in zip(prompts, max_tokens, results):
        assert result["choices"][0]["token_ids"] == hf_greedy(prompt, m)
    assert stats["num_preemptions"] > before
    print(f"preemptions: {stats['num_preemptions'] - before}")


async def test_random_disconnects_and_preemptions_leak_no_block(small_cache_server):
    rng = random.Random(7)
    url = small_cache_server.url

    async def one(i: int, session) -> None:
        body = {"prompt": [1] + [rng.randrange(3, 512) for _ in range(rng.randrange(1, 200))],
                "max_tokens": rng.randrange(1, 250), "temperature": rng.choice([0, 0.8]), "stream": True}
        leave_after = rng.choice([None, None, 0, 1, 5, 20])
        await asyncio.sleep(rng.random() * 0.5)
        async with session.post(f"{url}/v1/completions", json=body) as response:
            assert response.status == 200
            lines = 0
            async for _ in response.content:
                lines += 1
                if leave_after is not None and lines > leave_after:
                    response.close()
                    return

    async with unlimited_session() as session:
        await asyncio.gather(*(one(i, session) for i in range(40)))
        await wait_idle(session, url)


async def stream_first_token_time(session, url, **body) -> tuple[float, float]:
    """(first-token time, finish time) of a streamed request, time.monotonic() seconds."""
    first = None
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            if first is None and raw.startswith(b"data: {"):
                first = time.monotonic()
    return first, time.monotonic()


# ---- 5, 6. bounded admission and timeouts ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bounded_server():
    srv = ShuttleServer("--max-waiting-requests", "8", "--max-num-seqs", "2", "--num-kv-blocks", "20", step_delay=0.05)
    yield srv
    srv.stop()


async def test_never_fitting_request_gets_400(bounded_server):
    url = bounded_server.url  # 20 blocks of 16: 320 tokens of KV cache
    async with unlimited_session() as session:
        steps_before = (await wait_idle(session, url))["num_steps"]
        status, body = await post_completion(session, url, prompt=[1] * 100, max_tokens=300)
        assert status == 400 and body["error"]["code"] == 400 and "KV cache" in body["error"]["message"]
        assert (await health(session, url))["scheduler"]["num_steps"] == steps_before  # refused unrun
        async with session.post(f"{url}/v1/completions",
                                json={"prompt": [1] * 100, "max_tokens": 300, "stream": True}) as response:
            assert response.status == 400
        status, ok = await post_completion(session, url, prompt=[1] * 300, max_tokens=20, temperature=0,
                                           ignore_eos=True)
        assert status == 200 and ok["usage"]["completion_tokens"] == 20  # 320 tokens: the whole cache
        await wait_idle(session, url)


async def test_burst_past_the_waiting_bound_gets_exact_503s(bounded_server):
    url = bounded_server.url
    async with unlimited_session() as session:
        blockers = [asyncio.create_task(post_completion(session, url, prompt="Hi", max_tokens=60, ignore_eos=True))
                    for _ in range(2)]
        while (await health(session, url))["scheduler"]["num_running"] < 2:
            await asyncio.sleep(0.02)

        async def one():
            async with session.post(f"{url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}) as response:
                return response.status, response.headers.get("Retry-After"), await response.json()

        results = await asyncio.gather(*(one() for _ in range(50)))
        blocked = await asyncio.gather(*blockers)
        await wait_idle(session, url)
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 8 + [503] * 42
    for status, retry_after, body in results:
        if status == 503:
            assert retry_after is not None and body["error"]["code"] == 503
        else:
            assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert all(status == 200 for status, _ in blocked)


async def test_more_sequences_than_the_queue_bound_is_a_400_not_a_503(bounded_server):
    async with unlimited_session() as session:
        status, body = await post_completion(session, bounded_server.url, prompt="Hi", max_tokens=2, n=9)
    assert status == 400 and body["error"]["param"] == "n"


async def test_stalled_stream_times_out_with_error_event_and_frees_blocks(bounded_server):
    url = bounded_server.url
    async with unlimited_session() as session:
        events = []
        started = time.monotonic()
        async with session.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 300, "ignore_eos": True,
                                                               "stream": True, "timeout": 0.8}) as response:
            assert response.status == 200
            async for raw in response.content:
                if raw.startswith(b"data: "):
                    events.append(raw[6:].strip())
        elapsed = time.monotonic() - started
        assert events[-1] == b"[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == 408 and "timed out" in error["error"]["message"]
        assert len(events) > 3 and elapsed >= 0.8  # never before its timeout (a late one only on a loaded machine)
        stats = await wait_idle(session, url, within=30.0)
        assert stats["num_timed_out"] >= 1


# ---- 5. one huge request next to a small one (issue 9) -------------------------------------------------------------

async def test_a_huge_request_does_not_hold_back_a_small_one_behind_it(server):
    """64 prompts x n=16 x 480 tokens (1,024 sequences in a 1.7 KB body), then an 8-token request: the small one
    runs to its end while most of the huge one's sequences still wait (under plain FCFS it would wait for all
    1,024 to be admitted). Its TTFT is printed, not asserted (timing belongs in benchmarks)."""
    srv = server
    async with unlimited_session() as session:
        big = asyncio.create_task(post_completion(
            session, srv.url, prompt=["Once upon a time"] * 64, n=16, max_tokens=480, ignore_eos=True,
            temperature=1.0, seed=1))
        while (await health(session, srv.url))["scheduler"]["num_running"] < 64:
            await asyncio.sleep(0.02)
        sent = time.monotonic()
        first, done = await stream_first_token_time(session, srv.url, prompt="Once upon a time", max_tokens=8,
                                                    temperature=0)
        stats = (await health(session, srv.url))["scheduler"]
        print(f"8-token request next to 1,024 running/waiting sequences: TTFT {first - sent:.3f} s, "
              f"done after {done - sent:.3f} s; {stats['num_waiting']} sequences still waiting")
        assert not big.done()
        assert stats["num_waiting"] >= 1024 - 128
        big.cancel()  # the client goes away: all 1,024 sequences are aborted
        await wait_idle(session, srv.url, within=30)
