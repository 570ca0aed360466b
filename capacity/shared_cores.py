"""Single-threaded processes sharing a machine's cores, in virtual time (the simulator's CPU model).

Each process (a lane) runs its jobs one after another, in the order they were submitted. While more processes have
work than there are cores, the cores are shared among them in proportion to their weights, none getting more than
one core (generalised processor sharing: Parekh and Gallager, "A generalized processor sharing approach to flow
control in integrated services networks", IEEE/ACM Transactions on Networking 1(3), 1993; what one core can
not use goes to the others, as in water-filling); otherwise each runs at full speed. A job's work is its CPU
seconds at the machine's nominal speed; its callback runs at the virtual time it completes and may submit more jobs.
The machine's speed (`speed`, 1 nominal) scales how fast every process's work progresses while it holds a core, as a
shared host's other tenants slow all of them alike; the CPU seconds counted are the time on a core, as /proc counts
them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Callable, Mapping, Sequence

DONE = 1e-12  # CPU seconds left below which a job is complete (the float residue of subtracting rates x times)


class SharedCores:
    """Lanes (processes) of FIFO jobs on `cores` shared cores.

    Args:
        lanes: the processes' names.
        cores: the cores they share; 0 gives every process a core of its own (no sharing).
        weights: lane -> its weight when the cores are oversubscribed (default 1 each).

    Raises:
        ValueError: negative cores, or a weight that is not positive.
    """

    def __init__(self, lanes: Sequence[str], cores: float = 0.0, weights: Mapping[str, float] | None = None):
        if cores < 0:
            raise ValueError(f"cores must be >= 0, got {cores}")
        self.cores = cores
        self.now = 0.0
        self._speed = 1.0
        self._names = list(lanes)
        self._weights = [float((weights or {}).get(name, 1.0)) for name in self._names]
        if min(self._weights, default=1.0) <= 0:
            raise ValueError(f"weights must be positive, got {weights}")
        self._queues: list[deque[list]] = [deque() for _ in lanes]  # [work left, on_done] per job, per lane
        self._index = {name: i for i, name in enumerate(self._names)}
        self._active: tuple[int, ...] = ()  # the lanes with work, in lane order
        self._rates: dict[tuple[int, ...], list[float]] = {}  # each lane's CPU seconds per second, per active set
        self._cpu = [0.0] * len(self._names)
        self._busy_seconds = [0.0] * len(self._names)

    @property
    def cpu_seconds(self) -> dict[str, float]:
        """What each process has run so far (CPU seconds)."""
        return dict(zip(self._names, self._cpu))

    @property
    def wait_seconds(self) -> dict[str, float]:
        """How long each process has had work but no core so far (seconds): its run-queue wait."""
        return {name: busy - cpu for name, busy, cpu in zip(self._names, self._busy_seconds, self._cpu)}

    @property
    def speed(self) -> float:
        """Work done per second on a core, relative to nominal (1.0)."""
        return self._speed

    @speed.setter
    def speed(self, value: float) -> None:
        """Change the machine's speed from the current time on.

        Raises:
            ValueError: a speed that is not positive.
        """
        if not value > 0:
            raise ValueError(f"speed must be positive, got {value}")
        self._speed = float(value)

    def submit(self, lane: str, work: float, on_done: Callable[[float], None] | None = None) -> list | None:
        """Queue `work` CPU seconds on `lane` at the current time; on_done(time) runs when it completes (at once,
        when the lane is idle and the work is 0). Returns the job, for waiting() and add(), or None when it
        completed at once."""
        index = self._index[lane]
        queue = self._queues[index]
        if not queue:
            if work <= DONE:
                if on_done is not None:
                    on_done(self.now)
                return None
            self._active = tuple(sorted((*self._active, index)))
        job = [work, on_done]
        queue.append(job)
        return job

    def waiting(self, lane: str, job: list) -> bool:
        """Whether `job`, submitted to `lane` and not completed, has not started yet (another job runs first)."""
        queue = self._queues[self._index[lane]]
        return bool(queue) and queue[0] is not job

    @staticmethod
    def add(job: list, work: float) -> None:
        """Give a job that has not completed `work` more CPU seconds."""
        job[0] += work

    def busy(self, lane: str) -> bool:
        return bool(self._queues[self._index[lane]])

    def rates(self) -> list[float]:
        """CPU seconds per second each lane gets now (0 for an idle one)."""
        rates = self._rates.get(self._active)
        if rates is None:
            rates = self._rates[self._active] = self._share(list(self._active))
        return rates

    def _share(self, busy: list[int]) -> list[float]:
        rates = [0.0] * len(self._queues)
        left = float(self.cores) if self.cores else math.inf
        while busy:
            total = sum(self._weights[i] for i in busy)
            capped = [i for i in busy if left * self._weights[i] / total >= 1.0]
            for i in capped or busy:
                rates[i] = 1.0 if capped else left * self._weights[i] / total
            left -= len(capped)
            busy = [i for i in busy if i not in capped] if capped else []
        return rates

    def next_event(self) -> float:
        """When the next job completes, if nothing is submitted before (math.inf when every lane is idle)."""
        if not self._active:
            return math.inf
        rates, queues = self.rates(), self._queues
        return self.now + min(queues[i][0][0] / rates[i] for i in self._active) / self._speed

    def advance(self, until: float) -> None:
        """Run the processes up to `until`, completing jobs in time order (lanes in their given order at a tie).

        Raises:
            ValueError: `until` is before the current time.
        """
        if until < self.now:
            raise ValueError(f"cannot go back in time from {self.now} to {until}")
        queues = self._queues
        while self._active and (at := self.next_event()) <= until:
            self._run(at)
            for i in self._active:
                queue = queues[i]
                if queue and queue[0][0] <= DONE:
                    _, on_done = queue.popleft()
                    if not queue:
                        self._active = tuple(j for j in self._active if j != i)
                    if on_done is not None:
                        on_done(at)
        self._run(until)

    def _run(self, until: float) -> None:
        elapsed = until - self.now
        if elapsed > 0 and self._active:
            rates, queues, cpu, busy = self.rates(), self._queues, self._cpu, self._busy_seconds
            for i in self._active:
                on_core = rates[i] * elapsed
                queues[i][0][0] -= on_core * self._speed
                cpu[i] += on_core
                busy[i] += elapsed
        self.now = until
