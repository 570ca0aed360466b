"""`python -m worker --config JSON`: a worker process (started by the launcher), tensor-parallel rank
$SHUTTLE_TP_RANK (default 0) of its group."""

import json
import logging
import os
import sys
from pathlib import Path

import zmq

from common.config import TP_RANK_ENV
from common.errors import ModelDirError
from common.ipc import Channel
from common.messages import PlanMessage, WorkerReady
from common.process import HeartbeatSender, child_main_args, report_ready
from worker.loop import STEP_DELAY_ENV, WorkerLoop
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
    step_delay = float(os.environ.get(STEP_DELAY_ENV, "0"))
    WorkerLoop(plans, results, runner, parallel, rank, step_delay).run()


if __name__ == "__main__":
    main()
