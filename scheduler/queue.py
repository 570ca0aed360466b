"""The waiting queue, ordered by the scheduling policy's rank (smaller runs sooner).

FCFS ranks by arrival time. Priority ranks by `priority - waited / aging_seconds`: every `aging_seconds`
spent waiting is worth one priority level, so a steady stream of urgent work cannot starve the rest.
Because "now" is common to every request, that order equals the order of the time-invariant key
`priority + arrival_time / aging_seconds`, which is what lets a plain heap hold it.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from scheduler.request import Request


class WaitingQueue:
    """A heap of waiting requests with lazy removal.

    Args:
        policy: "fcfs" or "priority".
        aging_seconds: with "priority", waiting seconds worth one priority level (0 turns aging off).
    """

    def __init__(self, policy: str = "fcfs", aging_seconds: float = 0.0):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[tuple[float, float], int, Request]] = []
        self._counter = itertools.count()
        self._members: dict[str, Request] = {}

    def rank(self, request: Request) -> tuple[float, float]:
        """Sort key of a request under this policy; preemption picks the running request with the largest."""
        if self.policy == "fcfs":
            return (request.arrival_time, 0.0)
        if self.aging_seconds > 0:
            return (request.priority + request.arrival_time / self.aging_seconds, request.arrival_time)
        return (float(request.priority), request.arrival_time)

    def push(self, request: Request) -> None:
        self._members[request.request_id] = request
        heapq.heappush(self._heap, (self.rank(request), next(self._counter), request))

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[2]
        del self._members[request.request_id]
        return request

    def remove(self, request_id: str) -> Request | None:
        """Take a request out wherever it is (O(1); the heap entry is dropped when it surfaces)."""
        return self._members.pop(request_id, None)

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][2].request_id not in self._members:
            heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._members

    def __iter__(self) -> Iterator[Request]:
        return iter(self._members.values())
