"""The worker's step loop: receive a StepPlan, run it, send its result, until Shutdown."""

from __future__ import annotations

import logging
import sys
import time
import traceback

from shuttle.common.ipc import Channel
from shuttle.common.messages import CompileGrammars, PlanMessage, Shutdown, WorkerFailed

log = logging.getLogger("shuttle.worker")

# Test hook, read from the environment (not the config) so that no serving configuration carries it: seconds the
# worker sleeps after every step, so that end-to-end tests can keep requests in flight on a tiny model.
STEP_DELAY_ENV = "SHUTTLE_DEBUG_STEP_DELAY"
COMPILE_POLL_MS = 2  # how often an idle worker looks for finished grammar compiles while any runs


class WorkerLoop:
    """Runs each StepPlan that arrives and sends its result (rank 0 answers for a tensor-parallel group).

    A step that raises fails its requests (WorkerFailed), never the process, unless the rank is part of a group
    (then it exits 1: the ranks' collectives no longer pair up). A malformed message is skipped.

    Args:
        plans: the scheduler's plans to this rank. results: where rank 0 sends StepResult / WorkerFailed.
        runner: has `execute(plan) -> StepResult` (worker.worker.ModelRunner).
        parallel: has `enabled` and `is_driver` (worker.parallel.ParallelGroup).
        step_delay: seconds slept after each step (the SHUTTLE_DEBUG_STEP_DELAY test hook; 0 in serving).
    """

    def __init__(self, plans: Channel[PlanMessage], results: Channel, runner, parallel, rank: int,
                 step_delay: float = 0.0):
        self.plans, self.results, self.runner, self.parallel = plans, results, runner, parallel
        self.rank, self.step_delay = rank, step_delay

    def run(self) -> None:
        """Serve plans until Shutdown. Raises SystemExit(1) when a tensor-parallel rank's step fails.

        Grammar compiles (CompileGrammars, rank 0 only) run on the compiler's own thread; their answers go out
        after each step, and while compiles run an idle worker polls for them every COMPILE_POLL_MS."""
        grammars = getattr(self.runner, "grammars", None)
        while True:
            if grammars is not None and grammars.has_pending:
                self._report_grammars(grammars)
                if not self.plans.poll(COMPILE_POLL_MS):
                    continue
            plan = self.plans.recv()
            if plan is None:
                continue  # malformed: counted and logged by the channel
            if isinstance(plan, Shutdown):
                return
            if isinstance(plan, CompileGrammars):
                if grammars is not None:
                    grammars.submit(plan.specs, plan.evict)
                continue
            self._run_step(plan)

    def _report_grammars(self, grammars) -> None:
        answered = grammars.take_finished()
        if answered is not None:
            self.results.send(answered)

    def _run_step(self, plan) -> None:
        try:
            result = self.runner.execute(plan)
        except Exception as exc:  # one bad step fails its requests, never the process (unless tensor parallel)
            log.error("step %d failed:\n%s", plan.step_id, traceback.format_exc())
            if self.parallel.enabled:
                # The ranks' collectives may no longer pair up (one rank raised where the others went on): exit, so
                # that the launcher restarts the engine and every in-flight request ends with an error.
                log.error("rank %d: a failed step leaves the tensor-parallel group out of step; exiting", self.rank)
                sys.exit(1)
            self.results.send(WorkerFailed(step_id=plan.step_id, message=f"{type(exc).__name__}: {exc}"))
            return
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.parallel.is_driver:
            self.results.send(result)
