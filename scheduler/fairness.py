"""Fair shares of the running set between client requests, so one request cannot monopolise the engine.

One HTTP request can fan out into many sequences (64 prompts x n=16 is 1,024 of them, from a 2 KB body). Each
sequence is its own scheduler request, but they share a group (the client request's id). A group may hold at most
its share of the `max_num_seqs` running slots: `--max-seqs-per-request` when set, else `max_num_seqs // groups`
while several groups are live, and `max_num_seqs` minus a reserve of one eighth when it is alone, so that a
newcomer always finds a free slot at once instead of waiting for a long generation to end. A sequence over its
group's share is parked (still waiting, out of the queue's order) until one of its group's running sequences
leaves the running set.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from shuttle.scheduler.request import Request


class GroupShares:
    """Counts live and running sequences per group and parks the ones over their group's share.

    Args:
        max_num_seqs: running slots of the engine.
        max_seqs_per_request: a fixed share per group (0: automatic, as the module docstring says).
    """

    def __init__(self, max_num_seqs: int, max_seqs_per_request: int = 0):
        self.max_num_seqs = max_num_seqs
        self.fixed_share = max_seqs_per_request
        self.reserve = max_num_seqs // 8
        self._live: Counter[str] = Counter()
        self._running: Counter[str] = Counter()
        # per group, its parked requests in the order they were parked, by id(): one leaves in O(1) (a deque's
        # remove() was O(parked), and a request of n = 10^6 sequences took hours to end)
        self._parked: dict[str, dict[int, Request]] = defaultdict(dict)
        self.num_parked = 0

    def share(self) -> int:
        """Running slots one group may hold now."""
        if self.fixed_share:
            return self.fixed_share
        if len(self._live) > 1:
            return max(1, self.max_num_seqs // len(self._live))
        return max(1, self.max_num_seqs - self.reserve)

    def arrive(self, request: Request) -> None:
        self._live[request.group] += 1

    def over_share(self, request: Request) -> bool:
        return self._running[request.group] >= self.share()

    def park(self, request: Request) -> None:
        self._parked[request.group][id(request)] = request
        self.num_parked += 1

    def start_running(self, request: Request) -> None:
        self._running[request.group] += 1

    def stop_running(self, request: Request) -> Request | None:
        """The request left the running set (finished or preempted); returns a parked request of its group that
        may wait in the queue again, if any."""
        group = request.group
        self._running[group] -= 1
        if not self._running[group]:
            del self._running[group]
        parked = self._parked.get(group)
        if parked:
            self.num_parked -= 1
            request = parked.pop(next(iter(parked)))  # the first parked
            if not parked:
                del self._parked[group]
            return request
        return None

    def leave(self, request: Request) -> bool:
        """The request ended; True if it was parked (and is no longer)."""
        group = request.group
        self._live[group] -= 1
        if not self._live[group]:
            del self._live[group]
        parked = self._parked.get(group)
        if parked and parked.pop(id(request), None) is not None:
            self.num_parked -= 1
            if not parked:
                del self._parked[group]
            return True
        return False
