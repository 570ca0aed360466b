"""Starts and supervises one serving group: worker, scheduler and frontend, each its own process.

The launcher waits until each child reports ready on the control socket, prints the URL and the KV
capacity, and then only watches: Ctrl-C or SIGTERM stops every child within 5 s; a child that dies takes the
others down and the launcher exits non-zero, naming it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import zmq

from common.capacity import requests_that_fit
from common.config import IpcConfig, ShuttleConfig
from common.errors import ModelDirError
from common.ipc import Channel
from common.messages import ControlMessage

CHILDREN = ("worker", "scheduler", "frontend")
STOP_TIMEOUT_S = 4.0
FRONTEND_GRACE_S = 1.5  # of STOP_TIMEOUT_S: time the frontend gets to fail in-flight requests cleanly
START_TIMEOUT_S = 300.0


def _free_tcp_endpoints(n: int) -> list[str]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return [f"tcp://127.0.0.1:{p}" for p in ports]


def _say(message: str) -> None:
    print(f"shuttle: {message}", flush=True)


def _describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


class Supervisor:
    """Owns the child processes; `stop()` is idempotent and bounded in time."""

    def __init__(self, config: ShuttleConfig):
        self.config = config
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, api_key: str | None) -> None:
        payload = self.config.to_json()
        for name in CHILDREN:
            env = dict(os.environ)
            env.pop("SHUTTLE_API_KEY", None)
            if name == "frontend" and api_key:
                env["SHUTTLE_API_KEY"] = api_key  # through the environment: argv is visible to every user
            self.procs[name] = subprocess.Popen([sys.executable, "-m", name, "--config", payload], env=env)

    def dead_child(self) -> tuple[str, subprocess.Popen] | None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return name, proc
        return None

    def stop(self) -> None:
        """Frontend first, so it can answer every in-flight request with an error before the others go."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        frontend = self.procs.get("frontend")
        if frontend is not None and frontend.poll() is None:
            frontend.terminate()
            try:
                frontend.wait(timeout=FRONTEND_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class _Stop(Exception):
    pass


def serve(args: argparse.Namespace) -> int:
    """Run `shuttle serve`. Returns the exit status: 0 after Ctrl-C/SIGTERM, 1 if a child died, 2 on bad input."""
    if args.model_dir is None:
        print("shuttle: no MODEL_DIR given and the default ../shared/models/stories260K is missing", file=sys.stderr)
        return 2
    runtime_dir = tempfile.mkdtemp(prefix="shuttle-")  # mode 0700: only this user reaches the sockets
    try:
        if args.zmq_transport == "tcp":
            ipc = IpcConfig(*_free_tcp_endpoints(3), f"ipc://{runtime_dir}/control.sock")
        else:
            ipc = IpcConfig.in_directory(runtime_dir)
        try:
            config = ShuttleConfig.from_args(args, ipc)
            if not os.path.isfile(os.path.join(config.model.model_dir, "tokenizer.json")):
                raise ModelDirError(f"{config.model.model_dir} has no tokenizer.json")
            if config.chat_template and not os.path.isfile(config.chat_template):
                raise ModelDirError(f"--chat-template {config.chat_template} is not a readable file")
        except ModelDirError as exc:
            print(f"shuttle: error: {exc}", file=sys.stderr)
            return 2
        return _run(config, args.api_key or os.environ.get("SHUTTLE_API_KEY"))
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


def _run(config: ShuttleConfig, api_key: str | None) -> int:
    control: Channel[ControlMessage] = Channel(zmq.Context.instance(), zmq.PULL, config.ipc.control, bind=True,
                                               recv_type=ControlMessage)
    supervisor = Supervisor(config)

    def on_signal(signum, frame):
        raise _Stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        supervisor.start(api_key)
        ready = _wait_until_ready(supervisor, control)
        if ready is None:
            dead = supervisor.dead_child()
            return 2 if dead is not None and dead[1].returncode == 2 else 1  # 2: a child refused the model
        _announce(config, supervisor, ready)
        while True:
            dead = supervisor.dead_child()
            if dead is not None:
                name, proc = dead
                _say(f"{name} (pid {proc.pid}) {_describe_exit(proc.returncode)}; stopping the others")
                return 1
            time.sleep(0.1)
    except _Stop:
        _say("stopping")
        return 0
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_IGN)
        supervisor.stop()
        control.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _wait_until_ready(supervisor: Supervisor, control: Channel) -> dict | None:
    ready: dict[str, dict] = {}
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(ready) < len(CHILDREN):
        dead = supervisor.dead_child()
        if dead is not None:
            name, proc = dead
            _say(f"{name} (pid {proc.pid}) {_describe_exit(proc.returncode)} during start-up; stopping the others")
            return None
        if time.monotonic() > deadline:
            _say(f"start-up took over {START_TIMEOUT_S:.0f} s; waiting for {sorted(set(CHILDREN) - set(ready))}")
            return None
        if control.poll(100):
            msg = control.recv()
            ready[msg.name] = msg.info
    return ready


def _announce(config: ShuttleConfig, supervisor: Supervisor, ready: dict[str, dict]) -> None:
    cap = ready["scheduler"]
    url = ready["frontend"]["url"]
    fit = requests_that_fit(cap["num_kv_blocks"], cap["block_size"], config.model.max_model_len)
    _say(f"KV cache {cap['num_kv_blocks']} blocks x {cap['block_size']} tokens = {cap['kv_tokens']} tokens "
         f"({cap['kv_bytes_per_token']} bytes/token); {fit} requests of max_model_len {config.model.max_model_len} fit")
    if fit == 0:
        _say(f"warning: the KV cache holds {cap['kv_tokens']} tokens, fewer than max_model_len "
             f"{config.model.max_model_len}: requests needing more are rejected (raise --kv-cache-memory or "
             f"--num-kv-blocks, or lower --max-model-len)")
    pids = {name: proc.pid for name, proc in supervisor.procs.items()}
    batch = ready["frontend"].get("batch_endpoint", "")
    _say(f"serving {config.model.served_model_name} at {url}" + (f", batch jobs at {batch}" if batch else "")
         + "  (Ctrl-C stops)")
    _say("ready " + json.dumps({"url": url, "batch_endpoint": batch, "pids": pids, "launcher_pid": os.getpid()}))
