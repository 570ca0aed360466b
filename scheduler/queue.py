"""The waiting queue, ordered by the scheduling policy's rank (smaller runs sooner).

FCFS ranks by arrival time. Priority ranks by `priority - waited / aging_seconds`: every `aging_seconds`
spent waiting is worth one priority level, so a steady stream of urgent work cannot starve the rest.
Because "now" is common to every request, that order equals the order of the time-invariant key
`priority + arrival_time / aging_seconds`, which is what lets a plain heap hold it.

Above either policy sits the service class: background (batch) requests rank behind every interactive one,
whatever their priority or age, so a batch job never delays an interactive request's first token. Within a
class the policy orders as above. Background work waits while interactive work saturates the server; that is
its contract (batch clients see it as throughput, not as errors).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

from shuttle.scheduler.request import Request


class WaitingQueue:
    """A heap of waiting requests with lazy removal.

    A heap entry counts only while its own push is the member's current one (a sequence number per push), so a
    request id that a client reuses after an abort can never resurrect the old entry, and a request removed
    and pushed again is never popped twice.

    Args:
        policy: "fcfs" or "priority".
        aging_seconds: with "priority", waiting seconds worth one priority level (0 turns aging off).
    """

    def __init__(self, policy: str = "fcfs", aging_seconds: float = 0.0):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {policy!r}")
        self.policy = policy
        self.aging_seconds = aging_seconds
        self._heap: list[tuple[tuple[float, float, float], int, Request]] = []
        self._counter = itertools.count()
        self._members: dict[str, tuple[Request, int]] = {}  # request id -> (request, sequence number of its push)
        self.num_interactive = 0  # members that are not background work

    def rank(self, request: Request) -> tuple[float, float, float]:
        """Sort key of a request under this policy: (service class, policy key, tie-break); preemption picks the
        running request with the largest, so background requests are preempted first."""
        service_class = 1.0 if request.background else 0.0
        if self.policy == "fcfs":
            return (service_class, request.arrival_time, 0.0)
        if self.aging_seconds > 0:
            return (service_class, request.priority + request.arrival_time / self.aging_seconds, request.arrival_time)
        return (service_class, float(request.priority), request.arrival_time)

    def push(self, request: Request) -> None:
        seq = next(self._counter)
        previous = self._members.get(request.request_id)
        if previous is not None and not previous[0].background:
            self.num_interactive -= 1
        self._members[request.request_id] = (request, seq)
        self.num_interactive += not request.background
        heapq.heappush(self._heap, (self.rank(request), seq, request))

    def peek(self) -> Request | None:
        self._drop_removed()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        self._drop_removed()
        request = heapq.heappop(self._heap)[2]
        del self._members[request.request_id]
        self.num_interactive -= not request.background
        return request

    def remove(self, request: Request) -> bool:
        """Take this request out wherever it is (O(1); the heap entry is dropped when it surfaces)."""
        member = self._members.get(request.request_id)
        if member is not None and member[0] is request:
            del self._members[request.request_id]
            self.num_interactive -= not request.background
            return True
        return False

    def _drop_removed(self) -> None:
        while self._heap:
            _, seq, request = self._heap[0]
            member = self._members.get(request.request_id)
            if member is not None and member[1] == seq:
                return
            heapq.heappop(self._heap)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, request: Request) -> bool:
        member = self._members.get(request.request_id)
        return member is not None and member[0] is request

    def __iter__(self) -> Iterator[Request]:
        return (request for request, _ in self._members.values())
