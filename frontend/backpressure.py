"""Retry-After for a refused request: a prediction of when a retry will be admitted, from what the server knows.

A 503 has one of three causes, each with its own prediction:
1. The waiting queue is full (RetryAfterEstimator). A retry gets in once a slot of the waiting queue is free for
   it. While requests wait, a slot opens each time a running request finishes (and a waiting one takes its
   place), so the rate is that of requests finishing, measured over intervals with requests waiting at both ends
   from the scheduler's cumulative counters: admitted, less the growth of the running set, less preempted. Not
   the admissions alone: a burst on an idle engine admits a whole batch at once, a pace that does not last. F
   slots may be free already (the queue's bound less `num_waiting`). Until a request has finished, none has for
   as long as the running set has had its present size: the rate is at most num_running over that time, which
   makes the waits below lower bounds (at least a second each). The
   refused clients form a line of promises. With P promises pending (clients told to come back later than now),
   the client just refused is the (P + 1)-th to claim a slot: it is told (P + 1 - F) / rate, or to come right
   after the line's last promise (its due time plus 1 / rate) when that is sooner. The second form matters when
   the measured rate fell since the earlier promises were made: counting them again at the new rate would put
   the newcomer behind a stretch of time in which no promise falls due, and the queue would drain into it empty.
   A promise stops counting when it falls due: its client has come back by then (and got in, or was refused
   again and holds a new promise) or has given up. No safety margin: a retry that comes early costs one more
   503 with a fresher estimate, one that comes late leaves a slot idle.
2. The engine restarts (RestartClock): the launcher's estimate (its backoff plus the unit's last measured
   start-up, launch/supervised_unit.py), or the restart measured last time where the launcher cannot say (a
   remote group), less the time the engine has been down; once overrun, a retry a second later, which the
   frontend refuses at once at no cost to the engine.
3. The server drains: it is going away and will not come back, so there is no promise at all (HTTP: no
   Retry-After, `Connection: close`, `x-should-retry: false`, which the official OpenAI clients obey).

The HTTP headers carry the wait twice: `Retry-After` in whole seconds (rounded up, as HTTP has it) and
`retry-after-ms`, which the official OpenAI clients read first (they honour a wait of up to two minutes in
openai 3.x and give up at once on a longer one).
"""

from __future__ import annotations

import heapq
import math
from collections import deque

WINDOW_S = 10.0  # admission rate measured over this much recent time
MIN_SATURATED_S = 0.5  # of it with requests waiting at both ends of an interval, before the rate is trusted
UNMEASURED_WAIT_S = 1.0  # the shortest wait told before any rate is measured (the wait when nothing runs)
MIN_WAIT_S = 0.001  # a slot is free already: come back at once (retry-after-ms counts whole milliseconds)
MAX_RETRY_AFTER_S = 3600.0
OVERRUN_POLL_S = 1.0  # a restart that takes longer than expected: look again after this long


def header_value(seconds: float) -> str:
    """HTTP's Retry-After is whole seconds: round up, at least 1."""
    return str(max(1, math.ceil(seconds)))


def refusal_headers(retry_after: float | None, going_away: bool = False) -> dict[str, str]:
    """The headers of a 503: when to retry (`retry_after` seconds; None or 0: unknown, a second), or, from a
    server that is going away, no promise and no retry (the response must also close its connection)."""
    if going_away:
        return {"Connection": "close", "x-should-retry": "false"}
    seconds = retry_after or 1.0
    return {"Retry-After": header_value(seconds), "retry-after-ms": str(max(1, math.ceil(seconds * 1000)))}


class RetryAfterEstimator:
    """Feeds on the scheduler's stats (`observe`) and answers each full-queue refusal (`refused`) with seconds
    to wait (module docstring, point 1).

    Args:
        max_waiting: the waiting queue's bound (--max-waiting-requests); None: slots free now are not counted.
    """

    min_wait = MIN_WAIT_S

    def __init__(self, max_waiting: int | None = None):
        self._max_waiting = max_waiting
        # (time, requests finished so far (admitted - running - preempted), requests waiting)
        self._samples: deque[tuple[float, int, bool]] = deque()
        self._num_waiting = self._num_running = 0
        self._running_grew_at = 0.0  # the last time the running set grew into free room
        self._promises: list[float] = []  # heap of the times refused clients are due back
        self._line_end = 0.0  # the latest promise given
        self._last_rate: float | None = None

    def observe(self, now: float, num_admitted: int, num_waiting: int, num_running: int = 0,
                num_preemptions: int = 0) -> None:
        """One stats message: at monotonic time `now`, `num_admitted` and `num_preemptions` so far (cumulative),
        `num_waiting` in the queue, `num_running` in the running set."""
        if num_running > self._num_running:
            self._running_grew_at = now
        self._samples.append((now, num_admitted - num_running - num_preemptions, num_waiting > 0))
        self._num_waiting, self._num_running = num_waiting, num_running
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()

    def admission_rate(self) -> float | None:
        """Slots opening in the waiting queue per second: requests finishing, over the window's saturated
        intervals (both ends with requests waiting); or the last such measurement; None before any."""
        finished, seconds = 0, 0.0
        previous = None
        for sample in self._samples:
            # a count that went down belongs to a new scheduler (the engine restarted): no interval across it
            if previous is not None and previous[2] and sample[2] and sample[1] >= previous[1]:
                finished += sample[1] - previous[1]
                seconds += sample[0] - previous[0]
            previous = sample
        if seconds >= MIN_SATURATED_S and finished > 0:
            self._last_rate = finished / seconds
        return self._last_rate

    def free_slots(self) -> int:
        """Slots of the waiting queue free in the latest stats (0 when its bound is unknown)."""
        if self._max_waiting is None:
            return 0
        return max(self._max_waiting - self._num_waiting, 0)

    def refused(self, now: float) -> float:
        """Seconds the client just refused (at monotonic time `now`) should wait; it takes the next place in line."""
        while self._promises and self._promises[0] <= now:
            heapq.heappop(self._promises)
        rate, shortest = self.admission_rate(), self.min_wait
        if rate is None:  # an upper bound: nothing has finished while the running set had its present size
            running_for = now - self._running_grew_at
            rate = self._num_running / running_for if self._num_running and running_for > 0 else None
            shortest = UNMEASURED_WAIT_S
        if rate is None:
            wait = UNMEASURED_WAIT_S
        else:
            by_count = (len(self._promises) + 1 - self.free_slots()) / rate
            after_line = max(self._line_end - now, 0.0) + 1 / rate
            wait = min(max(min(by_count, after_line), shortest), MAX_RETRY_AFTER_S)
        heapq.heappush(self._promises, now + wait)
        self._line_end = max(self._line_end, now + wait)
        return wait


class RestartClock:
    """When an engine that went down serves again (module docstring, point 2); times are monotonic seconds."""

    def __init__(self):
        self._down_since: float | None = None
        self._expected = 0.0
        self.last_restart_s: float | None = None  # the last outage measured, down to serving again

    def down(self, now: float, expected: float | None = None) -> None:
        """The engine went down at `now`; `expected`: the launcher's estimate of seconds until it serves again
        (None: it has none, the last measured restart stands in, else OVERRUN_POLL_S)."""
        self._down_since = now
        self._expected = expected if expected is not None else (self.last_restart_s or OVERRUN_POLL_S)

    def up(self, now: float) -> None:
        """Its new scheduler answered at `now`: the restart is measured."""
        if self._down_since is not None:
            self.last_restart_s = now - self._down_since
        self._down_since = None

    def retry_after(self, now: float) -> float:
        """Seconds until it is expected back (OVERRUN_POLL_S once that time has passed, or while it is up)."""
        if self._down_since is None:
            return OVERRUN_POLL_S
        remaining = self._down_since + self._expected - now
        return remaining if remaining >= MIN_WAIT_S else OVERRUN_POLL_S
