"""`python -m shuttle.worker --config JSON`: a worker process (started by the launcher), tensor-parallel rank
$SHUTTLE_TP_RANK (default 0) of local serving group $SHUTTLE_DP_GROUP (default 0), on the device that pair owns
(worker/parallel.py local_device)."""

import logging
import os
import sys

import torch
import zmq

from shuttle.common.config import DEVICE_ENV, DP_GROUP_ENV, TP_RANK_ENV
from shuttle.common.devices import DeviceError
from shuttle.common.errors import ModelDirError
from shuttle.common.ipc import Channel
from shuttle.common.messages import PlanMessage, WorkerReady
from shuttle.common.process import HeartbeatSender, boot_id, child_main_args, report_ready
from shuttle.worker.graph_runner import GraphCaptureError
from shuttle.worker.kv_sizing import KVSizingError
from shuttle.worker.loop import STEP_DELAY_ENV, WorkerLoop
from shuttle.worker.model_fetch import fetch_missing_model
from shuttle.worker.model_loader import UnsupportedModelError
from shuttle.worker.parallel import join_group, local_device
from shuttle.worker.worker import ModelRunner

log = logging.getLogger("shuttle.worker")


def main() -> None:
    config = child_main_args("worker")
    rank = int(os.environ.get(TP_RANK_ENV, "0"))  # set by the launcher, like torchrun's RANK
    group = int(os.environ.get(DP_GROUP_ENV, "0"))
    name = "worker" if rank == 0 else f"worker{rank}"  # the launcher's name for this rank's process
    ctx: zmq.Context = zmq.Context.instance()
    plans: Channel[PlanMessage] = Channel(ctx, zmq.PULL, config.ipc.plans_of(rank), bind=False,
                                          recv_type=PlanMessage, curve=config.ipc.curve)
    results: Channel[None] = Channel(ctx, zmq.PUSH, config.ipc.results, bind=False, curve=config.ipc.curve)  # send-only
    try:
        if config.worker.device == "cpu":
            # a CPU worker on a GPU machine owns no GPU (transformers' tensor-parallel mesh follows the accelerator)
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        fetch_missing_model(config.model.model_dir)  # a Ray rank on a node that lacks it
        own = os.environ.get(DEVICE_ENV)  # named by the launcher (a Ray rank), else found from group and rank
        device = torch.device(own) if own else local_device(config.worker.device, group, rank,
                                                             config.parallel.tensor_parallel_size)
        hf_config = config.model.hf_config()  # with --hf-overrides, as the launcher checked it
        parallel = join_group(config.parallel, rank, config.model.model_dir, hf_config, device)
        runner = ModelRunner(config, device, parallel=parallel)
    except (UnsupportedModelError, ModelDirError) as exc:  # a clear refusal, not a traceback; the launcher exits 2
        log.error("cannot serve this model: %s", exc)
        sys.exit(2)
    except (DeviceError, KVSizingError, GraphCaptureError) as exc:
        log.error("cannot start: %s", exc)
        sys.exit(2)
    kv = runner.kv_cache
    # a draft model's KV shares the blocks: bytes/token counts both models', as the budget did
    results.send(WorkerReady(rank=rank, num_kv_blocks=kv.num_blocks, kv_bytes_per_token=runner.kv_bytes_per_token,
                             weight_bytes=runner.weight_bytes, device=str(runner.device), dtype=runner.dtype_label,
                             attention_backend=runner.backend.name,
                             activation_peak_bytes=runner.activation_peak_bytes, kv_budget=runner.kv_budget,
                             boot_id=boot_id(), pid=os.getpid()))
    report_ready(config, name, num_kv_blocks=kv.num_blocks)
    # A thread, so a long forward pass does not look like a hang; a frozen process (SIGSTOP) stops it
    # too. A step that never returns is the scheduler's step watchdog's to notice.
    HeartbeatSender(config, name).start_thread()
    step_delay = float(os.environ.get(STEP_DELAY_ENV, "0"))
    WorkerLoop(plans, results, runner, parallel, rank, step_delay).run()


if __name__ == "__main__":
    main()
