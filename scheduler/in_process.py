"""The scheduler loop without sockets: the Scheduler and a model runner in one process, for tests, checks and
benchmarks that need the real engine but no processes (scheduler/loop.py is the served loop; both turn the same
StepPipeline of scheduler/pipeline.py)."""

from __future__ import annotations

from collections import deque
from typing import Callable, Protocol, Sequence

from shuttle.common.messages import GrammarsCompiled, RequestOutput, StepPlan, StepResult
from shuttle.common.sampling import StructuredOutput
from shuttle.scheduler.pipeline import StepPipeline
from shuttle.scheduler.scheduler import Scheduler


class GrammarCompiling(Protocol):
    """What compiles constrained requests' grammars at once: worker/grammar.py's GrammarCompiler."""

    def compile_now(self, specs: list[StructuredOutput], evict: Sequence[str] = ()) -> GrammarsCompiled: ...


class StepRunner(Protocol):
    """What runs a plan: worker.worker.ModelRunner, or a fake that fabricates results. `grammars` is needed only
    for constrained requests (None: the runner has none)."""

    @property  # read-only, so that a runner's own compiler type (GrammarCompiler) conforms
    def grammars(self) -> GrammarCompiling | None: ...

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
    pipeline = StepPipeline(scheduler, max_in_flight)
    results: deque[StepResult] = deque()  # the runner's results of the steps in flight, in the same order
    while scheduler.has_work or pipeline.in_flight or scheduler.grammars.num_held:
        specs, evict = scheduler.grammars.take_requests(), scheduler.grammars.take_evictions()
        if specs or evict:  # the served worker compiles on a thread of its own; here the answer is awaited
            if runner.grammars is None:
                raise ValueError("constrained requests need a runner that compiles grammars (ModelRunner on rank 0)")
            scheduler.on_grammars_compiled(runner.grammars.compile_now(specs, evict))
        step = pipeline.plan() if pipeline.can_plan else None
        if step is not None:
            results.append(runner.execute(step.plan))
        if pipeline.must_settle(planned=step is not None):
            pipeline.settle(results.popleft())
        if check_blocks:
            scheduler.kv.pool.check_invariants()
        on_outputs(scheduler.take_outputs().get(client, []))
