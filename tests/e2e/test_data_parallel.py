"""Issue 13, acceptance 2-3: two serving groups behind one frontend (`--data-parallel-size 2`), one real server.

Load splits evenly, requests sharing a prefix land on one group and report cached tokens, greedy output equals
transformers', and kill -9 of one group's worker fails only that group's requests while the other group serves
(new requests too), until the killed group is back. Which group served what is read from /health's per-group
counters (`routed` by the router, `num_admitted` by each scheduler). Waits are bounds only a hang exceeds.
"""

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from shuttle.capacity.story_prompts import MAX_TOKENS, story_prompts
from tests.client import post_completion, stream_until_end
from tests.conftest import hf_greedy, hf_tokenizer
from tests.server import ShuttleServer

HANG = 120.0
PREFIX = [1] + [(i * 37) % 480 + 20 for i in range(199)]  # 200 tokens: 12 full KV blocks of 16


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """Two groups; every process logs one JSON object per line (issue 46), with a line per request, to srv.log."""
    log = tmp_path_factory.mktemp("dp-log") / "stderr.jsonl"
    srv = ShuttleServer("--data-parallel-size", "2", "--max-restarts", "5", "--log-format", "json",
                        "--enable-log-requests", step_delay=0.02, stderr=log)
    srv.log = log
    yield srv
    srv.stop()


async def test_json_log_lines_name_the_request_and_its_group(srv):
    """--log-format json: every line of every process is one JSON object; a request's lines (submitted, finished,
    the access log's) carry its request_id, the submitted and finished lines the group that served it, and each
    engine process's lines their group."""
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(post_completion(session, srv.url, prompt=[1, 403, 407, 261 + i],
                                                         max_tokens=3, temperature=0) for i in range(4)))
    ids = {body["id"] for _, body in results}
    deadline = time.monotonic() + HANG
    while True:  # the access line is written once its response is done
        entries = [json.loads(line) for line in srv.log.read_text().splitlines()]  # every line parses
        access = [e for e in entries if e["logger"] == "aiohttp.access" and e.get("request_id") in ids]
        if len(access) == len(ids) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    assert len(access) == len(ids) and all('"POST /v1/completions HTTP/1.1" 200' in e["message"] for e in access)
    assert all({"time", "level", "process", "logger", "message"} <= e.keys() for e in entries)
    assert srv.ready_info["pids"] and srv.ready_info["url"] == srv.url  # the launcher's ready line, JSON on stdout
    submitted = [e for e in entries if e["message"].startswith("request ") and "prompt tokens" in e["message"]]
    finished = [e for e in entries if e["message"].startswith("request ") and " finished: length" in e["message"]]
    for lines in (submitted, finished):
        mine = {e["request_id"]: e["group"] for e in lines if e["request_id"][:-2] in ids}
        assert set(mine) == {i + "-0" for i in ids} and set(mine.values()) <= {0, 1}, lines
    assert {e["request_id"]: e["group"] for e in submitted} == {e["request_id"]: e["group"] for e in finished}
    engine = [e for e in entries if e["process"] in ("scheduler", "worker")]
    assert engine and {e["group"] for e in engine} == {0, 1}, engine[:3]


async def health(session, url) -> tuple[int, dict]:
    async with session.get(f"{url}/health") as response:
        return response.status, await response.json()


def per_group(body: dict, field: str) -> list[int]:
    return [g[field] if field in g else g["scheduler"][field] for g in body["groups"]]


async def wait_health(session, url, check) -> dict:
    deadline = time.monotonic() + HANG
    while True:
        code, body = await health(session, url)
        if check(code, body):
            return body
        assert time.monotonic() < deadline, body
        await asyncio.sleep(0.05)


async def test_greedy_output_is_token_exact(srv):
    tokenizer = hf_tokenizer()
    prompts = story_prompts()[::3]  # 1 to 290 tokens; the short ones split by load, the rest share a prefix
    max_tokens = [min(m, 24) for m in MAX_TOKENS[::3]]
    async with aiohttp.ClientSession() as session:
        _, before = await health(session, srv.url)
        results = await asyncio.gather(*(post_completion(session, srv.url, prompt=p, max_tokens=m, temperature=0,
                                                         return_token_ids=True)
                                         for p, m in zip(prompts, max_tokens)))
        _, after = await health(session, srv.url)
    for prompt, max_new, (status, body) in zip(prompts, max_tokens, results):
        assert status == 200, body
        ids = tokenizer(prompt).input_ids
        assert body["choices"][0]["token_ids"] == hf_greedy(ids, max_new), f"prompt of {len(ids)} tokens"
    routed = [a - b for a, b in zip(per_group(after, "routed"), per_group(before, "routed"))]
    assert sum(routed) == 6 and min(routed) > 0, routed  # both groups served some


async def test_concurrent_requests_split_evenly(srv):
    async with aiohttp.ClientSession() as session:
        _, before = await health(session, srv.url)
        results = await asyncio.gather(*(post_completion(session, srv.url, prompt=[1, 20 + i % 400, 30 + i // 400],
                                                         max_tokens=4, temperature=0) for i in range(200)))
        assert all(status == 200 for status, _ in results)
        body = await wait_health(session, srv.url, lambda c, b: b["scheduler"]["num_running"] == 0)
    admitted = [a - b for a, b in zip(per_group(body, "num_admitted"), per_group(before, "num_admitted"))]
    print("admitted per group", admitted)
    assert sum(admitted) == 200 and all(80 <= n <= 120 for n in admitted), admitted


async def test_shared_prefix_lands_on_one_group_and_is_cached(srv):
    async with aiohttp.ClientSession() as session:
        _, before = await health(session, srv.url)
        status, first = await post_completion(session, srv.url, prompt=PREFIX + [5], max_tokens=4, temperature=0,
                                              return_token_ids=True)
        assert status == 200 and first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        results = await asyncio.gather(*(post_completion(session, srv.url, prompt=PREFIX + [6 + i], max_tokens=4,
                                                         temperature=0) for i in range(19)))
        _, after = await health(session, srv.url)
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for _, r in results] == [192] * 19
    assert first["choices"][0]["token_ids"] == hf_greedy(PREFIX + [5], 4)
    admitted = sorted(a - b for a, b in zip(per_group(after, "num_admitted"), per_group(before, "num_admitted")))
    assert admitted == [0, 20], admitted


LONG = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True, "temperature": 0, "stream": True}


async def test_kill_one_groups_worker_under_load(srv):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        started = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(stream_until_end(session, srv.url, LONG, event)) for event in started]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), HANG)
        await wait_health(session, srv.url, lambda c, b: per_group(b, "num_running") == [4, 4])
        killed = srv.pids["worker.1"]
        os.kill(killed, signal.SIGKILL)
        degraded = await wait_health(session, srv.url, lambda c, b: b["status"] == "degraded")
        assert degraded["groups"][1]["status"] == "engine_down" and "SIGKILL" in degraded["groups"][1]["reason"]
        # new requests succeed meanwhile, on the healthy group
        fresh = await asyncio.gather(*(post_completion(session, srv.url, prompt=[1, 50 + i], max_tokens=3)
                                       for i in range(4)))
        assert [status for status, _ in fresh] == [200] * 4
        ends = await asyncio.gather(*tasks)
        errors = [e for e in ends if "error" in e[-1]]
        completed = [e for e in ends if "error" not in e[-1]]
        assert len(errors) == 4 and len(completed) == 4
        for events in errors:  # exactly one terminal error each
            assert events[-1]["error"]["code"] == 503 and all("error" not in e for e in events[:-1])
        for events in completed:
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            assert "".join(e["choices"][0]["text"] for e in events) == "".join(
                e["choices"][0]["text"] for e in completed[0])
        back = await wait_health(session, srv.url, lambda c, b: c == 200 and b["status"] == "ok")
        assert back["groups"][1]["times_down"] == 1
        srv.wait_restarts(1)
        assert srv.pids["worker.1"] != killed and srv.pids["worker.0"] in srv.all_pids
        _, before = await health(session, srv.url)
        results = await asyncio.gather(*(post_completion(session, srv.url, prompt=[1, 403, 407, 261, 378],
                                                         max_tokens=12, temperature=0, return_token_ids=True)
                                         for _ in range(2)))
        _, after = await health(session, srv.url)
    expected = hf_greedy([1, 403, 407, 261, 378], 12)
    assert [r["choices"][0]["token_ids"] for _, r in results] == [expected, expected]
    assert after["groups"][1]["routed"] > before["groups"][1]["routed"]  # the group serves again
    assert any("worker" in line and "SIGKILL" in line and "engine of group 1 restarts" in line
               for line in srv.output), srv.output[-5:]
