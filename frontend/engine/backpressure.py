"""Retry-After for a refused request: a prediction of when a retry will be admitted, from what the server knows.

A 503 has one of three causes, each with its own prediction:
1. The waiting queue is full (RetryAfterEstimator). A retry gets in once a slot of the waiting queue is free for
   it. While requests wait, a slot opens each time a running request finishes and a waiting one takes its place,
   so the rate is that of requests finishing (SlotRate): from the scheduler's cumulative counters (admitted, less
   the running set, less preempted), over the recent intervals with requests waiting at both ends, and over at
   least MIN_FINISHED of them, going further back when they are fewer (a slow engine). Not the admissions alone: a
   burst on an idle engine admits a whole batch at once, a pace that does not last. Until enough requests have
   finished, the running set has hardly turned over since requests began to wait: the rate is at most about
   num_running over that time, which makes the waits below lower bounds (at least a second each, and longer with
   every second nothing finishes). No slot counts as open now: the refusal itself says the queue was full, and
   slots free in the latest stats (which lag) were taken by then, mostly by clients coming back as promised.
   The refused clients form a line of promises, each due back at a time; the newcomer is placed at the first time
   t from which the slots opened by then (rate x (t - now)) cover the promises due by then and itself, found
   by counting the promises due before the candidate time until it settles. Where earlier promises are too
   dense for the present rate (it fell since they were made) the newcomer goes right after the line's last
   promise instead: those of them that find no slot are refused again and go behind it. So the line has neither
   gaps in which the queue drains while clients sleep nor promises counted twice. A promise stops counting when
   it falls due: its client has come back by then (and got in, or was refused again and holds a new promise) or
   has given up. No safety margin: a retry that comes early costs one more 503 with a fresher estimate, one that
   comes late leaves a slot idle.
2. The engine restarts (RestartClock): the launcher's estimate (its backoff plus the unit's last measured
   start-up, launcher/supervised_unit.py), or the restart measured last time where the launcher cannot say (a
   remote group), less the time the engine has been down; once overrun, a retry a second later, which the
   frontend refuses at once at no cost to the engine.
3. The server drains: it is going away and will not come back, so there is no promise at all (HTTP: no
   Retry-After, `Connection: close`, `x-should-retry: false`, which the official OpenAI clients obey).

The HTTP headers carry the wait twice: `Retry-After` in whole seconds (rounded up, as HTTP has it) and
`retry-after-ms`, which the official OpenAI clients read first. No wait is longer than MAX_RETRY_AFTER_S: the
official clients give up at once on a longer one (past 60 s in older versions, 120 s in openai 3.x) instead of
retrying, and a rate measured over seconds says little about minutes ahead; a client told the cap comes back,
is refused if its turn has not come, and is told again from a fresher rate, in about the order it first came.
"""

from __future__ import annotations

import bisect
import math

WINDOW_S = 10.0  # the rate of freed slots is measured over at least this much recent time
MIN_FINISHED = 16  # and over at least this many finished requests (further back when needed, up to HISTORY_S)
HISTORY_S = 300.0
MIN_SATURATED_S = 0.5  # of time with requests waiting at both ends of an interval, before a rate is trusted
UNMEASURED_WAIT_S = 1.0  # the shortest wait told before any rate is measured (the wait when nothing runs)
MIN_WAIT_S = 0.001  # retry-after-ms counts whole milliseconds
MAX_RETRY_AFTER_S = 60.0
MAX_SETTLE_STEPS = 64  # counting the promises due before a candidate time settles within this many rounds
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


class SlotRate:
    """Requests finishing per second while requests wait: the rate at which a full waiting queue frees slots.

    Kept as cumulative sums (finished requests, saturated seconds) per stats message, so a rate over any recent
    stretch is two bisections, however many messages arrive.
    """

    def __init__(self) -> None:
        self._times: list[float] = []
        self._finished: list[int] = []  # cumulative finished requests over saturated intervals
        self._seconds: list[float] = []  # cumulative saturated seconds
        self._first = 0  # entries before it are older than HISTORY_S
        self._previous: tuple[float, int, bool] | None = None  # (time, scheduler's finished count, any waiting)
        self._last_rate: float | None = None

    def observe(self, now: float, finished_count: int, waiting: bool) -> None:
        """`finished_count`: the scheduler's admitted - running - preempted, at monotonic time `now`."""
        finished, seconds = (self._finished[-1], self._seconds[-1]) if self._times else (0, 0.0)
        previous = self._previous
        # a count that went down belongs to a new scheduler (the engine restarted): no interval across it
        if previous is not None and previous[2] and waiting and finished_count >= previous[1]:
            finished += finished_count - previous[1]
            seconds += now - previous[0]
        self._previous = (now, finished_count, waiting)
        self._times.append(now)
        self._finished.append(finished)
        self._seconds.append(seconds)
        self._first = bisect.bisect_left(self._times, now - HISTORY_S, self._first)
        if self._first > 1024 and self._first > len(self._times) // 2:
            del self._times[:self._first], self._finished[:self._first], self._seconds[:self._first]
            self._first = 0

    def rate(self) -> float | None:
        """Over the last WINDOW_S seconds, or as far back as it takes for MIN_FINISHED finished requests; the
        last trusted measurement when there is none now; None before any."""
        if not self._times:
            return self._last_rate
        newest = len(self._times) - 1
        start = max(bisect.bisect_right(self._times, self._times[newest] - WINDOW_S, self._first) - 1, self._first)
        if self._finished[newest] - self._finished[start] < MIN_FINISHED:  # too few: further back
            wanted = self._finished[newest] - MIN_FINISHED
            start = max(bisect.bisect_right(self._finished, wanted, self._first, start) - 1, self._first)
        finished = self._finished[newest] - self._finished[start]
        seconds = self._seconds[newest] - self._seconds[start]
        if finished >= MIN_FINISHED and seconds >= MIN_SATURATED_S:
            self._last_rate = finished / seconds
        return self._last_rate


class RetryAfterEstimator:
    """Feeds on the scheduler's stats (`observe`) and answers each full-queue refusal (`refused`) with seconds
    to wait (module docstring, point 1)."""

    def __init__(self) -> None:
        self.slots = SlotRate()
        self._num_running = 0
        self._waiting_since: float | None = None  # since when requests have waited without a break
        self._dues: list[float] = []  # sorted times refused clients are due back; those before _first have passed
        self._first = 0

    def observe(self, now: float, num_admitted: int, num_waiting: int, num_running: int = 0,
                num_preemptions: int = 0) -> None:
        """One stats message: at monotonic time `now`, `num_admitted` and `num_preemptions` so far (cumulative),
        `num_waiting` in the queue, `num_running` in the running set."""
        if num_waiting == 0:
            self._waiting_since = None
        elif self._waiting_since is None:
            self._waiting_since = now
        self.slots.observe(now, num_admitted - num_running - num_preemptions, num_waiting > 0)
        self._num_running = num_running

    def admission_rate(self) -> float | None:
        """Slots opening in the waiting queue per second (SlotRate), None before any is measured."""
        return self.slots.rate()

    def _due_by(self, t: float) -> int:
        """Pending promises due at or before `t`."""
        return bisect.bisect_right(self._dues, t, self._first) - self._first

    def refused(self, now: float) -> float:
        """Seconds the client just refused (at monotonic time `now`) should wait; it takes its place in line."""
        self._first = bisect.bisect_right(self._dues, now, self._first)
        if self._first > 1024 and self._first > len(self._dues) // 2:
            del self._dues[:self._first]
            self._first = 0
        rate, shortest = self.admission_rate(), MIN_WAIT_S
        if rate is None:  # about an upper bound: the running set has hardly turned over since requests waited
            waited = now - self._waiting_since if self._waiting_since is not None else 0.0
            rate = self._num_running / waited if self._num_running and waited > 0 else None
            shortest = UNMEASURED_WAIT_S
        if rate is None:
            wait = UNMEASURED_WAIT_S
        else:
            wait = min(self._place(now, rate, shortest), MAX_RETRY_AFTER_S)
        bisect.insort(self._dues, now + wait, self._first)
        return wait

    def _place(self, now: float, rate: float, shortest: float) -> float:
        """Seconds from `now` to the newcomer's place in line (module docstring, point 1), at least `shortest`."""
        pending = len(self._dues) - self._first
        after_line = max((self._dues[-1] - now if pending else 0.0) + 1 / rate, shortest)
        ahead = 0
        for _ in range(MAX_SETTLE_STEPS):
            wait = max((ahead + 1) / rate, shortest)
            due = self._due_by(now + wait)
            if due == ahead:
                return min(wait, after_line)
            ahead = due
        # not settled: every pending promise counts as ahead
        return min(max((pending + 1) / rate, shortest), after_line)


class RestartClock:
    """When an engine that went down serves again (module docstring, point 2); times are monotonic seconds."""

    def __init__(self) -> None:
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
        return min(remaining, MAX_RETRY_AFTER_S) if remaining >= MIN_WAIT_S else OVERRUN_POLL_S
