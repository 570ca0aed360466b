"""A real `shuttle serve` (launcher + its processes) on free ports, started and always stopped by PID: for tests,
benchmarks and `shuttle tune`'s verification runs.

    with ShuttleServer("--max-num-seqs", "8", model_dir=path) as server:
        ...  # server.url, server.batch_endpoint, server.pids

The launcher gets the Linux parent-death signal (SIGKILL when the process that started it ends, however it ends),
and its children get the same from it, so a killed run leaves no server behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from shuttle.common.config import DEFAULT_MODEL_DIR
from shuttle.common.process import die_with_parent
from shuttle.worker.loop import STEP_DELAY_ENV

__all__ = ["ShuttleServer", "pid_alive"]


def launcher_text(line: str) -> str:
    """A launcher line as text ("shuttle: MESSAGE"), also when --log-format json wrote it as a JSON object."""
    if line.startswith("{"):
        try:
            entry = json.loads(line)
        except ValueError:
            return line
        if isinstance(entry, dict) and entry.get("process") == "launcher":
            return f"shuttle: {entry.get('message', '')}"
    return line


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class ShuttleServer:
    """`shuttle serve MODEL --port 0 *args` in its own process group (so a caller can send it a terminal's Ctrl-C).

    Args:
        command: "serve", or "engine" (`shuttle engine MODEL *args`: one serving group without a frontend; ready
            when it listens, with no url).
        env: extra environment variables for the launcher (e.g. SHUTTLE_API_KEY).
        preexec: also run in the launcher's process before exec (e.g. to lower its open-file limit).
        worker_threads: --worker-threads, unless `args` give it (None: the server's own default, one thread per
            core it may use). 1 by default: where the server's processes share a few cores with each other and the
            client (a test run), more threads only compete with them.
        cwd: the launcher's working directory (relative paths in `args` are read from it); None: this process's.

    Attributes:
        url: base URL once ready. pids: {"worker", "scheduler", "frontend"} -> pid (with several serving groups
        "worker.0", "scheduler.1", ...), updated when the launcher restarts a unit. output: launcher stdout lines
        (as text under --log-format json too). `stderr`: a file for the processes' log lines (default: this stderr).
    """

    launches = 0  # servers started by this process (the test suite reports its count)

    def __init__(self, *args: str, model_dir: str | Path = DEFAULT_MODEL_DIR, start_timeout: float = 120.0,
                 env: dict[str, str] | None = None, preexec=None, command: str = "serve",
                 cwd: str | Path | None = None, step_delay: float = 0.0, worker_threads: int | None = 1,
                 stderr: str | Path | None = None):
        ShuttleServer.launches += 1
        port = ["--port", "0"] if command == "serve" else []
        threads = ["--worker-threads", str(worker_threads)] if worker_threads is not None and \
            command in ("serve", "engine") and not any(a.startswith("--worker-threads") for a in args) else []
        cmd = [sys.executable, "-m", "shuttle.launcher.cli", command, str(model_dir), *port, *threads, *args]

        def before_exec() -> None:
            die_with_parent()
            if preexec is not None:
                preexec()

        # --port 0 makes the batch endpoint pick a free port too (tcp://127.0.0.1:*)
        env = {**os.environ, **(env or {})}
        if step_delay:  # worker/loop.py's test hook: keeps requests in flight on a tiny model
            env[STEP_DELAY_ENV] = str(step_delay)
        err = open(stderr, "w") if stderr is not None else None  # the processes' log lines, to a file
        try:
            self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True,
                                         start_new_session=True, env=env, preexec_fn=before_exec)
        finally:
            if err is not None:
                err.close()  # the child holds its own copy
        self.output: list[str] = []
        self.url = ""
        self.batch_endpoint = ""
        self.pids: dict[str, int] = {}
        self.past_pids: set[int] = set()
        self.restarts = 0
        self.ready_info: dict | None = None
        ready = threading.Event()
        threading.Thread(target=self._read, args=(ready,), daemon=True).start()
        if not ready.wait(start_timeout) or self.ready_info is None:
            status = self.stop()
            # its stderr (where a refusal's one line goes) is the caller's own, printed above
            said = "\n".join(self.output) or "(nothing on stdout; its error, if any, is on stderr)"
            raise RuntimeError(f"shuttle {command} did not become ready (exit status {status}):\n{said}")

    def __enter__(self) -> ShuttleServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _read(self, ready: threading.Event) -> None:
        assert self.proc.stdout is not None  # started with stdout=PIPE
        for line in self.proc.stdout:
            line = launcher_text(line.rstrip("\n"))
            self.output.append(line)
            if line.startswith("shuttle: ready "):
                info = self.ready_info = json.loads(line[len("shuttle: ready "):])
                self.url, self.pids, self.batch_endpoint = info["url"], info["pids"], info["batch_endpoint"]
                ready.set()
            elif line.startswith("shuttle: restarted "):
                self.past_pids.update(self.pids.values())
                self.pids = json.loads(line[len("shuttle: restarted "):])["pids"]
                self.restarts += 1
        ready.set()

    @property
    def all_pids(self) -> list[int]:
        return [self.proc.pid, *self.pids.values()]

    def wait_restarts(self, count: int, timeout: float = 120.0) -> None:
        """Wait until the launcher has announced `count` restarts in all (a generous bound: fails only on a hang).

        Raises:
            TimeoutError: fewer restarts announced within `timeout` seconds.
        """
        deadline = time.monotonic() + timeout
        while self.restarts < count:
            if time.monotonic() >= deadline:
                raise TimeoutError("no restart announced:\n" + "\n".join(self.output[-20:]))
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int | None:
        """Signal the launcher, wait, then kill by PID anything of ours still alive. Returns its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.all_pids:
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.proc.poll() is None:
            self.proc.wait(5)
        return self.proc.returncode

    def wait_gone(self, timeout: float = 5.0) -> list[int]:
        """PIDs of the group still alive after `timeout` seconds (empty when all are gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = [p for p in self.all_pids if pid_alive(p)]
            if not alive:
                return []
            time.sleep(0.05)
        return [p for p in self.all_pids if pid_alive(p)]
