"""What the launcher holds of a child process: a local subprocess.Popen, a worker rank on a Ray node
(launcher/ray_backend.py), or a rank that never started; and how one ended, in words."""

from __future__ import annotations

import signal
from typing import Protocol


class Process(Protocol):
    """What the launcher uses of a unit's process: a local subprocess.Popen, or a rank on a Ray node
    (launcher/ray_backend.py)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, signum: int) -> None: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def process_end(role: str, proc: Process) -> str:
    """How a unit's process ended, in words: "worker (pid 12) was killed by signal SIGKILL"; a Ray rank names its
    node, or that it was lost with it."""
    describe = getattr(proc, "describe", None)
    how = describe() if describe is not None else describe_exit(proc.returncode or 0)
    return f"{role} did not start: {how}" if proc.pid == 0 else f"{role} (pid {proc.pid}) {how}"


def describe_exit(code: int) -> str:
    """A child's return code in words: "exited with status 2", "was killed by signal SIGKILL"."""
    if code < 0:
        return f"was killed by signal {signal.Signals(-code).name}"
    return f"exited with status {code}"


class FailedProcess:
    """A rank that never started (Ray could not place its group, or its actor did not start): it reads as a process
    that exited with status 1, so the launcher's usual failure path (backoff, bounded restarts) takes it."""

    pid = 0

    def __init__(self, reason: str):
        self.reason = reason
        self.returncode: int | None = 1

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return 1

    def send_signal(self, signum: int) -> None:
        pass

    def terminate(self) -> None:
        pass

    def kill(self) -> None:
        pass

    def describe(self) -> str:
        return self.reason
