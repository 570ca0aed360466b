"""A peer server of the benchmarks (llama.cpp's llama-server, vLLM) as a process of its own: started in a session of
its own, waited for until it answers, and stopped by its process group, SIGTERM then SIGKILL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.process import die_with_parent  # noqa: E402


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (another process may take it before the server does)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PeerServer:
    """`command` run with `env` (None: this process's) as a context manager: ready once GET url + `ready_path`
    answers 200 and `is_ready` accepts the body; its output goes to a temporary file (a pipe nobody reads would fill
    and stall it).

    Attributes:
        url: http://127.0.0.1:PORT, for the port the caller put in `command`.

    Raises:
        RuntimeError: it exited or was not ready within `start_timeout` seconds (its output's tail in the message).
    """

    name = "server"
    ready_path = "/health"

    def __init__(self, command: list[str], port: int, start_timeout: float, env: dict[str, str] | None = None):
        self.command = command
        self.url = f"http://127.0.0.1:{port}"
        self.env = env
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def is_ready(self, body: bytes) -> bool:
        return True

    def __enter__(self):
        self.log = tempfile.TemporaryFile()
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self._ready():
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer {self.url}{self.ready_path} in "
                                       f"{self.start_timeout} s: {self.log_tail()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + self.ready_path, timeout=2) as response:
                return response.status == 200 and self.is_ready(response.read())
        except OSError:
            return False

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its process group (the server and any process it started), SIGKILL after `timeout` s and to
        whatever of the group outlives it."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the group id is its pid
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        self.process = None
