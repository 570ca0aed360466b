"""Acceptance: Ctrl-C stops every process; a child that dies past --max-restarts stops the group with a non-zero
exit; a killed launcher takes its children along; bad model dirs are a one-line error with status 2; the
open-file limit is raised so that 1,100 idle sockets do not lock clients out."""

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from shuttle.common.process import die_with_parent
from tests.client import post_completion
from tests.conftest import API_KEY
from tests.server import MODEL_DIR, REPO, TEST_KV_CACHE_MEMORY, ShuttleServer, pid_alive

HANG = 60.0


def test_ctrl_c_leaves_no_process():
    srv = ShuttleServer()
    try:
        assert all(pid_alive(p) for p in srv.all_pids)
        os.killpg(srv.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: the whole foreground group
        assert srv.proc.wait(HANG) == 0
        assert srv.wait_gone(HANG) == [], "processes left behind"
    finally:
        srv.stop()


def children(pid: int) -> list[int]:
    """The live children of process `pid` (Linux: /proc's children list of its main thread)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def test_killed_launcher_takes_its_children_along():
    """Killed while its three processes start (the worker mid-import or mid-load, the state a crash of the launcher
    most often meets, and no model work spent on a server that would be killed anyway)."""
    launcher = subprocess.Popen([sys.executable, "-m", "shuttle.launcher.cli", "serve", str(MODEL_DIR), "--port", "0",
                                 "--kv-cache-memory", TEST_KV_CACHE_MEMORY, "--worker-threads", "1"],
                                cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True, preexec_fn=die_with_parent)
    started: list[int] = []
    try:
        deadline = time.monotonic() + HANG
        while len(started := children(launcher.pid)) < 3:  # the engine's two and the frontend
            assert launcher.poll() is None and time.monotonic() < deadline, started
            time.sleep(0.01)
        launcher.kill()  # no chance to clean up: the parent-death signal does it
        launcher.wait()
        while alive := [pid for pid in started if pid_alive(pid)]:
            assert time.monotonic() < deadline, f"children outlived their launcher: {alive}"
            time.sleep(0.05)
    finally:
        for pid in started:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "serve", *args, "--port", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_missing_model_dir_is_one_line_error(tmp_path):
    result = run_cli(str(tmp_path / "nope"))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "does not exist" in result.stderr


def test_malformed_config_is_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    result = run_cli(str(tmp_path))
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "config.json" in result.stderr


def listening_tcp_ports(pid: int) -> list[int]:
    """TCP ports process `pid` listens on (from /proc: its socket inodes in LISTEN state)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = []
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
            ports.append(int(fields[1].split(":")[1], 16))
    return ports




async def test_tcp_transport_is_authenticated_and_the_api_key_stays_off_command_lines(keyed_server):
    import asyncio

    import zmq

    from shuttle.batch_jobs.client import BatchClient

    srv = keyed_server
    strays = []
    try:
        for pid in srv.all_pids:
            assert API_KEY.encode() not in open(f"/proc/{pid}/cmdline", "rb").read()
        ports = listening_tcp_ports(srv.pids["scheduler"])
        assert len(ports) == 3  # requests, plans, results
        ctx = zmq.Context.instance()
        for port in ports:  # what wedged the scheduler before: a stray PULL took a StepPlan
            stray = ctx.socket(zmq.PULL)
            stray.setsockopt(zmq.LINGER, 0)
            stray.connect(f"tcp://127.0.0.1:{port}")
            strays.append(stray)
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession(headers=headers) as session:
            results = await asyncio.wait_for(asyncio.gather(*(
                post_completion(session, srv.url, prompt="Hello", max_tokens=4, temperature=0) for _ in range(8))),
                HANG)
        assert all(status == 200 and body["usage"]["completion_tokens"] <= 4 for status, body in results)
        assert not any(s.poll(0) for s in strays)
        job = {"url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}}
        with BatchClient(srv.batch_endpoint, server_timeout=HANG, api_key="") as client:
            [refused] = list(client.run([job]))
        with BatchClient(srv.batch_endpoint, server_timeout=HANG, api_key=API_KEY) as client:
            [done] = list(client.run([job]))
        assert refused.status_code == 401 and done.status_code == 200
        assert done.body["usage"]["completion_tokens"] >= 1
    finally:
        for stray in strays:
            stray.close()


async def test_worker_death_past_max_restarts_errors_requests_and_exits_nonzero():
    import asyncio
    import json

    srv = ShuttleServer("--max-restarts", "0", step_delay=0.2)
    try:
        async with aiohttp.ClientSession() as session:
            long_job = {"prompt": "Hi", "max_tokens": 200, "ignore_eos": True}
            plain = asyncio.create_task(post_completion(session, srv.url, **long_job))
            async with session.post(f"{srv.url}/v1/completions", json={**long_job, "stream": True}) as response:
                await response.content.readline()
                os.kill(srv.pids["worker"], signal.SIGKILL)
                events = [line.decode().strip() async for line in response.content if line.startswith(b"data: ")]
            status, body = await plain
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][len("data: "):])["error"]["code"] == 503
        assert status == 503 and body["error"]["code"] == 503
        assert srv.proc.wait(HANG) == 1
        assert srv.wait_gone(HANG) == []
        assert any("worker" in line and "SIGKILL" in line and "--max-restarts 0" in line for line in srv.output)
    finally:
        srv.stop()


async def test_1100_idle_sockets_under_a_1024_soft_fd_limit(keyed_server):
    srv = keyed_server
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    idle = []
    try:
        assert f"shuttle: raised the open-file limit from 1024 to {hard}" in srv.output
        host, port = srv.url.removeprefix("http://").split(":")
        for _ in range(1100):
            idle.append(socket.create_connection((host, int(port)), timeout=HANG))
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            status, body = await asyncio_wait(post_completion(session, srv.url, prompt="Hi", max_tokens=4))
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        for s in idle:
            s.close()


async def asyncio_wait(coroutine):
    import asyncio
    return await asyncio.wait_for(coroutine, HANG)
