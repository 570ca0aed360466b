"""Issue 11: batch (background) requests yield to interactive ones in the scheduler, under both policies."""

import itertools

import pytest

from shuttle.common.messages import FinishReason, Submit
from shuttle.common.sampling import SamplingParams
from tests.unit.test_scheduler import make_scheduler, run_step

_arrival = itertools.count(1000)


def submit(s, rid: str, background: bool, priority: int = 0, prompt_len: int = 4, max_tokens: int = 4) -> None:
    s.add_request(b"c", Submit(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                               sampling=SamplingParams(max_tokens=max_tokens),
                               arrival_time=float(next(_arrival)), priority=priority, background=background))


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_interactive_requests_start_before_waiting_batch_requests(policy):
    s = make_scheduler(max_num_seqs=2, scheduling_policy=policy, priority_aging_seconds=10.0)
    for i in range(6):  # batch work arrives first, and asks for the best priority it can
        submit(s, f"b{i}", background=True, priority=-100)
    step, _ = run_step(s)
    assert sorted(step.num_scheduled) == ["b0", "b1"]
    for i in range(3):
        submit(s, f"i{i}", background=False, priority=100)
    started: list[str] = []
    finished: set[str] = set()
    while len(finished) < 9:
        step, outputs = run_step(s)
        started += [rid for rid in step.num_scheduled if rid not in started and rid not in ("b0", "b1")]
        finished |= {o.request_id for o in outputs.get(b"c", []) if o.finish_reason is not None}
    # every interactive request started before any batch request that had not started yet
    assert started == ["i0", "i1", "i2", "b2", "b3", "b4", "b5"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_full_queue_turns_away_a_waiting_batch_request_for_an_interactive_one(policy):
    s = make_scheduler(max_num_seqs=1, max_waiting_requests=2, scheduling_policy=policy)
    submit(s, "run", background=True)
    run_step(s)
    submit(s, "b1", background=True)
    submit(s, "b2", background=True)
    submit(s, "b3", background=True)  # queue full: refused
    submit(s, "i1", background=False)  # displaces the newest batch request
    outputs = s.take_outputs()[b"c"]
    assert [(o.request_id, o.finish_reason, o.error_status) for o in outputs] == [
        ("b3", FinishReason.ERROR, 503), ("b2", FinishReason.ERROR, 503)]
    assert [r.request_id for r in sorted(s.waiting, key=lambda r: r.rank)] == ["i1", "b1"]


def test_preemption_takes_a_running_batch_request_before_an_interactive_one():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=4)  # each needs 7 blocks at its end: not both
    submit(s, "b", background=True, prompt_len=8, max_tokens=20)  # arrives first: FCFS alone would keep it
    submit(s, "i", background=False, prompt_len=8, max_tokens=20)
    preempted = set()
    for _ in range(16):
        before = s.num_preemptions
        run_step(s)
        if s.num_preemptions > before:
            preempted |= {r.request_id for r in s.waiting}
    assert preempted == {"b"}


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_running_set_full_of_batch_work_makes_room_for_an_interactive_request(policy):
    s = make_scheduler(max_num_seqs=3, scheduling_policy=policy)
    for i in range(4):
        submit(s, f"b{i}", background=True, max_tokens=30)
    run_step(s)
    assert sorted(r.request_id for r in s.running) == ["b0", "b1", "b2"]
    submit(s, "i0", background=False, max_tokens=30)
    submit(s, "i1", background=False, max_tokens=30)
    step, _ = run_step(s)
    assert "i0" in step.num_scheduled and "i1" in step.num_scheduled  # at once, not when a batch request ends
    assert sorted(r.request_id for r in s.running) == ["b0", "i0", "i1"]
    assert s.num_preemptions == 2 and s.waiting.num_interactive == 0
    finished = set()
    for _ in range(200):
        _, outputs = run_step(s)
        finished |= {o.request_id for o in outputs.get(b"c", []) if o.finish_reason is not None}
        if len(finished) == 6:
            break
    assert finished == {"b0", "b1", "b2", "b3", "i0", "i1"}  # the preempted batch work still finishes
