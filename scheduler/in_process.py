"""The scheduler loop without sockets: the Scheduler and a model runner in one process, for tests, checks and
benchmarks that need the real engine but no processes (scheduler/loop.py is the served loop)."""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol

from shuttle.common.messages import RequestOutput, StepPlan, StepResult
from shuttle.scheduler.scheduler import Scheduler


class StepRunner(Protocol):
    """What runs a plan: worker.worker.ModelRunner, or a fake that fabricates results."""

    def execute(self, plan: StepPlan) -> StepResult: ...


def drive(scheduler: Scheduler, runner: StepRunner, on_outputs: Callable[[list[RequestOutput]], None],
          client: bytes = b"c", max_in_flight: int = 2, check_blocks: bool = False) -> None:
    """Run until the scheduler has no work: up to `max_in_flight` planned steps not yet settled (2 is the served
    loop's overlapped scheduling, 1 plans, waits and settles); the runner executes each plan when it is planned, in
    order, as the worker process does. Constrained requests need a runner with `grammars` (ModelRunner's
    GrammarCompiler); their grammars are compiled as they arrive.

    Args:
        on_outputs: called after every turn with the outputs for `client` (possibly none).
        check_blocks: check the block pool's invariants after every turn (tests).
    """
    in_flight: deque = deque()
    while scheduler.has_work or in_flight or scheduler.grammars.num_held:
        specs, evict = scheduler.grammars.take_requests(), scheduler.grammars.take_evictions()
        if specs or evict:  # the served worker compiles on a thread of its own; here the answer is awaited
            scheduler.on_grammars_compiled(runner.grammars.compile_now(specs, evict))
        planned = False
        if len(in_flight) < max_in_flight and scheduler.has_work:
            step = scheduler.schedule()
            if not step.is_empty:
                in_flight.append((step, runner.execute(step.plan)))
                planned = True
        if in_flight and (not planned or len(in_flight) >= max_in_flight):
            scheduler.update_from_output(*in_flight.popleft())
        if check_blocks:
            scheduler.kv.pool.check_invariants()
        on_outputs(scheduler.take_outputs().get(client, []))
