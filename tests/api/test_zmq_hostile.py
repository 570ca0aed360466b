"""Issue 24: every ZeroMQ socket reader survives any bytes.

The batch endpoint (a ROUTER any local user can reach) is driven in-process (the real app over the scripted fake
engine): the issue's 1,000-deep message beside a healthy BatchClient, a 1 GiB frame against the frontend's RSS,
the size limit's flag, and a fuzz run of every malformed kind. The internal sockets (scheduler, worker, frontend
<-> scheduler, launcher) are driven through their own reader code with fabricated peers: each malformed message is
counted, warned about at most once per peer per minute, and the next good message is read.
"""

import asyncio
import logging
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from shuttle.batch_jobs.client import AsyncBatchClient
from shuttle.common.config import CacheConfig, IpcConfig, OpsConfig, ShuttleConfig
from shuttle.common.ipc import AsyncChannel, Channel, MalformedMessage
from shuttle.common.messages import (
    BatchHeartbeat,
    BatchServerMessage,
    EngineDown,
    FinishReason,
    FrontendMessage,
    Heartbeat,
    Hello,
    PlanMessage,
    RequestOutput,
    SchedulerInfo,
    SchedulerStats,
    Shutdown,
    StepOutputs,
    StepPlan,
    StepResult,
    Submit,
    WorkerMessage,
    WorkerReady,
)
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.common.wire_guard import nesting_exceeds
from shuttle.frontend.app import MAX_BODY_BYTES
from shuttle.launcher.cli import build_parser
from tests.batch_wire import HANG, dealer, next_response
from tests.inprocess import start_app
from tests.malformed import (
    batch_job,
    batch_kinds,
    deep_request,
    internal_kinds,
    malformed_batch_frames,
    send_frame_of,
)
from tests.scheduler_peers import scheduler_with_peers
from tests.server import MODEL_DIR, REPO

KEY = "sk-hostile"


@pytest.fixture(scope="module")
async def app():
    app = await start_app(api_key=KEY, batch=True)
    yield app
    await app.close()


async def scrape(app) -> tuple[dict, str]:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{app.url}/health") as response:
            health = await response.json()
        async with session.get(f"{app.url}/metrics") as response:
            metrics = await response.text()
    return health, metrics


def counter(metrics: str, reason: str) -> float:
    match = re.search(rf'^shuttle:batch_malformed_messages_total{{reason="{reason}"}} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


# ---- the batch endpoint ------------------------------------------------------------------------------------------

async def test_a_deeply_nested_message_is_refused_while_a_healthy_client_runs_on(app):
    app.engine.step_delay = 0.005
    bad = await dealer(app.batch.endpoint)
    jobs = [{"custom_id": str(i), "body": {"prompt": "Hi", "max_tokens": 4}} for i in range(30)]
    results, refusal = [], None
    try:
        async with asyncio.timeout(HANG), AsyncBatchClient(app.batch.endpoint, max_in_flight=2, api_key=KEY) as client:
            async for result in client.run(jobs):
                results.append(result)
                if len(results) == 5:  # the healthy client has 25 jobs still to send
                    await bad.send(deep_request(1000))
                    refusal = await next_response(bad)
    finally:
        app.engine.step_delay = 0.0
        bad.close()
    assert sorted(int(r.job_id) for r in results) == list(range(30))
    assert {r.status_code for r in results} == {200}
    assert (refusal.job_id, refusal.status_code) == ("", 400)
    assert "nested deeper than" in refusal.body["error"]["message"]
    health, metrics = await scrape(app)
    assert health["status"] == "ok" and health["batch"]["malformed_messages"] >= 1
    assert counter(metrics, "depth") >= 1


def peak_rss_mib() -> float:
    return int(re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) / 1024


async def test_a_1_gib_frame_is_refused_before_it_is_buffered(app):
    """The frontend is this process: its peak RSS is reset (clear_refs 5), then read after the frame."""
    Path("/proc/self/clear_refs").write_text("5")
    before = peak_rss_mib()
    sent, hung_up = await send_frame_of(app.batch.endpoint, 2**30)
    growth = peak_rss_mib() - before
    print(f"1 GiB frame: {sent} bytes taken before the endpoint hung up; peak RSS {before:.0f} MiB + {growth:.1f} MiB")
    assert hung_up and sent < 2**30
    assert growth < 64
    sock = await dealer(app.batch.endpoint)
    try:
        await sock.send(batch_job("after", KEY))
        assert (await next_response(sock)).status_code == 200
    finally:
        sock.close()


def job_of_size(size: int) -> tuple[bytes, str]:
    """A valid job whose encoding is exactly `size` bytes (its job id padded), and that job id."""
    for pad in range(size):
        job_id = "j" * pad
        frame = batch_job(job_id, KEY)
        if len(frame) == size:
            return frame, job_id
    raise ValueError(size)


async def test_the_size_limit_is_a_flag_and_a_frame_at_it_is_still_served():
    args = build_parser().parse_args(["serve", str(MODEL_DIR), "--max-batch-message-bytes", "2KiB"])
    assert ShuttleConfig.from_args(args, None).ops.max_batch_message_bytes == 2048
    assert OpsConfig().max_batch_message_bytes == MAX_BODY_BYTES  # HTTP bodies' limit by default
    small = await start_app(api_key=KEY, batch=True, max_batch_message_bytes=2048)
    sock = await dealer(small.batch.endpoint)
    try:
        sent, hung_up = await send_frame_of(small.batch.endpoint, 2049)
        assert hung_up
        frame, job_id = job_of_size(2048)
        await sock.send(frame)
        answer = await next_response(sock)
        assert (answer.job_id, answer.status_code) == (job_id, 200)
    finally:
        sock.close()
        await small.close()


def test_fuzz_every_malformed_kind_at_the_batch_endpoint_then_a_job_runs(caplog):
    """One peer sends every kind (each answered 400, naming the job when it can be read; one warning in all);
    an oversized frame loses its connection; then hypothesis draws more; a real job still runs."""
    caplog.set_level(logging.INFO)
    loop = asyncio.new_event_loop()
    app = loop.run_until_complete(start_app(api_key=KEY, batch=True))
    kinds = batch_kinds(KEY)

    async def every_kind() -> list[tuple[str, object]]:
        sock = await dealer(app.batch.endpoint)
        try:
            answers = []
            for name, (frames, _) in kinds.items():
                await sock.send_multipart(frames)
                answers.append((name, await next_response(sock)))
            return answers
        finally:
            sock.close()

    async def drawn(messages: list[list[bytes]]) -> None:
        sock = await dealer(app.batch.endpoint)
        try:
            for frames in messages:
                await sock.send_multipart(frames)
            for _ in messages:  # one answer each, never a 5xx
                answer = await next_response(sock)
                assert answer.status_code < 500, (messages, answer)
        finally:
            sock.close()

    async def real_job():
        sock = await dealer(app.batch.endpoint)
        try:
            await sock.send(batch_job("real", KEY, max_tokens=8))
            return await next_response(sock)
        finally:
            sock.close()

    @settings(max_examples=60, deadline=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(malformed_batch_frames(KEY), min_size=1, max_size=4))
    def fuzz(messages):
        loop.run_until_complete(asyncio.wait_for(drawn(messages), HANG))

    try:
        answers = loop.run_until_complete(every_kind())
        for name, answer in answers:
            assert (answer.job_id, answer.status_code) == (kinds[name][1], 400), name
            assert answer.body["error"]["message"].startswith("malformed message"), name
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) == 1 and "malformed" in warnings[0].getMessage(), [r.getMessage() for r in warnings]
        assert app.batch.stats()["malformed_messages"] == len(kinds)
        sent, hung_up = loop.run_until_complete(send_frame_of(app.batch.endpoint, MAX_BODY_BYTES + 1))
        assert hung_up
        fuzz()
        answer = loop.run_until_complete(real_job())
        assert answer.status_code == 200 and answer.body["choices"][0]["text"]
        assert not any(t.done() for t in app.tasks)  # the endpoint's receive loop still runs
    finally:
        loop.run_until_complete(app.close())
        loop.close()


def test_a_deep_message_cannot_blow_the_c_stack():
    """msgspec recurses on the C stack once per level, guarded only by the recursion limit: with that limit
    raised and a small thread stack, decoding 1,000,000 levels crashes the process. The batch endpoint's channel
    scans the depth before decoding, so the same message is refused in that setting too."""
    code = """
import sys, threading, zmq
from shuttle.common.ipc import Channel
from shuttle.common.messages import BatchClientMessage
from shuttle.frontend.transports.zmq_batch import MAX_DEPTH
from tests.malformed import deep_request
sys.setrecursionlimit(10**7)
threading.stack_size(256 * 1024)
ctx = zmq.Context()
pull = Channel(ctx, zmq.PULL, "inproc://deep", bind=True, recv_type=BatchClientMessage, max_depth=MAX_DEPTH)
push = ctx.socket(zmq.PUSH); push.connect("inproc://deep")
push.send(deep_request(1_000_000))
got = []
thread = threading.Thread(target=lambda: got.append(pull.recv())); thread.start(); thread.join()
print("refused" if got == [None] and pull.num_malformed == 1 else f"got {got!r}")
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=HANG)
    assert (done.returncode, done.stdout.strip()) == (0, "refused"), done.stderr[-2000:]


def depth_of(value) -> int:
    if isinstance(value, (list, tuple)):
        return 1 + max(map(depth_of, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth_of, [*value, *value.values()]), default=0)
    return 0


scalars = st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=40) | \
    st.binary(max_size=300) | st.builds(msgspec.msgpack.Ext, st.integers(0, 127), st.binary(max_size=20))
values = st.recursive(scalars | st.lists(st.integers(-40, 70000), max_size=300),
                      lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=3), inner,
                                                                                  max_size=4), max_leaves=60)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(values, st.integers(0, 12))
@example([[1, 2], 3, [4]], 2)  # a run of scalars ends with its container, not with the scalars after it
@example([[300, 301], 302, [[1]]], 3)
@example([[-1, -2], -3, [[]]], 3)
def test_the_depth_scan_agrees_with_the_decoded_value(value, limit):
    data = msgspec.msgpack.encode(value)
    assert nesting_exceeds(data, limit) == (depth_of(value) > limit)
    nesting_exceeds(data[:len(data) // 2], limit)  # truncated: any answer, never an exception


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.binary(max_size=200), st.integers(0, 4))
def test_the_depth_scan_takes_any_bytes(data, limit):
    nesting_exceeds(data, limit)


# ---- the internal sockets: their reader code with fabricated peers ----------------------------------------------

def warnings_about_malformed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and "malformed" in r.getMessage()]


def test_sync_readers_drop_every_malformed_kind_and_read_on(tmp_path, caplog):
    ctx = zmq.Context()
    ready = WorkerReady(rank=0, num_kv_blocks=10, kv_bytes_per_token=64, weight_bytes=100)
    kinds = internal_kinds(msgspec.msgpack.encode(ready))
    pull = Channel(ctx, zmq.PULL, f"ipc://{tmp_path}/pull.sock", bind=True, recv_type=WorkerMessage)
    router = Channel(ctx, zmq.ROUTER, f"ipc://{tmp_path}/router.sock", bind=True, recv_type=FrontendMessage)
    push, peer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.ROUTING_ID, b"peer")
    push.connect(f"ipc://{tmp_path}/pull.sock")
    peer.connect(f"ipc://{tmp_path}/router.sock")
    try:
        for frames in kinds.values():
            push.send_multipart(frames)
            peer.send_multipart(frames)
        push.send(msgspec.msgpack.encode(ready))
        peer.send(msgspec.msgpack.encode(Hello()))
        assert [pull.recv() for _ in kinds] == [None] * len(kinds)
        assert pull.recv() == ready
        for name in kinds:
            with pytest.raises(MalformedMessage) as refused:
                router.recv_from()
            assert refused.value.identity == b"peer", name
        assert router.recv_from() == (b"peer", Hello())
        assert pull.num_malformed == router.num_malformed == len(kinds)
        assert len(warnings_about_malformed(caplog)) == 2  # one per socket and peer, however many messages
    finally:
        for sock in (push, peer, pull, router):
            sock.close()
        ctx.term()


async def test_async_readers_drop_every_malformed_kind_and_read_on(tmp_path):
    ctx = zmq.asyncio.Context()
    info = SchedulerInfo(num_kv_blocks=4, block_size=16, max_model_len=64)
    kinds = internal_kinds(msgspec.msgpack.encode(info))
    pull = AsyncChannel(ctx, zmq.PULL, f"ipc://{tmp_path}/apull.sock", bind=True, recv_type=BatchServerMessage)
    router = AsyncChannel(ctx, zmq.ROUTER, f"ipc://{tmp_path}/arouter.sock", bind=True, recv_type=FrontendMessage)
    push, peer = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    push.connect(f"ipc://{tmp_path}/apull.sock")
    peer.connect(f"ipc://{tmp_path}/arouter.sock")
    try:
        for frames in kinds.values():
            await push.send_multipart(frames)
            await peer.send_multipart(frames)
        await push.send(msgspec.msgpack.encode(BatchHeartbeat(instance="x")))
        await peer.send(msgspec.msgpack.encode(Heartbeat(name="frontend", pid=1)))
        assert [await pull.recv() for _ in kinds] == [None] * len(kinds)
        assert await pull.recv() == BatchHeartbeat(instance="x")
        for _ in kinds:
            with pytest.raises(MalformedMessage):
                await router.recv_from()
        assert (await router.recv_from())[1] == Heartbeat(name="frontend", pid=1)
        assert pull.num_malformed == router.num_malformed == len(kinds)
    finally:
        for sock in (push, peer, pull, router):
            sock.close()
        ctx.term()


def wait_until(predicate, what: str, step=lambda: time.sleep(0.01)) -> None:
    deadline = time.monotonic() + HANG
    while not predicate():
        assert time.monotonic() < deadline, what
        step()


def test_the_scheduler_reads_on_past_malformed_messages(tmp_path):
    encode = msgspec.msgpack.encode
    with scheduler_with_peers(tmp_path, cache=CacheConfig(num_kv_blocks=None)) as peers:
        loop, results, frontend = peers.loop, peers.results, peers.frontend
        kinds = internal_kinds(encode(WorkerReady(rank=0, num_kv_blocks=64, kv_bytes_per_token=640, weight_bytes=1000)))
        for frames in kinds.values():
            results.send_multipart(frames)
        results.send(encode(WorkerReady(rank=0, num_kv_blocks=64, kv_bytes_per_token=640, weight_bytes=1000)))
        assert loop.wait_for_worker().num_kv_blocks == 64
        for frames in internal_kinds(encode(Hello())).values():
            frontend.send_multipart(frames)
        frontend.send(encode(Submit(request_id="r1", prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=2),
                                    arrival_time=time.time())))
        wait_until(lambda: loop.scheduler.has_work, "the Submit after the malformed messages is taken",
                   lambda: loop._drain_inbox(10))
        assert loop._plan_and_send()
        plan = peers.plans.recv()
        for frames in kinds.values():
            results.send_multipart(frames)
        results.send(encode(StepResult(step_id=plan.step_id, request_ids=["r1"], token_ids=[5])))
        assert loop._wait_for_result().step_id == plan.step_id
        assert loop.results.num_malformed == 2 * len(kinds) and loop.frontends.num_malformed == len(kinds)


def test_the_worker_reads_on_past_malformed_plans(tmp_path):
    from shuttle.worker.loop import WorkerLoop
    ctx = zmq.Context()
    scheduler, collector = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    scheduler.bind(f"ipc://{tmp_path}/plans.sock")
    collector.bind(f"ipc://{tmp_path}/results.sock")
    plans = Channel(ctx, zmq.PULL, f"ipc://{tmp_path}/plans.sock", bind=False, recv_type=PlanMessage)
    results = Channel(ctx, zmq.PUSH, f"ipc://{tmp_path}/results.sock", bind=False)
    runner = SimpleNamespace(execute=lambda plan: StepResult(step_id=plan.step_id, request_ids=[], token_ids=[]))
    encode = msgspec.msgpack.encode
    try:
        for frames in internal_kinds(encode(StepPlan(step_id=7, new_requests=[], cached_requests=[]))).values():
            scheduler.send_multipart(frames)
        scheduler.send(encode(StepPlan(step_id=7, new_requests=[], cached_requests=[])))
        scheduler.send(encode(Shutdown()))
        WorkerLoop(plans, results, runner, SimpleNamespace(enabled=False, is_driver=True), rank=0).run()
        assert msgspec.msgpack.decode(collector.recv(), type=WorkerMessage) == StepResult(step_id=7, request_ids=[],
                                                                                          token_ids=[])
        assert plans.num_malformed == len(internal_kinds(b"\x90"))
    finally:
        for sock in (scheduler, collector, plans, results):
            sock.close()
        ctx.term()


async def test_the_frontend_reads_on_past_malformed_scheduler_and_launcher_messages(tmp_path):
    from shuttle.frontend.engine.client import EngineClient
    from shuttle.frontend.lifecycle import SupervisorLink
    ctx = zmq.asyncio.Context.instance()
    encode = msgspec.msgpack.encode
    scheduler = ctx.socket(zmq.ROUTER)
    scheduler.bind(f"ipc://{tmp_path}/requests.sock")
    client = EngineClient(f"ipc://{tmp_path}/requests.sock")
    ipc = IpcConfig.in_directory(str(tmp_path))
    downs = []
    engine = SimpleNamespace(engine_down=lambda *a: downs.append(a), draining=False)
    link = SupervisorLink(ShuttleConfig(ModelConfig.from_dir(MODEL_DIR), ipc), engine)
    launcher = ctx.socket(zmq.PUSH)
    launcher.connect(ipc.supervisor)
    try:
        await client.start(wait=False)
        identity, _ = await asyncio.wait_for(scheduler.recv_multipart(), HANG)  # its Hello
        info = SchedulerInfo(num_kv_blocks=4, block_size=16, max_model_len=64)
        for frames in internal_kinds(encode(info)).values():
            await scheduler.send_multipart([identity, *frames])
        await scheduler.send_multipart([identity, encode(info)])
        await asyncio.wait_for(client.wait_up(), HANG)
        assert client.info == info
        link.start()
        for frames in internal_kinds(encode(EngineDown(reason="gone"))).values():
            await launcher.send_multipart(frames)
        await launcher.send(encode(EngineDown(reason="gone", retry_after=2.0, group=0)))
        deadline = time.monotonic() + HANG
        while not downs:
            assert time.monotonic() < deadline, "EngineDown after the malformed messages"
            await asyncio.sleep(0.01)
        assert downs == [("gone", 2.0, 0, True)] and not engine.draining
        # a trial: a launcher that gave up (--max-restarts) still told clients "it is restarting, retry shortly"
        await launcher.send(encode(EngineDown(reason="given up", retry_after=0.0, restarting=False)))
        while len(downs) < 2:
            assert time.monotonic() < deadline, "the second EngineDown"
            await asyncio.sleep(0.01)
        assert downs[-1] == ("given up", 0.0, 0, False) and engine.draining  # refusals promise nothing now
    finally:
        link.close()
        client.close()
        scheduler.close()
        launcher.close()


async def test_a_stats_hook_that_raises_loses_no_output(tmp_path, caplog):
    """The frontend's one listener delivers every request's outputs; a hook that raises on a message (a metrics or
    dashboard bug) is logged, and the outputs of that message and the next still reach their request."""
    from shuttle.frontend.engine.client import EngineClient
    ctx = zmq.asyncio.Context.instance()
    encode = msgspec.msgpack.encode
    scheduler = ctx.socket(zmq.ROUTER)
    scheduler.bind(f"ipc://{tmp_path}/requests.sock")
    client = EngineClient(f"ipc://{tmp_path}/requests.sock")

    def broken_hook(stats):
        raise ZeroDivisionError("a metrics bug")

    client.on_stats = broken_hook
    try:
        await client.start(wait=False)
        identity, _ = await asyncio.wait_for(scheduler.recv_multipart(), HANG)  # its Hello
        await scheduler.send_multipart([identity, encode(SchedulerInfo(num_kv_blocks=4, block_size=16,
                                                                       max_model_len=64))])
        await asyncio.wait_for(client.wait_up(), HANG)
        outputs = client.generate(Submit(request_id="r", prompt_token_ids=[1, 2], sampling=SamplingParams(max_tokens=2),
                                         arrival_time=time.time()))
        first = asyncio.ensure_future(outputs.__anext__())
        while True:  # the Submit reached the scheduler (heartbeats may come first)
            _, frame = await asyncio.wait_for(scheduler.recv_multipart(), HANG)
            if isinstance(msgspec.msgpack.decode(frame, type=FrontendMessage), Submit):
                break
        stats = SchedulerStats(num_running=1)
        step_outputs = StepOutputs(outputs=[RequestOutput(request_id="r", new_token_ids=[5])], stats=stats)
        await scheduler.send_multipart([identity, encode(step_outputs)])
        last = RequestOutput(request_id="r", new_token_ids=[6], finish_reason=FinishReason.LENGTH)
        await scheduler.send_multipart([identity, encode(StepOutputs(outputs=[last], stats=stats))])
        got = [await asyncio.wait_for(first, HANG)]
        got += [output async for output in outputs]
        assert [(o.new_token_ids, o.finish_reason) for o in got] == [([5], None), ([6], FinishReason.LENGTH)]
        assert caplog.text.count("ZeroDivisionError: a metrics bug") == 2
    finally:
        client.close()
        scheduler.close()


def test_the_launcher_reads_on_past_malformed_control_messages(tmp_path):
    from shuttle.launcher.launcher import Launcher

    ipc = IpcConfig.in_directory(str(tmp_path))
    launcher = Launcher(ShuttleConfig(ModelConfig.from_dir(MODEL_DIR), ipc), None)
    child = zmq.Context.instance().socket(zmq.PUSH)
    child.connect(ipc.control)
    encode = msgspec.msgpack.encode
    seen = []
    launcher.units = [SimpleNamespace(on_control=seen.append)]
    try:
        kinds = internal_kinds(encode(Heartbeat(name="worker", pid=1)))
        for frames in kinds.values():
            child.send_multipart(frames)
        child.send(encode(Heartbeat(name="worker", pid=1)))
        wait_until(lambda: seen, "the heartbeat after the malformed messages", lambda: launcher._read_control(10))
        assert seen == [Heartbeat(name="worker", pid=1)]
        assert launcher.control.num_malformed == len(kinds)
    finally:
        child.close()
        launcher.control.close()


def test_warnings_are_rate_limited_per_peer_and_per_socket(caplog):
    from shuttle.common.wire_guard import MAX_WARNINGS_PER_INTERVAL, WARN_INTERVAL_S, FaultLog, Malformed

    now = [0.0]
    faults = FaultLog("a socket", clock=lambda: now[0])
    for _ in range(5):
        faults.record(b"one", Malformed("decode", "bad"))
    assert len(warnings_about_malformed(caplog)) == 1
    now[0] = WARN_INTERVAL_S  # a minute later the same peer is warned about again
    faults.record(b"one", Malformed("depth", "deep"))
    assert len(warnings_about_malformed(caplog)) == 2
    for peer in range(3 * MAX_WARNINGS_PER_INTERVAL):  # a new identity per message: still capped per socket
        faults.record(str(peer).encode(), Malformed("frames", "two"))
    assert len(warnings_about_malformed(caplog)) == 1 + MAX_WARNINGS_PER_INTERVAL
    now[0] = 2 * WARN_INTERVAL_S
    faults.record(b"late", Malformed("decode", "bad"))
    last = warnings_about_malformed(caplog)[-1]
    assert f"{2 * MAX_WARNINGS_PER_INTERVAL + 1} not logged" in last and "from peer b'late'" in last
    assert faults.counts == {"decode": 6, "depth": 1, "frames": 3 * MAX_WARNINGS_PER_INTERVAL}
