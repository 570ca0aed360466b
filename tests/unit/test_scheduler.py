"""The scheduler without a model: driven by fabricated sampled tokens, the block pool checked every step."""

import itertools
import random

from shuttle.common.config import SchedulerConfig
from shuttle.common.messages import FinishReason, StepResult, Submit
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_model_len=128, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(**config), KVCacheManager(num_blocks, block_size), max_model_len, (EOS,))


_arrival = itertools.count()


def submit(s: Scheduler, rid: str, prompt_len: int, max_tokens: int = 8, client=b"c", timeout: float = 0.0,
           **sampling) -> None:
    s.add_request(client, Submit(request_id=rid, prompt_token_ids=list(range(10, 10 + prompt_len)),
                                 sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                                 arrival_time=float(next(_arrival)), timeout=timeout))


def run_step(s: Scheduler, token_for=lambda rid: 5):
    step = s.schedule()
    s.kv.pool.check_invariants()
    sampled = step.sampling_ids
    s.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=sampled,
                                          token_ids=[token_for(rid) for rid in sampled]))
    s.kv.pool.check_invariants()
    return step, s.take_outputs()


def test_chunked_prefill_respects_token_budget_and_decodes_first():
    s = make_scheduler(max_num_batched_tokens=8)
    submit(s, "short", 3, max_tokens=10)
    step, _ = run_step(s)
    assert step.num_scheduled == {"short": 3}
    submit(s, "long", 20)
    step, _ = run_step(s)
    assert step.num_scheduled == {"short": 1, "long": 7}  # decode first, prompt chunked into the rest
    step, _ = run_step(s)
    assert step.num_scheduled == {"short": 1, "long": 7}
    step, outputs = run_step(s)
    assert step.num_scheduled == {"short": 1, "long": 6}
    assert [o.request_id for o in outputs[b"c"]] == ["short", "long"]  # long sampled its first token


def test_stops_on_eos_max_tokens_and_max_model_len():
    s = make_scheduler(max_model_len=12)
    submit(s, "eos", 3, max_tokens=50)
    submit(s, "len", 3, max_tokens=4)
    submit(s, "ctx", 8, max_tokens=50, ignore_eos=True)
    finished = {}
    for i in range(10):
        _, outputs = run_step(s, lambda rid, i=i: EOS if rid in ("eos", "ctx") and i == 2 else 7)
        for o in outputs.get(b"c", []):
            if o.finish_reason is not None:
                finished[o.request_id] = o.finish_reason
    assert finished == {"eos": FinishReason.STOP, "len": FinishReason.LENGTH, "ctx": FinishReason.LENGTH}
    assert not s.has_work and s.kv.pool.num_free == 64


def test_max_num_seqs_and_queue_bound():
    s = make_scheduler(max_num_seqs=2, max_waiting_requests=3)
    for i in range(5):
        submit(s, f"r{i}", 2)
    outputs = s.take_outputs()[b"c"]
    assert [(o.request_id, o.error_status) for o in outputs] == [("r3", 503), ("r4", 503)]
    step, _ = run_step(s)
    assert sorted(step.num_scheduled) == ["r0", "r1"]


def test_never_fitting_request_is_rejected():
    s = make_scheduler(num_blocks=4, block_size=4)
    submit(s, "huge", 10, max_tokens=10)
    [out] = s.take_outputs()[b"c"]
    assert out.finish_reason == FinishReason.ERROR and out.error_status == 400
    assert not s.has_work


def test_a_prompt_that_leaves_no_room_in_max_model_len_is_rejected():
    """The frontend checks its own max_model_len; a remote group's may be smaller (the worker then failed the step)."""
    s = make_scheduler(max_model_len=32)
    submit(s, "long", 32, max_tokens=4)
    submit(s, "fits", 31, max_tokens=4)
    [out] = s.take_outputs()[b"c"]
    assert (out.request_id, out.finish_reason, out.error_status) == ("long", FinishReason.ERROR, 400)
    assert "max_model_len 32" in out.error_message and list(s.requests) == ["fits"]


def test_preemption_recomputes_and_every_request_finishes():
    s = make_scheduler(num_blocks=12, block_size=4)
    for i in range(6):
        submit(s, f"r{i}", 8, max_tokens=12, ignore_eos=True)
    produced = {f"r{i}": [] for i in range(6)}
    finished = set()
    for _ in range(400):
        if not s.has_work:
            break
        _, outputs = run_step(s, lambda rid: 3)
        for o in outputs.get(b"c", []):
            produced[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                finished.add(o.request_id)
    assert finished == set(produced) and all(len(t) == 12 for t in produced.values())
    assert s.num_preemptions > 0
    assert s.kv.pool.num_free == 12


def test_abort_frees_blocks_and_tells_worker():
    s = make_scheduler()
    submit(s, "a", 6)
    run_step(s)
    assert s.kv.pool.num_free < 64
    s.abort(["a", "unknown"])
    assert s.kv.pool.num_free == 64
    [out] = s.take_outputs()[b"c"]
    assert out.finish_reason == FinishReason.ABORT
    step = s.schedule()
    assert step.plan.finished_ids == ["a"]


def test_randomized_submits_aborts_and_finishes_never_leak():
    rng = random.Random(3)
    s = make_scheduler(num_blocks=24, block_size=4, max_num_batched_tokens=16, max_num_seqs=6)
    ids = itertools.count()
    terminal: dict[str, int] = {}
    for _ in range(600):
        if rng.random() < 0.4:
            submit(s, f"q{next(ids)}", rng.randrange(1, 30), max_tokens=rng.randrange(1, 40))
        if s.requests and rng.random() < 0.1:
            s.abort([rng.choice(sorted(s.requests))])
        if s.has_work:
            _, outputs = run_step(s, lambda rid: EOS if rng.random() < 0.05 else 9)
        else:
            outputs = s.take_outputs()
        for o in outputs.get(b"c", []):
            if o.finish_reason is not None:
                terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
    s.abort(list(s.requests))
    for o in s.take_outputs().get(b"c", []):
        terminal[o.request_id] = terminal.get(o.request_id, 0) + 1
    assert s.kv.pool.num_free == 24 and not s.has_work and s.num_preemptions > 0
    assert set(terminal.values()) == {1} and len(terminal) == next(ids)  # exactly one terminal output each


def _order_of_first_tokens(s: Scheduler, steps: int) -> list[str]:
    """Request ids in the order their first token came out, over `steps` fabricated steps."""
    order: list[str] = []
    for _ in range(steps):
        _, outputs = run_step(s)
        for o in outputs.get(b"c", []):
            if o.request_id not in order:
                order.append(o.request_id)
    return order


def _submit_at(s: Scheduler, rid: str, arrival: float, priority: int) -> None:
    s.add_request(b"c", Submit(request_id=rid, prompt_token_ids=[10, 11], sampling=SamplingParams(max_tokens=1),
                               arrival_time=arrival, priority=priority))


def test_priority_aging_lets_an_old_low_priority_request_overtake_a_stream_of_urgent_ones():
    # Fabricated arrival times: "low" (priority 5) at t=0, then urgent (priority 0) requests at t=10, 20, ..., 100.
    # With 10 s of waiting worth one level, "low" ranks 5 + 0/10 = 5, the urgent one from t ranks t/10: it runs
    # after those that arrived before t=50 and before the rest (the tie with t=50 goes to the older request).
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", priority_aging_seconds=10.0)
    _submit_at(s, "low", 0.0, priority=5)
    for t in range(10, 101, 10):
        _submit_at(s, f"urgent@{t}", float(t), priority=0)
    order = _order_of_first_tokens(s, 11)
    assert order == [f"urgent@{t}" for t in range(10, 41, 10)] + ["low"] + [f"urgent@{t}" for t in range(50, 101, 10)]


def test_priority_without_aging_runs_every_urgent_request_first():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", priority_aging_seconds=0.0)
    _submit_at(s, "low", 0.0, priority=5)
    for t in range(10, 101, 10):
        _submit_at(s, f"urgent@{t}", float(t), priority=0)
    assert _order_of_first_tokens(s, 11) == [f"urgent@{t}" for t in range(10, 101, 10)] + ["low"]
