"""A draining scheduler (a `shuttle engine` that got SIGTERM; scheduler/loop.py's drain_requested): it tells every
frontend at once (SchedulerInfo with draining), refuses a request that arrives afterwards with one 503, finishes the
requests it holds, token for token, and then run() returns.

The real SchedulerLoop over ZeroMQ in this process, a scripted worker thread answering every step.
"""

from __future__ import annotations

import threading

import msgspec
import zmq

from shuttle.common.messages import (
    FinishReason,
    Hello,
    SchedulerInfo,
    SchedulerMessage,
    Shutdown,
    StepOutputs,
    StepPlan,
    StepResult,
    Submit,
    WorkerReady,
)
from shuttle.common.sampling import SamplingParams
from tests.scheduler_peers import scheduler_with_peers

OUTPUT_LENS = (5, 9, 3)
TOKEN = 7


def submit(request_id: str, max_tokens: int) -> bytes:
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    return msgspec.msgpack.encode(Submit(request_id=request_id, prompt_token_ids=[1, 2, 3, 4], sampling=sampling,
                                         arrival_time=0.0))


def test_a_drain_finishes_what_it_holds_refuses_what_comes_and_returns(tmp_path):
    decode = msgspec.msgpack.Decoder(SchedulerMessage).decode
    with scheduler_with_peers(tmp_path) as peers:
        loop, results = peers.loop, peers.results
        results.send(msgspec.msgpack.encode(WorkerReady(rank=0, num_kv_blocks=64, kv_bytes_per_token=64,
                                                        weight_bytes=1)))
        loop.wait_for_worker()
        peers.frontend.send(msgspec.msgpack.encode(Hello()))
        for i, n in enumerate(OUTPUT_LENS):
            peers.frontend.send(submit(f"r{i}", n))
        for _ in range(500):
            loop._drain_inbox(10)
            if len(loop.scheduler.requests) == len(OUTPUT_LENS):
                break
        assert len(loop.scheduler.requests) == len(OUTPUT_LENS)
        sampling: dict[int, list[str]] = {}
        schedule = loop.scheduler.schedule

        def recorded():
            step = schedule()
            sampling[step.plan.step_id] = step.sampling_ids
            return step
        loop.scheduler.schedule = recorded

        def scripted_worker():
            while isinstance(plan := peers.plans.recv(), StepPlan):
                ids = sampling[plan.step_id]
                results.send(msgspec.msgpack.encode(StepResult(step_id=plan.step_id, request_ids=ids,
                                                               token_ids=[TOKEN] * len(ids))))
        worker = threading.Thread(target=scripted_worker, daemon=True)
        worker.start()
        loop.drain_requested = True  # what DRAIN_SIGNAL's handler sets
        peers.frontend.send(submit("late", 4))  # reaches the scheduler after it started draining
        try:
            loop.run()  # returns: drained
        finally:
            loop.plans[0].send(Shutdown())
            worker.join(10)
        assert loop.draining and not loop.scheduler.requests and not loop.pipeline.in_flight

        infos, tokens, ends = [], {}, {}
        while len(ends) < len(OUTPUT_LENS) + 1 or peers.frontend.poll(200):  # every end, then anything after
            assert peers.frontend.poll(10_000), f"no more answers; ends so far: {sorted(ends)}"
            msg = decode(peers.frontend.recv())
            if isinstance(msg, SchedulerInfo):
                infos.append(msg.draining)
            elif isinstance(msg, StepOutputs):
                for output in msg.outputs:
                    tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                    if output.finish_reason is not None:
                        assert output.request_id not in ends, "a second terminal output"
                        ends[output.request_id] = output
    assert infos == [False, True]  # the answer to Hello, then the drain, before any output of the drain
    assert {rid: end.finish_reason for rid, end in ends.items()} == {
        "r0": FinishReason.LENGTH, "r1": FinishReason.LENGTH, "r2": FinishReason.LENGTH, "late": FinishReason.ERROR}
    assert ends["late"].error_status == 503 and "shutting down" in ends["late"].error_message
    assert {rid: len(t) for rid, t in tokens.items() if rid != "late"} == {
        f"r{i}": n for i, n in enumerate(OUTPUT_LENS)}


def test_a_frontend_that_says_hello_while_draining_hears_of_the_drain(tmp_path):
    with scheduler_with_peers(tmp_path) as peers:
        peers.results.send(msgspec.msgpack.encode(WorkerReady(rank=0, num_kv_blocks=64, kv_bytes_per_token=64,
                                                              weight_bytes=1)))
        peers.loop.wait_for_worker()
        peers.loop.drain_requested = True
        peers.loop.run()  # nothing to finish: returns after one turn, draining
        peers.frontend.send(msgspec.msgpack.encode(Hello()))
        for _ in range(500):  # until the Hello is taken, however slowly the socket connects
            peers.loop._drain_inbox(10)
            if peers.loop.clients:
                break
        assert peers.frontend.poll(10_000, zmq.POLLIN)
        info = msgspec.msgpack.decode(peers.frontend.recv(), type=SchedulerMessage)
        assert isinstance(info, SchedulerInfo) and info.draining
