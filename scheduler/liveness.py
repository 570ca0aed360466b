"""Liveness on the scheduler's side: a step watchdog for the worker, and noticing frontends that are gone.

Both are small clocks the step loop consults; neither sends anything itself.
"""

from __future__ import annotations

import math
import os
import time
from typing import Callable

from shuttle.common.process import boot_id, unwatched

FRONTEND_TIMEOUT_S = 10.0  # a frontend heartbeats every second (frontend/engine/client.py); 10 missed: gone
# The step loop looks at its clocks at least once a second (idle polls 100 ms, result waits at most 1 s); a longer gap
# is time the scheduler itself did not run (common/process.py unwatched).
EXIT_WORKER_HUNG = 3  # the scheduler's exit status when the step watchdog fires (the launcher restarts the engine)


class WorkerHung(Exception):
    """The worker has not answered a step within --step-timeout seconds."""


# A worker that keeps using CPU is working, however slowly; but a step thread that spins forever (a livelock, a
# busy-wait on a device that never answers) would then never be restarted. A step still in flight after this many
# --step-timeout periods is declared hung whatever its CPU time says.
WORKING_STEP_LIMIT = 10


class StepWatchdog:
    """Declares the worker hung when the step in flight makes no progress for --step-timeout seconds.

    Progress is read from what the worker does, not from the wall clock: with `work` (a function returning each
    rank's CPU seconds, see WorkerCpuClocks), a step is overdue only once some rank has used no CPU time for
    `timeout` seconds (a SIGSTOPped, deadlocked or blocked worker), so a worker starved by other processes on a busy
    host, or compiling kernels in its first step, is slow but never taken for hung. A step in
    flight for WORKING_STEP_LIMIT x timeout is hung regardless. Without `work`, or where a rank's CPU time cannot
    be read (the worker on another host), a step is overdue `timeout` seconds after it was sent.

    `poll_ms()` bounds each wait so `check()` runs at least once a second; time the scheduler spent not running (a
    gap over common/process.py's MAX_LOOK_GAP_S between two checks) does not count against the worker.

    Args:
        timeout: seconds one step may go without progress (0: no limit).
        clock: time source in seconds (time.monotonic; tests pass their own).
        work: per-rank CPU seconds of the worker processes (None for a rank that cannot be read), or None.
    """

    def __init__(self, timeout: float, clock: Callable[[], float] = time.monotonic,
                 work: Callable[[], list[float | None]] | None = None):
        self.timeout = timeout
        self.clock = clock
        self.work = work
        self._step_id = -1
        self._sent_at = self._watched_from = 0.0
        self._last_look = clock()
        self._readings: list[float | None] = []  # each rank's CPU seconds at its last advance
        self._advanced_at: list[float] = []  # when each rank's CPU time was last seen to advance
        self._read_at = -math.inf

    def sent(self, step_id: int, at: float | None = None) -> None:
        """Time step `step_id` from `at` (clock seconds when it was sent; now by default). The progress rule and
        WORKING_STEP_LIMIT count from now, when the step became the one waited for: every rank counts as advanced
        now, against the previous step's last reading (or the first reading of this one, if there is none)."""
        self._last_look = self.clock()
        self._step_id, self._sent_at = step_id, self._last_look if at is None else at
        self._watched_from = self._last_look
        if self._readings:  # the last reading is this step's baseline: /proc is read twice a second, not each step
            self._advanced_at = [self._last_look] * len(self._readings)
        else:
            self._advanced_at, self._read_at = [], -math.inf

    def poll_ms(self) -> int:
        if self.timeout <= 0:
            return 1000
        left = self._deadline() - self.clock()
        return max(1, min(1000, int(left * 1000) + 1))

    def check(self) -> None:
        """Raises WorkerHung when the step in flight is overdue (see the class)."""
        now = self.clock()
        missed = unwatched(now - self._last_look)
        self._sent_at += missed
        self._watched_from += missed
        self._advanced_at = [t + missed for t in self._advanced_at]
        self._last_look = now
        if self.timeout <= 0:
            return
        if self.work is not None and (now - self._read_at >= 0.5 or now > self._deadline()):
            self._read_work(now)
        if now > self._deadline():
            if self._advanced_at and now - self._watched_from <= self.timeout * WORKING_STEP_LIMIT:
                stalled = [rank for rank, t in enumerate(self._advanced_at) if now - t > self.timeout]
                raise WorkerHung(f"the worker made no progress on step {self._step_id} for {self.timeout:g} s "
                                 f"(--step-timeout): rank(s) {stalled} used no CPU time")
            if self._advanced_at:
                raise WorkerHung(f"the worker did not return step {self._step_id} within "
                                 f"{WORKING_STEP_LIMIT} x {self.timeout:g} s (--step-timeout), still using CPU time")
            raise WorkerHung(f"the worker did not return step {self._step_id} within {self.timeout:g} s "
                             f"(--step-timeout)")

    def _deadline(self) -> float:
        if not self._advanced_at:
            return self._sent_at + self.timeout
        return min(min(self._advanced_at) + self.timeout, self._watched_from + self.timeout * WORKING_STEP_LIMIT)

    def _read_work(self, now: float) -> None:
        """Sample each rank's CPU time; a rank whose reading moved has advanced now. The first sample of a step
        counts as an advance now: under overlapped scheduling a step is timed from when it became the oldest in
        flight, which may be long after it was sent, and nothing says how the worker fared before the first look.
        An unreadable rank drops the watchdog to the wall-clock rule for this step."""
        assert self.work is not None  # check() reads only with a CPU-time source
        readings = self.work()
        self._read_at = now
        if not readings or any(r is None for r in readings):
            self._readings, self._advanced_at = [], []
            return
        if len(self._readings) != len(readings):
            self._readings, self._advanced_at = list(readings), [now] * len(readings)
            return
        for rank, reading in enumerate(readings):
            if reading != self._readings[rank]:
                self._readings[rank], self._advanced_at[rank] = reading, now


class WorkerCpuClocks:
    """CPU seconds (user + system, every thread) that each worker rank's process has used, read from Linux's
    /proc/<pid>/stat (fields 14 and 15, utime and stime, in clock ticks; proc(5)).

    The whole process, not the thread that runs the steps: that thread waits asleep at OpenMP's barriers (after a
    spin of under a millisecond, common/cpu_threads.py) while the pool's threads do the step's work, and on a
    crowded host it went seconds without CPU time while its step advanced. The price: a deadlocked step beside a grammar
    compile that still runs (at most 30 s, worker/grammar.py, or an over-long one left to finish) reads as progress
    until that compile ends, or until WORKING_STEP_LIMIT.

    A rank reads as None where its process cannot be read from here: another host (its boot id differs), another
    platform, or a process that is gone. A stopped process's CPU time does not advance.

    Args:
        processes: (boot id, pid) of each rank's process, as the ranks report them in WorkerReady.
    """

    def __init__(self, processes: list[tuple[str, int]]):
        here = boot_id()
        self.paths = [f"/proc/{pid}/stat" if boot and boot == here and pid > 0 else None for boot, pid in processes]
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def __call__(self) -> list[float | None]:
        return [self._read(path) for path in self.paths]

    def _read(self, path: str | None) -> float | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as stat:
                data = stat.read()
        except OSError:
            return None
        fields = data[data.rindex(b")") + 2:].split()  # the command name, in parentheses, may hold spaces
        if fields[0] == b"Z":
            return None  # exited, not yet reaped
        return (int(fields[11]) + int(fields[12])) / self._tick


class FrontendWatch:
    """Remembers when each frontend (ZeroMQ identity) was last heard from; `gone()` names the silent ones.

    The loop calls `gone()` on every turn, waits included; a gap over MAX_LOOK_GAP_S (common/process.py) between two
    calls is time the scheduler did not run, and counts as MAX_LOOK_GAP_S of silence: after a pause the frontends'
    heartbeats have not been sent yet, and ending their requests then would leave their clients waiting on answers that
    never come.

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
        missed = unwatched(now - self._last_look)
        self._last_look = now
        if missed:
            for client in self._last_seen:
                self._last_seen[client] += missed
        if now < self._next_check:
            return []
        self._next_check = now + 1.0
        silent = [c for c, t in self._last_seen.items() if now - t > self.timeout]
        for client in silent:
            del self._last_seen[client]
        return silent

