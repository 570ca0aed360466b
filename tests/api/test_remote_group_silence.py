"""A remote serving group whose host stops (or is cut off) without its TCP connection dropping is noticed: the
frontend's link takes it as lost after --heartbeat-timeout seconds without an answer to ZeroMQ's heartbeat, fails its
in-flight requests with one 503 each, leaves the routing, and rejoins when the group answers again.

The group is a stand-in scheduler in its own process (a ROUTER that answers Hello and keeps every Submit unanswered),
stopped with SIGSTOP: its socket stays open, as a frozen host's or a partitioned link's does.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from shuttle.common.messages import FinishReason, SamplingParams, Submit
from shuttle.frontend.engine.client import EngineClient
from shuttle.frontend.engine.router import Router

SILENCE_S = 2.0

STAND_IN = """
import sys, msgspec, zmq
from shuttle.common.messages import FrontendMessage, Hello, SchedulerInfo
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
print("bound", flush=True)
decoder, encoder = msgspec.msgpack.Decoder(FrontendMessage), msgspec.msgpack.Encoder()
while True:
    client, payload = sock.recv_multipart()
    if isinstance(decoder.decode(payload), Hello):
        sock.send_multipart([client, encoder.encode(SchedulerInfo(num_kv_blocks=64, block_size=16,
                                                                  max_model_len=128))])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stand_in():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    process = subprocess.Popen([sys.executable, "-c", STAND_IN, endpoint], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "bound"
        yield endpoint, process
    finally:
        os.kill(process.pid, signal.SIGCONT)  # a stopped process takes SIGKILL only once continued on some kernels
        process.kill()
        process.wait()


async def wait_until(condition, timeout: float) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def test_a_silent_remote_group_fails_its_requests_and_rejoins_when_it_answers(stand_in):
    endpoint, process = stand_in
    group = EngineClient(endpoint, remote=True, silence_timeout=SILENCE_S)
    router = Router([group], max_num_seqs=8, wait_for=0)
    try:
        await router.start()
        await wait_until(lambda: group.is_up, 30)
        outputs = []

        async def consume(request_id: str) -> None:
            async for output in router.generate(Submit(request_id=request_id, prompt_token_ids=[1, 2, 3],
                                                            sampling=SamplingParams(), arrival_time=time.time())):
                outputs.append(output)

        requests = [asyncio.create_task(consume(f"r{i}")) for i in range(3)]
        await wait_until(lambda: group.num_in_flight == 3, 10)
        os.kill(process.pid, signal.SIGSTOP)
        noticed = await wait_until(lambda: not group.is_up, 10 * SILENCE_S)
        await asyncio.wait_for(asyncio.gather(*requests), 5)
        assert noticed >= SILENCE_S * 0.9  # not before the timeout
        assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]  # exactly one output each: the end
        assert all(o.finish_reason == FinishReason.ERROR and o.error_status == 503 for o in outputs)
        assert group.down_reason == f"lost the connection to {endpoint}" and group.times_down == 1
        error = router.admission_error()
        assert error is not None and error.status == 503  # the router sends it nothing while it is down

        os.kill(process.pid, signal.SIGCONT)
        await wait_until(lambda: group.is_up, 60)
        assert group.times_down == 1 and router.admission_error() is None
    finally:
        router.close()


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
