"""Retry-After for a refused request: a prediction of when a retry will be admitted, not a constant.

When the scheduler's waiting queue is full, a retry is admitted once a waiting request has left the queue for
every refused client that comes back before it. So each refusal takes a place in a virtual queue of promises:
the k-th outstanding refusal is told to wait k / r seconds, where r is the rate at which requests leave the
waiting queue (measured from the scheduler's cumulative `num_admitted` while requests were waiting). Clients
that honour Retry-After then come back spread out at the pace the engine admits them, instead of all at once
into a wall. A refused client that returns and is refused again takes a new place; its old promise lapses
PROMISE_GRACE_S after it was due.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

WINDOW_S = 10.0  # admission rate measured over this much recent saturated time
PROMISE_GRACE_S = 1.0
SAFETY = 0.9  # plan with 90% of the measured rate: a retry that comes a little late is admitted, an early one is not
MAX_RETRY_AFTER_S = 3600.0


def header_value(seconds: float) -> str:
    """HTTP's Retry-After is whole seconds: round up, at least 1."""
    return str(max(1, math.ceil(seconds)))


class RetryAfterEstimator:
    """Feeds on the scheduler's stats (`observe`) and answers each refusal (`refused`) with seconds to wait."""

    def __init__(self):
        self._samples: deque[tuple[float, int, bool]] = deque()  # (time, num_admitted, requests waiting)
        self._promises: list[float] = []  # heap of times at which refused clients are expected back
        self._last_rate: float | None = None

    def observe(self, now: float, num_admitted: int, num_waiting: int) -> None:
        self._samples.append((now, num_admitted, num_waiting > 0))
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()

    def admission_rate(self) -> float | None:
        """Requests leaving the waiting queue per second over the window's saturated intervals (both ends with
        requests waiting), or the last such measurement; None before any."""
        admitted, seconds = 0, 0.0
        previous = None
        for sample in self._samples:
            if previous is not None and previous[2] and sample[2] and sample[1] >= previous[1]:
                admitted += sample[1] - previous[1]
                seconds += sample[0] - previous[0]
            previous = sample
        if seconds >= 0.5 and admitted > 0:
            self._last_rate = admitted / seconds
        return self._last_rate

    def refused(self, now: float) -> float:
        """Seconds the client just refused should wait; it joins the virtual queue of promises."""
        while self._promises and self._promises[0] < now - PROMISE_GRACE_S:
            heapq.heappop(self._promises)
        rate = self.admission_rate()
        if rate is None:
            return 1.0
        wait = min((len(self._promises) + 1) / (rate * SAFETY), MAX_RETRY_AFTER_S)
        heapq.heappush(self._promises, now + wait)
        return wait
