"""The data-parallel router in process, over scripted serving groups (tests/fake_engine.FakeEngine): least load,
prefix affinity by the scheduler's own block digests, failure of one group, and the per-group /health."""

import asyncio

import aiohttp
import pytest

from shuttle.common.messages import FinishReason, SchedulerStats, Submit
from shuttle.common.sampling import SamplingParams
from shuttle.frontend.engine.router import Router, prompt_block_hashes
from shuttle.frontend.observability.metrics import Metrics
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.request import Request
from tests.fake_engine import FakeEngine
from tests.inprocess import start_app

PREFIX = list(range(3, 203))  # 200 tokens: 12 full blocks of 16


def make_router(n: int = 2, step_delay: float = 0.01, max_num_seqs: int = 128) -> Router:
    return Router([FakeEngine(step_delay=step_delay, script_end=FinishReason.LENGTH) for _ in range(n)], max_num_seqs)


async def run(router: Router, request_id: str, prompt: list[int], max_tokens: int = 4) -> list:
    request = Submit(request_id=request_id, prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens),
                     arrival_time=0.0)
    return [o async for o in router.generate(request)]


def test_router_names_blocks_as_the_scheduler_does():
    kv = KVCacheManager(64, 16)
    request = Request("r", b"client", PREFIX + [7, 8], SamplingParams(max_tokens=1), 0.0)
    assert prompt_block_hashes(PREFIX + [7, 8], 16) == [d for d, _ in kv._full_blocks(request, 12)]
    assert len(prompt_block_hashes(list(range(15)), 16)) == 0


async def test_concurrent_requests_split_evenly_between_groups():
    router = make_router()
    prompts = [[1, i % 500, i // 500] for i in range(200)]  # shorter than a block: no affinity, load alone
    results = await asyncio.gather(*(run(router, f"r{i}", p) for i, p in enumerate(prompts)))
    assert all(r[-1].finish_reason == FinishReason.LENGTH for r in results)
    assert [len(g.submitted) for g in router.groups] == [100, 100]
    assert [g.routed for g in router.groups] == [100, 100]
    router.close()


async def test_requests_sharing_a_prefix_go_where_it_lives():
    router = make_router()
    await run(router, "other", [1, 2, 3])  # rotation now points at group 1
    first = await run(router, "first", PREFIX + [1])
    home = next(i for i, g in enumerate(router.groups) if "first" in g.submitted_ids)
    await asyncio.gather(*(run(router, f"p{i}", PREFIX + [i + 10, i]) for i in range(19)))
    assert sum(r.startswith("p") for r in router.groups[home].submitted_ids) == 19
    assert sum(r.startswith("p") for r in router.groups[1 - home].submitted_ids) == 0
    assert router.affinity_hits == 19 and first[-1].finish_reason == FinishReason.LENGTH
    router.close()


async def test_affinity_yields_when_the_preferred_group_is_much_busier():
    router = make_router(step_delay=0.05, max_num_seqs=8)  # slack: 4 sequences
    await run(router, "first", PREFIX)
    home = next(i for i, g in enumerate(router.groups) if "first" in g.submitted_ids)
    await asyncio.gather(*(run(router, f"p{i}", PREFIX + [i]) for i in range(12)))
    # affinity holds while home's load <= the other's + 4 (p0-p4); p5 overflows to the other group, which then
    # holds the prefix too and, being the last to get it, attracts the rest (p6-p11): a hot prefix spreads
    at_home = [r for r in router.groups[home].submitted_ids if r.startswith("p")]
    assert at_home == ["p0", "p1", "p2", "p3", "p4"]
    assert len(router.groups[1 - home].submitted) == 7
    router.close()


async def test_load_from_stats_counts_other_work():
    router = make_router()
    router.groups[0].stats = SchedulerStats(num_waiting=30, num_running=10)
    await asyncio.gather(*(run(router, f"r{i}", [1, i]) for i in range(20)))
    assert [len(g.submitted) for g in router.groups] == [0, 20]  # group 1's own count stays below 40
    router.groups[0].stats = SchedulerStats(num_running=5, num_blocks_in_use=1, num_total_blocks=10)
    router.groups[1].stats = SchedulerStats(num_running=5, num_blocks_in_use=9, num_total_blocks=10)
    await run(router, "tie", [1, 2])
    assert "tie" in router.groups[0].submitted_ids  # equal load: the emptier KV cache
    router.close()


async def test_a_down_group_fails_only_its_requests_and_new_work_goes_elsewhere():
    router = make_router(step_delay=0.05)
    tasks = [asyncio.create_task(run(router, f"r{i}", [1, i], max_tokens=8)) for i in range(10)]
    await asyncio.sleep(0.12)
    doomed = set(router.groups[0].submitted_ids)
    assert len(doomed) == 5
    await run(router, "warm", PREFIX)  # its prefix now lives on some group ...
    home = next(i for i, g in enumerate(router.groups) if "warm" in g.submitted_ids)
    router.engine_down("worker (pid 1) was killed by signal SIGKILL", 5.0, group=0)
    results = await asyncio.gather(*tasks)
    for i, outputs in enumerate(results):
        if f"r{i}" in doomed:
            assert [o.finish_reason for o in outputs].count(FinishReason.ERROR) == 1
            assert outputs[-1].error_status == 503
        else:
            assert outputs[-1].finish_reason == FinishReason.LENGTH and len(outputs) == 8
    assert router.admission_error() is None
    await asyncio.gather(*(run(router, f"n{i}", [2, i]) for i in range(6)))
    assert not any(r.startswith("n") for r in router.groups[0].submitted_ids)
    states = router.group_states()
    assert [s.up for s in states] == [False, True] and states[0].times_down == 1 and states[0].reason
    assert all("it is restarting, retry shortly" in outputs[-1].error_message
               for i, outputs in enumerate(results) if f"r{i}" in doomed)
    # group 0 comes back (its scheduler answered): it takes work again, with no stale affinity
    router.groups[0].down_reason = None
    router.groups[0]._up.set()
    hits = router.affinity_hits
    await run(router, "again", PREFIX + [5])
    assert router.affinity_hits == hits + (home == 1)  # group 0's old digests no longer attract
    router.engine_down("gone", 3.0, group=1)
    router.engine_down("gone", 3.0, group=0)
    error = router.admission_error()
    assert error is not None and error.status == 503 and error.retry_after == pytest.approx(3.0, abs=0.5)
    router.close()


async def test_groups_that_no_retry_brings_back_are_all_named_and_promise_no_time():
    """Every group kept out (a misconfiguration): one 503 naming each, without a Retry-After (a trial saw one group's
    reason with "retry shortly" and Retry-After: 1, forever). One group only restarting: its time is promised."""
    router = make_router()
    for i, (kind, reason) in enumerate([("config", "its max_model_len 256 differs"), ("keys", "the handshake failed")]):
        router.groups[i].down_reason, router.groups[i]._kept_out = reason, kind
        router.groups[i]._up.clear()
    error = router.admission_error()
    assert error.status == 503 and error.retry_after is None
    said = str(error)
    assert said.startswith("no serving group takes requests: group 0: the engine at ")
    assert "kept out: its max_model_len 256 differs; group 1: " in said and "kept out: the handshake failed" in said
    router.groups[1]._kept_out = ""
    router.engine_down("gone", 3.0, group=1)
    assert router.admission_error().retry_after == pytest.approx(3.0, abs=0.5)
    router.close()


async def test_health_and_metrics_report_each_group():
    app = await start_app()
    try:
        router = make_router()
        app.state.engine = router
        router.groups[1].stats = SchedulerStats(num_running=3, num_waiting=1, num_total_blocks=10,
                                                num_blocks_in_use=5)
        router.groups[0].stats = SchedulerStats(num_running=2, num_total_blocks=10)
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{app.url}/health") as response:
                body = await response.json()
                assert response.status == 200 and body["status"] == "ok"
            assert [g["status"] for g in body["groups"]] == ["ok", "ok"]
            assert body["scheduler"]["num_running"] == 5 and body["scheduler"]["num_total_blocks"] == 20
            assert body["groups"][1]["scheduler"]["num_waiting"] == 1
            router.engine_down("scheduler (pid 7) exited with status 3", 4.0, group=1)
            async with session.get(f"{app.url}/health") as response:
                body = await response.json()
                assert response.status == 200 and body["status"] == "degraded"
            assert body["groups"][1] == {**body["groups"][1], "status": "engine_down", "times_down": 1,
                                         "reason": "scheduler (pid 7) exited with status 3"}
            text = Metrics(lambda: router.stats, router.group_states).render().decode()
            assert 'shuttle:group_up{group="0"} 1.0' in text and 'shuttle:group_up{group="1"} 0.0' in text
            assert 'shuttle:group_failures_total{group="1"} 1.0' in text
            assert 'shuttle:group_num_requests_running{group="0"} 2.0' in text
            router.engine_down("gone", 4.0, group=0)
            async with session.get(f"{app.url}/health") as response:
                assert response.status == 503 and (await response.json())["status"] == "engine_down"
    finally:
        await app.close()
        router.close()


async def test_start_waits_for_one_local_group_only():
    router = make_router()
    router.groups[1]._up.clear()  # still starting (or restarting while the frontend restarts)
    await router.start(timeout=5)
    assert [g.is_up for g in router.groups] == [True, False]
    await run(router, "r", [1, 2])
    assert "r" in router.groups[0].submitted_ids
    router.close()
    router = Router([FakeEngine(), FakeEngine()], wait_for=1)
    for group in router.groups:
        group._up.clear()
    with pytest.raises(TimeoutError):
        await router.start(timeout=0.2)
    router.close()


async def test_a_group_that_will_not_restart_says_so_to_its_requests():
    """A trial: after the launcher gave up (--max-restarts), in-flight requests were told "it is restarting, retry
    shortly"."""
    router = make_router(step_delay=0.05)
    task = asyncio.create_task(run(router, "r", [1, 2], max_tokens=8))
    await asyncio.sleep(0.12)
    group = 0 if "r" in router.groups[0].submitted_ids else 1
    router.engine_down("worker (pid 1) was killed by signal SIGKILL", 0.0, group=group, restarting=False)
    outputs = await task
    assert outputs[-1].error_status == 503
    assert outputs[-1].error_message.endswith("; it will not restart: the server is stopping")
    router.close()
