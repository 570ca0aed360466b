"""Liveness on the scheduler's side: a step watchdog for the worker, and noticing frontends that are gone.

Both are small clocks the step loop consults; neither sends anything itself.
"""

from __future__ import annotations

import time

FRONTEND_TIMEOUT_S = 10.0  # a frontend heartbeats every second (frontend/engine_client.py); 10 missed: gone
EXIT_WORKER_HUNG = 3  # the scheduler's exit status when the step watchdog fires (the launcher restarts the engine)


class WorkerHung(Exception):
    """The worker has not answered a step within --step-timeout seconds."""


class StepWatchdog:
    """Times the step in flight. `poll_ms()` bounds each wait so `check()` runs at least once a second.

    Args:
        timeout: seconds one step may take (0: no limit).
    """

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._step_id = -1
        self._sent_at = 0.0

    def sent(self, step_id: int, at: float | None = None) -> None:
        """Time step `step_id` from `at` (time.monotonic() seconds when it was sent; now by default)."""
        self._step_id, self._sent_at = step_id, time.monotonic() if at is None else at

    def poll_ms(self) -> int:
        if self.timeout <= 0:
            return 1000
        left = self._sent_at + self.timeout - time.monotonic()
        return max(1, min(1000, int(left * 1000) + 1))

    def check(self) -> None:
        """Raises WorkerHung when the step in flight is overdue."""
        if self.timeout > 0 and time.monotonic() - self._sent_at > self.timeout:
            raise WorkerHung(f"the worker did not return step {self._step_id} within {self.timeout:g} s "
                             f"(--step-timeout)")


class FrontendWatch:
    """Remembers when each frontend (ZeroMQ identity) was last heard from; `gone()` names the silent ones."""

    def __init__(self, timeout: float = FRONTEND_TIMEOUT_S):
        self.timeout = timeout
        self._last_seen: dict[bytes, float] = {}
        self._next_check = 0.0

    def seen(self, client: bytes) -> None:
        self._last_seen[client] = time.monotonic()

    def gone(self) -> list[bytes]:
        """Frontends silent for longer than the timeout (each named once); checked at most once a second."""
        now = time.monotonic()
        if now < self._next_check:
            return []
        self._next_check = now + 1.0
        silent = [c for c, t in self._last_seen.items() if now - t > self.timeout]
        for client in silent:
            del self._last_seen[client]
        return silent
