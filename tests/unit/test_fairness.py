"""Fair shares: one client request fanning out into many sequences cannot take every running slot."""

import itertools
import random

from shuttle.common.config import SchedulerConfig
from shuttle.common.messages import FinishReason, StepResult, Submit
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler

_arrival = itertools.count()


def make(max_num_seqs=16, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, **config), KVCacheManager(512, 4), 1024, (2,))


def submit(s, rid, group, prompt_len=3, max_tokens=50):
    s.add_request(b"c", Submit(request_id=rid, prompt_token_ids=[7] * prompt_len,
                               sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               arrival_time=float(next(_arrival)), group_id=group))


def step(s, token=5):
    planned = s.schedule()
    s.update_from_output(planned, StepResult(step_id=planned.plan.step_id, request_ids=planned.sampling_ids,
                                             token_ids=[token] * len(planned.sampling_ids)))
    s.kv.pool.check_invariants()
    return planned


def running_of(s, group) -> int:
    return sum(r.group == group for r in s.running)


def test_alone_a_request_leaves_a_reserve_and_a_newcomer_starts_at_once():
    s = make(max_num_seqs=16)
    for i in range(200):  # 64 prompts x n=16 in miniature
        submit(s, f"big-{i}", "big")
    step(s)
    assert running_of(s, "big") == 14  # 16 less a reserve of 16 // 8
    assert s.stats().num_waiting == 186
    submit(s, "small", "small", max_tokens=4)
    planned = step(s)
    assert "small" in planned.scheduled  # admitted in the very next step, not after a long generation ends


def test_with_two_requests_live_each_gets_half():
    s = make(max_num_seqs=16)
    for i in range(40):
        submit(s, f"a-{i}", "a", max_tokens=3)
    for i in range(40):
        submit(s, f"b-{i}", "b", max_tokens=3)
    seen = 0
    while s.has_work:
        step(s)
        if "a" in {r.group for r in s.requests.values()} and "b" in {r.group for r in s.requests.values()}:
            assert running_of(s, "a") <= 8 and running_of(s, "b") <= 8
            seen += 1
    assert seen > 0 and s.kv.pool.num_free == 512


def test_fixed_share_and_parked_requests_end_once_when_aborted():
    s = make(max_num_seqs=16, max_seqs_per_request=4)
    for i in range(10):
        submit(s, f"x-{i}", "x")
    step(s)
    assert running_of(s, "x") == 4 and s.shares.num_parked == 6
    s.abort([f"x-{i}" for i in range(10)])
    outputs = s.take_outputs()[b"c"]
    assert sorted(o.request_id for o in outputs if o.finish_reason == FinishReason.ABORT) == sorted(
        f"x-{i}" for i in range(10))
    assert s.shares.num_parked == 0 and not s.has_work and s.kv.pool.num_free == 512


def test_randomized_groups_never_leak_and_end_each_request_once():
    rng = random.Random(4)
    s = make(max_num_seqs=8)
    terminal: dict[str, int] = {}
    ids = itertools.count()
    for _ in range(800):
        if rng.random() < 0.2:
            group = f"g{rng.randrange(5)}"
            for _ in range(rng.randrange(1, 12)):
                submit(s, f"r{next(ids)}", group, rng.randrange(1, 9), rng.randrange(1, 12))
        if s.requests and rng.random() < 0.1:
            s.abort([rng.choice(sorted(s.requests))])
        if s.has_work:
            step(s)
        for o in s.take_outputs().get(b"c", []):
            if o.finish_reason is not None:
                terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
        assert all(running_of(s, g) <= max(s.shares.share(), 7) for g in {r.group for r in s.running})
    while s.has_work:
        step(s)
    for o in s.take_outputs().get(b"c", []):
        if o.finish_reason is not None:
            terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
    assert set(terminal.values()) == {1} and len(terminal) == next(ids)
    assert s.kv.pool.num_free == 512 and s.shares.num_parked == 0
