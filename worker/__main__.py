"""`python -m worker --config JSON`: the worker process (started by the launcher)."""

import logging
import sys
import time
import traceback

import zmq

from common.ipc import Channel
from common.messages import PlanMessage, Shutdown, WorkerFailed, WorkerReady
from common.process import HeartbeatSender, child_main_args, report_ready
from worker.model_loader import UnsupportedModelError
from worker.worker import ModelRunner

log = logging.getLogger("shuttle.worker")


def main() -> None:
    config = child_main_args("worker")
    ctx = zmq.Context.instance()
    plans: Channel[PlanMessage] = Channel(ctx, zmq.PULL, config.ipc.plans, bind=False, recv_type=PlanMessage,
                                          curve=config.ipc.curve)
    results = Channel(ctx, zmq.PUSH, config.ipc.results, bind=False, curve=config.ipc.curve)
    try:
        runner = ModelRunner(config)
    except UnsupportedModelError as exc:  # a clear refusal, not a traceback; the launcher exits with status 2
        log.error("cannot serve this model: %s", exc)
        sys.exit(2)
    kv = runner.kv_cache
    results.send(WorkerReady(0, kv.num_blocks, kv.bytes_per_token, runner.weight_bytes))
    report_ready(config, "worker", num_kv_blocks=kv.num_blocks)
    # Issue 9: a thread, so a long forward pass does not look like a hang; a frozen process (SIGSTOP) stops it
    # too. A step that never returns is the scheduler's step watchdog's to notice.
    HeartbeatSender(config, "worker").start_thread()
    while True:
        plan = plans.recv()
        if isinstance(plan, Shutdown):
            break
        try:
            result = runner.execute(plan)
        except Exception as exc:  # one bad step fails its requests, never the process
            log.error("step %d failed:\n%s", plan.step_id, traceback.format_exc())
            results.send(WorkerFailed(plan.step_id, f"{type(exc).__name__}: {exc}"))
            continue
        if config.debug_step_delay:
            time.sleep(config.debug_step_delay)
        results.send(result)


if __name__ == "__main__":
    main()
