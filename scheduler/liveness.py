"""Liveness on the scheduler's side: a step watchdog for the worker, and noticing frontends that are gone.

Both are small clocks the step loop consults; neither sends anything itself.
"""

from __future__ import annotations

import time
from typing import Callable

FRONTEND_TIMEOUT_S = 10.0  # a frontend heartbeats every second (frontend/engine_client.py); 10 missed: gone
# The step loop looks at its clocks at least once a second (idle polls 100 ms, result waits at most 1 s). A longer gap
# between two looks means the scheduler itself did not run (the machine or the process was paused, or starved):
# silence it was not there to hear, and a step it was not there to time, count only this much of that gap.
MAX_LOOK_GAP_S = 2.0
EXIT_WORKER_HUNG = 3  # the scheduler's exit status when the step watchdog fires (the launcher restarts the engine)


class WorkerHung(Exception):
    """The worker has not answered a step within --step-timeout seconds."""


class StepWatchdog:
    """Times the step in flight. `poll_ms()` bounds each wait so `check()` runs at least once a second; time the
    scheduler spent not running (a gap over MAX_LOOK_GAP_S between two checks) does not count against the worker.

    Args:
        timeout: seconds one step may take (0: no limit).
        clock: time source in seconds (time.monotonic; tests pass their own).
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self._step_id = -1
        self._sent_at = 0.0
        self._last_look = clock()

    def sent(self, step_id: int, at: float | None = None) -> None:
        """Time step `step_id` from `at` (clock seconds when it was sent; now by default)."""
        self._last_look = self.clock()
        self._step_id, self._sent_at = step_id, self._last_look if at is None else at

    def poll_ms(self) -> int:
        if self.timeout <= 0:
            return 1000
        left = self._sent_at + self.timeout - self.clock()
        return max(1, min(1000, int(left * 1000) + 1))

    def check(self) -> None:
        """Raises WorkerHung when the step in flight is overdue."""
        now = self.clock()
        self._sent_at += _unwatched(now - self._last_look)
        self._last_look = now
        if self.timeout > 0 and now - self._sent_at > self.timeout:
            raise WorkerHung(f"the worker did not return step {self._step_id} within {self.timeout:g} s "
                             f"(--step-timeout)")


class FrontendWatch:
    """Remembers when each frontend (ZeroMQ identity) was last heard from; `gone()` names the silent ones.

    The loop calls `gone()` on every turn, waits included; a gap over MAX_LOOK_GAP_S between two calls is time the
    scheduler did not run, and counts as MAX_LOOK_GAP_S of silence: after a pause the frontends' heartbeats have not
    been sent yet, and ending their requests then would leave their clients waiting on answers that never come.

    Args:
        timeout: seconds of silence after which a frontend is gone.
        clock: time source in seconds (time.monotonic; tests pass their own).
    """

    def __init__(self, timeout: float = FRONTEND_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        self.timeout = timeout
        self.clock = clock
        self._last_seen: dict[bytes, float] = {}
        self._next_check = 0.0
        self._last_look = clock()

    def seen(self, client: bytes) -> None:
        self._last_seen[client] = self.clock()

    def gone(self) -> list[bytes]:
        """Frontends silent for longer than the timeout (each named once); checked at most once a second."""
        now = self.clock()
        unwatched = _unwatched(now - self._last_look)
        self._last_look = now
        if unwatched:
            for client in self._last_seen:
                self._last_seen[client] += unwatched
        if now < self._next_check:
            return []
        self._next_check = now + 1.0
        silent = [c for c, t in self._last_seen.items() if now - t > self.timeout]
        for client in silent:
            del self._last_seen[client]
        return silent


def _unwatched(gap: float) -> float:
    """The part of a gap between two looks (seconds) that the scheduler was not running for."""
    return max(0.0, gap - MAX_LOOK_GAP_S)
