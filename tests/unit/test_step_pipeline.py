"""One step pipeline (scheduler/pipeline.py) behind every loop that drives the Scheduler: the same fabricated
workload through the served loop (scheduler/loop.py over real ZeroMQ sockets, a scripted worker thread), the
in-process engine (scheduler/in_process.py, a scripted runner) and the simulator (capacity/simulator.py, virtual time)
gives the same sequence of steps, request by request and token by token, with one step in flight and with two."""

from __future__ import annotations

import threading

import msgspec
import pytest

from shuttle.capacity.simulator import FILLER_TOKEN, Simulator
from shuttle.capacity.workload import SimRequest
from shuttle.common.config import CacheConfig, SchedulerConfig
from shuttle.common.messages import Shutdown, StepPlan, StepResult, Submit, WorkerReady
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.pipeline import StepPipeline
from shuttle.scheduler.scheduler import Scheduler
from shuttle.scheduler.step_cost import StepCostModel
from tests.scheduler_peers import scheduler_with_peers

PROMPT_LENS = (40, 7, 25, 60, 3, 33, 18)
OUTPUT_LENS = (5, 9, 3, 4, 12, 6, 7)
NUM_BLOCKS, BLOCK_SIZE = 8, 16  # 128 token slots for 186 prompt and 46 output tokens: preemption happens
MAX_MODEL_LEN = 512  # the test model's, which the served loop reads from its directory


def budgets(async_scheduling: bool) -> SchedulerConfig:
    return SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=async_scheduling)


def prompt(i: int) -> list[int]:
    return [10 + (i * 7 + j) % 50 for j in range(PROMPT_LENS[i])]


def submit(i: int) -> Submit:
    sampling = SamplingParams(max_tokens=OUTPUT_LENS[i], ignore_eos=True, temperature=0.0)
    return Submit(request_id=str(i), prompt_token_ids=prompt(i), sampling=sampling, arrival_time=0.0)


def recording(scheduler: Scheduler) -> tuple[list, dict]:
    """Wrap scheduler.schedule to record every non-empty step: (request id, first token, tokens) per request, and
    the ids that sample in it by step id (the scripted worker's answer)."""
    steps, sampling = [], {}
    schedule = scheduler.schedule

    def recorded():
        step = schedule()
        if not step.is_empty:
            steps.append(sorted((rid, e.start, e.num_new) for rid, e in step.scheduled.items()))
            sampling[step.plan.step_id] = step.sampling_ids
        return step
    scheduler.schedule = recorded
    return steps, sampling


def filler_result(plan: StepPlan, sampling: dict) -> StepResult:
    ids = sampling[plan.step_id]
    return StepResult(step_id=plan.step_id, request_ids=ids, token_ids=[FILLER_TOKEN] * len(ids))


def in_process_steps(async_scheduling: bool) -> tuple[list, int]:
    """The recorded steps and the number of preemptions."""
    scheduler = Scheduler(budgets(async_scheduling), KVCacheManager(NUM_BLOCKS, BLOCK_SIZE), MAX_MODEL_LEN, ())
    steps, sampling = recording(scheduler)
    for i in range(len(PROMPT_LENS)):
        scheduler.add_request(b"c", submit(i))

    class Runner:
        def execute(self, plan):
            return filler_result(plan, sampling)
    drive(scheduler, Runner(), lambda outputs: None, max_in_flight=2 if async_scheduling else 1, check_blocks=True)
    return steps, scheduler.num_preemptions


def simulated_steps(async_scheduling: bool) -> list:
    simulator = Simulator(budgets(async_scheduling), NUM_BLOCKS, BLOCK_SIZE, MAX_MODEL_LEN,
                          StepCostModel({"step": 0.01}))
    steps, _ = recording(simulator.scheduler)
    result = simulator.run([SimRequest(0.0, prompt(i), OUTPUT_LENS[i]) for i in range(len(PROMPT_LENS))])
    assert [len(r.token_times) for r in result.records] == list(OUTPUT_LENS)
    return steps


class _Finished(Exception):
    pass


def served_steps(async_scheduling: bool, tmp_path) -> list:
    encode = msgspec.msgpack.encode
    with scheduler_with_peers(tmp_path, cache=CacheConfig(block_size=BLOCK_SIZE),
                              scheduler=budgets(async_scheduling)) as peers:
        loop, results = peers.loop, peers.results
        results.send(encode(WorkerReady(rank=0, num_kv_blocks=NUM_BLOCKS, kv_bytes_per_token=64, weight_bytes=1)))
        loop.wait_for_worker()
        assert loop.scheduler.max_model_len == MAX_MODEL_LEN
        steps, sampling = recording(loop.scheduler)
        for i in range(len(PROMPT_LENS)):
            peers.frontend.send(encode(submit(i)))
        for _ in range(500):  # every Submit taken before the first step, as in the other two loops
            loop._drain_inbox(10)
            if len(loop.scheduler.requests) == len(PROMPT_LENS):
                break
        assert len(loop.scheduler.requests) == len(PROMPT_LENS)

        def scripted_worker():
            while isinstance(plan := peers.plans.recv(), StepPlan):
                results.send(encode(filler_result(plan, sampling)))
        worker = threading.Thread(target=scripted_worker, daemon=True)
        worker.start()
        publish = loop._publish

        def publish_until_done():
            publish()
            if not loop.scheduler.requests and not loop.pipeline.in_flight:
                raise _Finished
        loop._publish = publish_until_done
        try:
            with pytest.raises(_Finished):
                loop.run()
        finally:
            loop.plans[0].send(Shutdown())
            worker.join(10)
        return steps


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["two_in_flight", "one_in_flight"])
def test_the_three_loops_take_the_same_steps(async_scheduling, tmp_path):
    in_process, preemptions = in_process_steps(async_scheduling)
    assert len(in_process) > len(PROMPT_LENS) and preemptions > 0
    assert any(start > 0 and num_new > 1 for step in in_process for _, start, num_new in step), "chunked prefill"
    assert simulated_steps(async_scheduling) == in_process
    assert served_steps(async_scheduling, tmp_path) == in_process


def test_the_step_sequence_depends_on_the_pipeline_depth():
    """What the comparison above can see: one step in flight and two plan differently on this workload."""
    assert in_process_steps(True)[0] != in_process_steps(False)[0]


def test_a_pipeline_settles_what_it_planned_in_order():
    scheduler = Scheduler(budgets(True), KVCacheManager(NUM_BLOCKS, BLOCK_SIZE), MAX_MODEL_LEN, ())
    pipeline = StepPipeline(scheduler, max_in_flight=2)
    assert not pipeline.can_plan and not pipeline.must_settle(planned=False)
    scheduler.add_request(b"c", submit(1))
    first = pipeline.plan()
    assert first is not None and not pipeline.must_settle(planned=True)  # a slot is still free: plan ahead
    second = pipeline.plan()
    assert second is not None and pipeline.must_settle(planned=True) and not pipeline.can_plan
    assert pipeline.settle(StepResult(step_id=first.plan.step_id, request_ids=first.sampling_ids,
                                      token_ids=[FILLER_TOKEN] * len(first.sampling_ids))) is first
    assert pipeline.oldest is second
    with pytest.raises(ValueError):
        StepPipeline(scheduler, max_in_flight=0)
