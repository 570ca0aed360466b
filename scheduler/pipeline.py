"""The step pipeline: plan step N+1 while step N runs, settle results in the order planned.

One set of rules for every loop that drives the Scheduler: the served loop (scheduler/loop.py, over sockets), the
in-process engine (scheduler/in_process.py, a model runner called directly) and the simulator (capacity/simulator.py,
in virtual time). Each loop decides how a plan reaches its runner and when a result comes back; the pipeline decides
when a step may be planned and when the oldest one must be settled. The overlap is vLLM v1's async scheduling: with
two steps in flight, the scheduler books step N+1's tokens before step N's sampled tokens are known, and settles N
once its result returns (scheduler/scheduler.py books at schedule time and settles on results).
"""

from __future__ import annotations

import logging
from collections import deque

from shuttle.common.messages import StepResult
from shuttle.scheduler.scheduled_step import ScheduledStep
from shuttle.scheduler.scheduler import Scheduler

log = logging.getLogger("shuttle.scheduler")


class StepPipeline:
    """Up to `max_in_flight` planned steps not yet settled, oldest first.

    Args:
        scheduler: the Scheduler whose steps are planned and settled.
        max_in_flight: 2 overlaps planning with execution (async scheduling); 1 plans, waits and settles.

    A turn of any loop is: `plan()` if `can_plan`; hand the plan to the runner; then, if `must_settle(planned)`,
    wait for the oldest step's result and `settle(result)`.
    """

    def __init__(self, scheduler: Scheduler, max_in_flight: int):
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight must be at least 1, got {max_in_flight}")
        self.scheduler = scheduler
        if max_in_flight > 1 and scheduler.speculation is not None:
            # the next step's booking depends on how many drafts this one accepts: plan, wait and settle
            log.info("--speculative-config: steps are not overlapped (async scheduling is off)")
            max_in_flight = 1
        self.max_in_flight = max_in_flight
        self.in_flight: deque[ScheduledStep] = deque()

    @property
    def can_plan(self) -> bool:
        """A step may be planned: a slot is free and the scheduler has work."""
        return len(self.in_flight) < self.max_in_flight and self.scheduler.has_work

    @property
    def oldest(self) -> ScheduledStep:
        """The step settled next. Raises IndexError when none is in flight."""
        return self.in_flight[0]

    def plan(self) -> ScheduledStep | None:
        """Plan the next step and count it in flight; None (and nothing in flight added) when nothing can run."""
        step = self.scheduler.schedule()
        if step.is_empty:
            return None
        self.in_flight.append(step)
        return step

    def must_settle(self, planned: bool) -> bool:
        """Whether this turn waits for the oldest step: when nothing was planned (no new work to overlap with) or
        when every slot is taken."""
        return bool(self.in_flight) and (not planned or len(self.in_flight) >= self.max_in_flight)

    def settle(self, result: StepResult) -> ScheduledStep:
        """Apply the oldest step's result to the scheduler; returns that step."""
        step = self.in_flight.popleft()
        self.scheduler.update_from_output(step, result)
        return step

    def fail_oldest(self, status: int, message: str) -> ScheduledStep:
        """End the oldest step's requests with an error (its runner failed it); returns that step."""
        step = self.in_flight.popleft()
        self.scheduler.fail_step(step, status, message)
        return step
