"""Book at schedule time, settle on results: the scheduler with two steps in flight, driven by fabricated tokens."""

import itertools
import random
from collections import deque

from shuttle.common.messages import FinishReason, StepResult
from shuttle.scheduler.request import RequestStatus
from tests.unit.test_scheduler import EOS, make_scheduler, submit


def result_for(step, token_for=lambda rid: 5) -> StepResult:
    sampled = step.sampling_ids
    return StepResult(step_id=step.plan.step_id, request_ids=sampled, token_ids=[token_for(rid) for rid in sampled])


def outputs_of(s) -> list:
    return s.take_outputs().get(b"c", [])


def test_next_step_is_planned_before_the_previous_settles():
    s = make_scheduler()
    submit(s, "a", 5, max_tokens=4)
    first = s.schedule()
    assert first.num_scheduled == {"a": 5} and first.sampling_ids == ["a"]
    request = s.requests["a"]
    assert request.num_computed_tokens == 5 and request.num_output_placeholders == 1
    second = s.schedule()  # the placeholder is fed: the worker appends its own sample
    assert second.num_scheduled == {"a": 1} and second.plan.cached_requests[0].num_computed_tokens == 5
    assert request.num_output_placeholders == 2
    assert s.schedule().is_empty is False  # a third step may be planned too; the loop caps steps in flight at two
    s.update_from_output(first, result_for(first, lambda rid: 7))
    assert request.output_token_ids == [7] and request.num_output_placeholders == 2


def test_tokens_sampled_after_a_finish_are_dropped():
    s = make_scheduler()
    submit(s, "a", 5, max_tokens=10)
    first, second = s.schedule(), s.schedule()
    s.update_from_output(first, result_for(first, lambda rid: EOS))
    [out] = outputs_of(s)
    assert out.finish_reason == FinishReason.STOP and out.new_token_ids == [EOS]
    s.update_from_output(second, result_for(second, lambda rid: 9))  # computed for a finished request
    assert outputs_of(s) == [] and s.kv.pool.num_free == 64
    assert s.schedule().plan.finished_ids == ["a"]


def test_max_tokens_is_never_overbooked():
    s = make_scheduler()
    submit(s, "a", 3, max_tokens=2)
    first, second = s.schedule(), s.schedule()
    assert second.num_scheduled == {"a": 1}
    assert s.schedule().is_empty  # both tokens are booked: nothing more to plan for it
    s.update_from_output(first, result_for(first))
    s.update_from_output(second, result_for(second))
    outs = outputs_of(s)
    assert [o.new_token_ids for o in outs] == [[5], [5]] and outs[-1].finish_reason == FinishReason.LENGTH


def test_abort_while_a_step_is_in_flight():
    s = make_scheduler()
    submit(s, "a", 6)
    first = s.schedule()
    s.abort(["a"])
    assert s.kv.pool.num_free == 64  # freed at once; the worker runs plans in order, so reuse is safe
    s.update_from_output(first, result_for(first))
    [out] = outputs_of(s)
    assert out.finish_reason == FinishReason.ABORT and out.new_token_ids == []


def test_failed_step_leaves_no_prefix_cache_hits():
    """Issue 10 acceptance 2: blocks join the prefix cache only once the step that wrote them returned."""
    s = make_scheduler(num_blocks=16, block_size=16)
    prompt = 40
    submit(s, "a", prompt)
    failed = s.schedule()
    s.fail_step(failed, 500, "boom")
    [out] = outputs_of(s)
    assert out.finish_reason == FinishReason.ERROR and out.error_status == 500
    submit(s, "b", prompt)
    step = s.schedule()
    assert step.num_scheduled == {"b": prompt}  # nothing cached from the failed step
    s.update_from_output(step, result_for(step))
    submit(s, "c", prompt)
    step = s.schedule()
    assert step.scheduled["c"].start == 32  # b's step returned: its two full blocks are hits
    s.kv.pool.check_invariants()


def test_blocks_of_a_step_in_flight_are_not_hits_yet():
    s = make_scheduler(num_blocks=16, block_size=16)
    submit(s, "a", 40)
    first = s.schedule()
    submit(s, "b", 40)
    second = s.schedule()
    assert second.scheduled["b"].start == 0  # a's blocks are allocated but not known written
    s.update_from_output(first, result_for(first))
    s.update_from_output(second, result_for(second))
    submit(s, "c", 40)
    assert s.schedule().scheduled["c"].start == 32


def test_reused_request_id_after_abort_is_a_new_request():
    """Issue 10 acceptance 3: neither the waiting queue nor the deadline heap may return or time out the old one."""
    s = make_scheduler(max_num_seqs=1)
    submit(s, "busy", 4, max_tokens=50)
    s.update_from_output(step := s.schedule(), result_for(step))
    submit(s, "x", 4, timeout=5.0)  # waits behind "busy" (max_num_seqs=1), with a deadline
    old = s.requests["x"]
    s.abort(["x"])
    submit(s, "x", 6, max_tokens=3)  # same id, new request, no deadline
    new = s.requests["x"]
    assert new is not old and old.status == RequestStatus.FINISHED
    s.expire(old.deadline + 1)  # the old deadline passes: the new request must not time out
    assert s.requests["x"] is new and s.num_timed_out == 0
    s.abort(["busy"])
    outputs_of(s)
    step = s.schedule()
    entry = step.scheduled["x"]  # its first block may be a prefix hit on "busy"'s: same leading tokens
    assert entry.request is new and entry.start + entry.num_new == 6
    assert step.plan.new_requests[0].token_ids == new.prompt_token_ids
    assert len(s.waiting) == 0 and s.waiting.peek() is None


def test_preempted_request_drops_its_in_flight_token_and_resumes_as_new():
    s = make_scheduler(num_blocks=4, block_size=2)
    submit(s, "a", 2, max_tokens=4, ignore_eos=True)
    submit(s, "b", 2, max_tokens=4, ignore_eos=True)
    for _ in range(2):  # prefill, then a decode that opens a second block each: all 4 blocks in use
        s.update_from_output(step := s.schedule(), result_for(step))
    outputs_of(s)
    in_flight = s.schedule()  # both decode position 3, still in their second blocks
    preempting = s.schedule()  # position 4 needs a third block each: "b" (later arrival) is preempted
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.num_preemptions == 1
    assert "b" not in preempting.scheduled and "b" in preempting.plan.finished_ids
    s.update_from_output(in_flight, result_for(in_flight, lambda rid: 11))
    assert s.requests["b"].output_token_ids == [5, 5]  # the token sampled for the old epoch is dropped
    assert s.requests["a"].output_token_ids == [5, 5, 11]
    s.update_from_output(preempting, result_for(preempting))
    while "a" in s.requests:
        s.update_from_output(step := s.schedule(), result_for(step))
    outputs_of(s)
    step = s.schedule()
    [resumed] = step.plan.new_requests
    assert resumed.request_id == "b" and resumed.token_ids == [10, 11, 5, 5] and resumed.prompt_len == 2
    s.kv.pool.check_invariants()


def test_randomized_with_two_steps_in_flight_never_leaks_and_ends_each_request_once():
    rng = random.Random(11)
    s = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    ids = itertools.count()
    terminal: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    in_flight = deque()

    def collect():
        for o in outputs_of(s):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
                if o.finish_reason == FinishReason.LENGTH:
                    assert len(tokens[o.request_id]) == max_tokens[o.request_id]

    for _ in range(1500):
        if rng.random() < 0.3:
            rid = f"q{next(ids)}"
            max_tokens[rid] = rng.randrange(1, 40)
            submit(s, rid, rng.randrange(1, 30), max_tokens=max_tokens[rid])
        if s.requests and rng.random() < 0.05:
            s.abort([rng.choice(sorted(s.requests))])
        if len(in_flight) < 2 and s.has_work:
            step = s.schedule()
            if not step.is_empty:
                in_flight.append(step)
        if in_flight and (len(in_flight) == 2 or rng.random() < 0.5):
            step = in_flight.popleft()
            if rng.random() < 0.02:
                s.fail_step(step, 500, "injected")
            else:
                s.update_from_output(step, result_for(step, lambda rid: EOS if rng.random() < 0.05 else 9))
        s.kv.pool.check_invariants()
        collect()
    while in_flight:
        s.update_from_output(step := in_flight.popleft(), result_for(step))
    s.abort(list(s.requests))
    collect()
    assert s.kv.pool.num_free == 24 and not s.has_work and s.num_preemptions > 0
    assert set(terminal.values()) == {1} and len(terminal) == next(ids)


def test_short_prompt_gets_its_first_token_while_a_long_one_is_chunked():
    """Issue 12 acceptance 5: a 4,000-token prompt under a 512-token budget does not hold a 20-token one back."""
    s = make_scheduler(num_blocks=1200, block_size=4, max_model_len=8192, max_num_batched_tokens=512)
    submit(s, "long", 4000, max_tokens=4)
    in_flight = deque([s.schedule()])  # the long prefill's first chunk runs
    submit(s, "short", 20, max_tokens=4)
    first_token_step = None
    for step_number in range(1, 10):
        in_flight.append(s.schedule())
        settled = in_flight.popleft()
        s.update_from_output(settled, result_for(settled))
        if any(o.request_id == "short" and o.new_token_ids for o in outputs_of(s)):
            first_token_step = step_number
            break
    assert first_token_step is not None and first_token_step <= 3
    assert s.requests["long"].num_computed_tokens < 4000  # the long prompt is still being prefilled


def test_without_others_waiting_a_long_prefill_uses_the_whole_budget():
    s = make_scheduler(num_blocks=1200, block_size=4, max_model_len=8192, max_num_batched_tokens=512)
    submit(s, "long", 4000, max_tokens=4)
    assert s.schedule().num_scheduled == {"long": 512}
    assert s.schedule().num_scheduled == {"long": 512}
