"""`python -m worker --config JSON`: a worker process (started by the launcher), tensor-parallel rank
$SHUTTLE_TP_RANK (default 0) of its group."""

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path

import zmq

from common.config import TP_RANK_ENV
from common.errors import ModelDirError
from common.ipc import Channel
from common.messages import PlanMessage, Shutdown, WorkerFailed, WorkerReady
from common.process import HeartbeatSender, child_main_args, report_ready
from worker.model_loader import UnsupportedModelError
from worker.parallel import join_group
from worker.worker import ModelRunner

log = logging.getLogger("shuttle.worker")

def main() -> None:
    config = child_main_args("worker")
    rank = int(os.environ.get(TP_RANK_ENV, "0"))  # set by the launcher, like torchrun's RANK
    name = "worker" if rank == 0 else f"worker{rank}"  # the launcher's name for this rank's process
    ctx = zmq.Context.instance()
    plans: Channel[PlanMessage] = Channel(ctx, zmq.PULL, config.ipc.plans_of(rank), bind=False,
                                          recv_type=PlanMessage, curve=config.ipc.curve)
    results = Channel(ctx, zmq.PUSH, config.ipc.results, bind=False, curve=config.ipc.curve)
    try:
        hf_config = json.loads((Path(config.model.model_dir) / "config.json").read_text())
        parallel = join_group(config.parallel, rank, config.model.model_dir, hf_config)
        runner = ModelRunner(config, parallel=parallel)
    except (UnsupportedModelError, ModelDirError) as exc:  # a clear refusal, not a traceback; the launcher exits 2
        log.error("cannot serve this model: %s", exc)
        sys.exit(2)
    kv = runner.kv_cache
    results.send(WorkerReady(rank, kv.num_blocks, kv.bytes_per_token, runner.weight_bytes))
    report_ready(config, name, num_kv_blocks=kv.num_blocks)
    # Issue 9: a thread, so a long forward pass does not look like a hang; a frozen process (SIGSTOP) stops it
    # too. A step that never returns is the scheduler's step watchdog's to notice.
    HeartbeatSender(config, name).start_thread()
    serve_plans(plans, results, runner, parallel, rank, config.debug_step_delay)


def serve_plans(plans: Channel[PlanMessage], results: Channel, runner, parallel, rank: int,
                step_delay: float = 0.0) -> None:
    """Run each StepPlan that arrives and send its result (rank 0 answers for a tensor-parallel group), until
    Shutdown. A step that raises fails its requests (WorkerFailed), never the process, unless the rank is part of
    a group (then it exits 1: the ranks' collectives no longer pair up). A malformed message is skipped.

    Args:
        runner: has `execute(plan) -> StepResult` (worker.worker.ModelRunner).
        parallel: has `enabled` and `is_driver` (worker.parallel).
        step_delay: seconds slept after each step (--debug-step-delay, for tests).
    """
    while True:
        plan = plans.recv()
        if plan is None:
            continue  # malformed: counted and logged by the channel
        if isinstance(plan, Shutdown):
            break
        try:
            result = runner.execute(plan)
        except Exception as exc:  # one bad step fails its requests, never the process (unless tensor parallel)
            log.error("step %d failed:\n%s", plan.step_id, traceback.format_exc())
            if parallel.enabled:
                # The ranks' collectives may no longer pair up (one rank raised where the others went on): exit,
                # so that the launcher restarts the engine and every in-flight request ends with an error.
                log.error("rank %d: a failed step leaves the tensor-parallel group out of step; exiting", rank)
                sys.exit(1)
            results.send(WorkerFailed(plan.step_id, f"{type(exc).__name__}: {exc}"))
            continue
        if step_delay:
            time.sleep(step_delay)
        if parallel.is_driver:  # rank 0 answers for the group
            results.send(result)


if __name__ == "__main__":
    main()
