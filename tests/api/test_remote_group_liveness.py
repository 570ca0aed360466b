"""How the frontend's link follows a remote serving group (`shuttle engine` on another host) that does not fail
outright:

- one whose host stops (or is cut off) without its TCP connection dropping is noticed: the link takes it as lost after
  --heartbeat-timeout seconds without an answer to ZeroMQ's heartbeat, fails its in-flight requests with one 503 each,
  leaves the routing, and rejoins when the group answers again;
- one that drains (its `shuttle engine` got SIGTERM) takes no new request while its requests in flight go on, and
  rejoins once it is started again.

The group is a stand-in scheduler in its own process (a ROUTER that answers Hello and keeps every Submit unanswered),
stopped with SIGSTOP (its socket stays open, as a frozen host's or a partitioned link's does), told to drain with
SIGUSR1 (it says so to every frontend it knows) and to exit with SIGUSR2.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from shuttle.common.ipc import CURVE_ENV, CurveKeys
from shuttle.common.messages import FinishReason, SamplingParams, Submit
from shuttle.frontend.engine.client import GROUP_DRAINING, EngineClient, lost_connection_reason
from shuttle.frontend.engine.router import Router

SILENCE_S = 2.0

STAND_IN = """
import signal, sys, msgspec, zmq
from shuttle.common.messages import FrontendMessage, Hello, SchedulerInfo
sock = zmq.Context().socket(zmq.ROUTER)
sock.setsockopt(zmq.LINGER, 0)
sock.bind(sys.argv[1])
decoder, encoder = msgspec.msgpack.Decoder(FrontendMessage), msgspec.msgpack.Encoder()
clients, draining = set(), False
def info():
    return encoder.encode(SchedulerInfo(num_kv_blocks=64, block_size=16, max_model_len=int(sys.argv[2]),
                                        draining=draining))
def drain(*_):
    global draining
    draining = True
    for client in clients:
        sock.send_multipart([client, info()])
def leave(*_):
    sock.close()
    sys.exit(0)
signal.signal(signal.SIGUSR1, drain)
signal.signal(signal.SIGUSR2, leave)
print("bound", flush=True)
while True:
    client, payload = sock.recv_multipart()
    clients.add(client)
    if isinstance(decoder.decode(payload), Hello):
        sock.send_multipart([client, info()])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandIns:
    """Stand-in schedulers on one endpoint, one at a time; each stopped by PID at the end."""

    def __init__(self):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.processes: list[subprocess.Popen] = []

    def start(self, max_model_len: int = 128) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, "-c", STAND_IN, self.endpoint, str(max_model_len)],
                                   stdout=subprocess.PIPE, text=True)
        self.processes.append(process)
        assert process.stdout.readline().strip() == "bound"
        return process

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)  # a stopped process: let it take the SIGKILL at once
                process.kill()
            process.wait()


@pytest.fixture
def stand_ins():
    stand_ins = StandIns()
    try:
        yield stand_ins
    finally:
        stand_ins.stop()


@pytest.fixture
def stand_in(stand_ins):
    return stand_ins.endpoint, stand_ins.start()


def submit(request_id: str) -> Submit:
    return Submit(request_id=request_id, prompt_token_ids=[1, 2, 3], sampling=SamplingParams(),
                  arrival_time=time.time())


async def wait_until(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def routed(endpoint: str):
    """The remote group at `endpoint` behind a router, up; the outputs its requests get, and a coroutine function
    that runs one request (by id) through the router, collecting its outputs."""
    group = EngineClient(endpoint, remote=True, silence_timeout=SILENCE_S)
    router = Router([group], max_num_seqs=8, wait_for=0)
    await router.start()
    await wait_until(lambda: group.is_up, 30)
    outputs: list = []

    async def consume(request_id: str) -> None:
        async for output in router.generate(submit(request_id)):
            outputs.append(output)

    return group, router, outputs, consume


async def test_a_silent_remote_group_fails_its_requests_and_rejoins_when_it_answers(stand_in):
    endpoint, process = stand_in
    group, router, outputs, consume = await routed(endpoint)
    try:
        requests = [asyncio.create_task(consume(f"r{i}")) for i in range(3)]
        await wait_until(lambda: group.num_in_flight == 3, 10)
        os.kill(process.pid, signal.SIGSTOP)
        noticed = await wait_until(lambda: not group.is_up, 10 * SILENCE_S)
        await asyncio.wait_for(asyncio.gather(*requests), 5)
        assert noticed >= SILENCE_S * 0.9  # not before the timeout
        assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]  # exactly one output each: the end
        assert all(o.finish_reason == FinishReason.ERROR and o.error_status == 503 for o in outputs)
        assert group.down_reason == lost_connection_reason(endpoint, SILENCE_S) and group.times_down == 1
        error = router.admission_error()
        assert error is not None and error.status == 503  # the router sends it nothing while it is down

        os.kill(process.pid, signal.SIGCONT)
        await wait_until(lambda: group.is_up, 60)
        assert group.times_down == 1 and router.admission_error() is None
    finally:
        router.close()


async def test_a_remote_group_that_never_joined_is_not_called_restarting(stand_ins):
    """Before a remote group's scheduler first answers, a request's 503 says so (not "restarting": nothing ran)."""
    group = EngineClient(stand_ins.endpoint, remote=True, silence_timeout=SILENCE_S)  # nobody bound there yet
    router = Router([group], max_num_seqs=8, wait_for=0)
    await router.start()
    try:
        error = router.admission_error()
        assert error is not None and error.status == 503
        assert f"the engine at {stand_ins.endpoint} has not joined yet" in str(error), str(error)
        stand_ins.start()
        await wait_until(lambda: group.is_up, 30)
        assert router.admission_error() is None
    finally:
        router.close()


async def test_a_remote_group_that_is_not_up_is_sent_no_heartbeats(stand_ins, monkeypatch):
    """A remote group that has not joined (or was lost) runs nothing of this frontend's: heartbeats to it would only
    queue on its socket (unbounded) while it is away, to arrive stale. Once it joins they flow."""
    from shuttle.frontend.engine import client as client_module

    monkeypatch.setattr(client_module, "HEARTBEAT_INTERVAL_S", 0.02)
    group = EngineClient(stand_ins.endpoint, remote=True, silence_timeout=SILENCE_S)
    await group.start(wait=False)
    sent: list = []
    send = group._channel.send

    async def counting_send(message, *args):
        sent.append(type(message).__name__)
        await send(message, *args)

    monkeypatch.setattr(group._channel, "send", counting_send)
    try:
        await asyncio.sleep(0.5)
        assert "Heartbeat" not in sent, sent
        stand_ins.start()
        await wait_until(lambda: group.is_up, 30)
        await wait_until(lambda: "Heartbeat" in sent, 5)
    finally:
        group.close()


async def test_a_quiet_remote_group_that_answers_heartbeats_stays_up(stand_in):
    """No traffic but the heartbeat's for several timeouts (an idle group, a long step) is not silence."""
    endpoint, _ = stand_in
    group = EngineClient(endpoint, remote=True, silence_timeout=SILENCE_S)
    try:
        await group.start(timeout=30)
        await asyncio.sleep(3 * SILENCE_S)
        assert group.is_up and group.times_down == 0
    finally:
        group.close()


async def test_a_draining_remote_group_takes_no_new_request_and_rejoins_when_started_again(stand_ins):
    stand_in = stand_ins.start()
    group, router, outputs, consume = await routed(stand_ins.endpoint)
    try:
        request = asyncio.create_task(consume("r0"))
        await wait_until(lambda: group.num_in_flight == 1, 10)
        os.kill(stand_in.pid, signal.SIGUSR1)
        await wait_until(lambda: not group.is_up, 10)
        assert group.down_reason == GROUP_DRAINING and group.times_down == 0
        error = router.admission_error()
        assert error is not None and error.status == 503
        await asyncio.sleep(3 * SILENCE_S)  # the request it holds goes on: the group answers heartbeats
        assert not request.done() and outputs == [] and group.num_in_flight == 1

        os.kill(stand_in.pid, signal.SIGUSR2)  # it leaves with r0 unfinished (its drain ran out of time)
        await asyncio.wait_for(request, 10)
        assert [(o.request_id, o.finish_reason, o.error_status) for o in outputs] == [("r0", FinishReason.ERROR, 503)]
        assert group.times_down == 1
        stand_ins.start()  # the group is started again on its endpoint
        await wait_until(lambda: group.is_up, 60)
        assert router.admission_error() is None
    finally:
        router.close()


async def test_a_group_of_another_max_model_len_is_kept_out_and_joins_once_restarted_to_match(stand_ins):
    """A remote group started with another --max-model-len would cut or fail the requests this frontend admits: it is
    kept out, naming both values. Started again with the frontend's, it joins: the frontend says Hello again on every
    new connection of a group that is not serving."""
    stand_ins.start(max_model_len=128)
    group = EngineClient(stand_ins.endpoint, remote=True, silence_timeout=SILENCE_S, max_model_len=512)
    try:
        await group.start(wait=False)
        await wait_until(lambda: group.down_reason is not None, 30)
        assert group.down_reason.startswith("its max_model_len 128 differs from this frontend's 512")
        error = group.admission_error()
        assert not group.is_up and error.status == 503
        # a fresh-clone trial: "restarting ... retry shortly" with Retry-After: 1, forever, for what no retry fixes
        assert str(error).startswith(f"the engine at {stand_ins.endpoint} is kept out: its max_model_len 128")
        assert error.retry_after is None
        stand_ins.stop()
        await wait_until(lambda: group.down_reason == lost_connection_reason(stand_ins.endpoint, SILENCE_S), 30)
        assert group.admission_error().retry_after is not None  # gone, no longer misconfigured: a restart is awaited
        stand_ins.start(max_model_len=512)  # the same endpoint, a new process: a new connection
        await wait_until(lambda: group.is_up, 30)
    finally:
        group.close()



async def test_a_group_without_lora_is_kept_out_of_a_frontend_that_serves_adapters(stand_ins):
    """Its adapter requests would get 404 there (or run on the base model): kept out, naming why."""
    stand_ins.start(max_model_len=128)  # the stand-in serves no adapters
    group = EngineClient(stand_ins.endpoint, remote=True, silence_timeout=SILENCE_S, max_model_len=128, lora=True)
    try:
        await group.start(wait=False)
        await wait_until(lambda: group.down_reason is not None, 30)
        assert group.down_reason.startswith("it does not serve LoRA adapters and this frontend does")
        assert not group.is_up
    finally:
        group.close()


CURVE_STAND_IN = """
import sys, zmq
from shuttle.common.ipc import Channel
channel = Channel(zmq.Context.instance(), zmq.ROUTER, sys.argv[1], bind=True, curve=True)
print("bound", flush=True)
while True:
    channel.socket.recv_multipart()
"""


async def test_a_group_that_refuses_this_frontends_curve_keys_is_named_as_such(monkeypatch):
    """Keys that differ between the hosts: the connection never gets past its handshake. The frontend says so once,
    in its log and in /health's reason, instead of waiting in silence."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, CURVE_ENV: CurveKeys.generate().to_env()}
    process = subprocess.Popen([sys.executable, "-c", CURVE_STAND_IN, endpoint], stdout=subprocess.PIPE, text=True,
                               env=env)
    group = None
    try:
        assert process.stdout.readline().strip() == "bound"
        monkeypatch.setenv(CURVE_ENV, CurveKeys.generate().to_env())  # this frontend's: other keys
        group = EngineClient(endpoint, curve=True, remote=True, silence_timeout=SILENCE_S)
        await group.start(wait=False)
        await wait_until(lambda: group.down_reason is not None, 30)
        assert group.down_reason.startswith(f"the handshake with {endpoint} failed: it does not take this frontend's "
                                            f"CURVE keys")
        assert not group.is_up
    finally:
        if group is not None:
            group.close()
        process.kill()
        process.wait()


class _Monitor:
    """A socket monitor that reports the events put into it."""

    def __init__(self):
        self.events: asyncio.Queue[int] = asyncio.Queue()

    async def recv_multipart(self) -> list[bytes]:
        import struct
        return [struct.pack("=hi", await self.events.get(), 0), b"tcp://127.0.0.1:1"]

    def close(self, linger: int = 0) -> None:
        pass


async def test_a_handshake_cut_once_is_not_blamed_on_the_keys():
    """A fresh-clone CI run: a remote scheduler killed while the socket reconnected gave one "no detail" handshake
    failure, and the group was reported as refusing this frontend's CURVE keys (kept out, no Retry-After) instead of
    restarting. Keys are blamed after failures in a row, or at once when the peer refuses this frontend's key."""
    import zmq
    group = EngineClient("tcp://127.0.0.1:1", remote=True, silence_timeout=SILENCE_S)
    group._channel = channel = object()
    monitor = _Monitor()
    watching = asyncio.create_task(group._watch(channel, monitor))
    try:
        for event in (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_SUCCEEDED,
                      zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            monitor.events.put_nowait(event)
        await asyncio.sleep(0.05)
        assert group.down_reason is None  # two in a row since the last success: a cut, not the keys
        monitor.events.put_nowait(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
        await asyncio.sleep(0.05)
        assert group.down_reason.startswith("the handshake with tcp://127.0.0.1:1 failed")
        group.down_reason = None
        monitor.events.put_nowait(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        monitor.events.put_nowait(zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # our key refused: the keys at once
        await asyncio.sleep(0.05)
        assert group.down_reason.startswith("the handshake with tcp://127.0.0.1:1 failed")
    finally:
        watching.cancel()
