"""`python -m shuttle.scheduler --config JSON`: the scheduler process (started by the launcher)."""

import logging
import signal
import sys

import zmq

from shuttle.common.capacity import requests_that_fit
from shuttle.common.process import DRAIN_SIGNAL, child_main_args, report_ready
from shuttle.scheduler.liveness import EXIT_WORKER_HUNG, WorkerHung
from shuttle.scheduler.loop import SchedulerLoop

log = logging.getLogger("shuttle.scheduler")

FLUSH_LINGER_MS = 2000  # after a drain: how long the last answers may take to leave


def main() -> None:
    config = child_main_args("scheduler")
    loop = SchedulerLoop(config, zmq.Context.instance())
    signal.signal(DRAIN_SIGNAL, lambda *_: setattr(loop, "drain_requested", True))  # the loop acts on it
    worker = loop.wait_for_worker()
    cache, model = config.cache, config.model
    tokens = worker.num_kv_blocks * cache.block_size
    log.info("KV cache: %d blocks of %d tokens = %d tokens, %d bytes/token; %d requests of max_model_len %d fit; "
             "weights %.1f MiB", worker.num_kv_blocks, cache.block_size, tokens, worker.kv_bytes_per_token,
             requests_that_fit(worker.num_kv_blocks, cache.block_size, model.max_model_len), model.max_model_len,
             worker.weight_bytes / 2**20)
    if tokens < model.max_model_len:  # served as asked, but said: such a request is refused (400) when it comes
        log.warning("the KV cache holds %d tokens, fewer than max_model_len %d: a request whose prompt plus "
                    "max_tokens needs more is refused; give the cache more (--kv-cache-memory, --num-kv-blocks) or "
                    "lower --max-model-len", tokens, model.max_model_len)
    report_ready(config, "scheduler", num_kv_blocks=worker.num_kv_blocks, block_size=cache.block_size,
                 kv_tokens=tokens, kv_bytes_per_token=worker.kv_bytes_per_token, weight_bytes=worker.weight_bytes,
                 max_model_len=model.max_model_len, device=worker.device, dtype=worker.dtype,
                 attention_backend=worker.attention_backend, activation_peak_bytes=worker.activation_peak_bytes,
                 kv_budget=worker.kv_budget)
    try:
        loop.run()
    except WorkerHung as exc:  # the engine's state is lost with the worker: exit, the launcher restarts both
        log.error("%s; exiting so that the launcher restarts the engine", exc)
        sys.exit(EXIT_WORKER_HUNG)
    # drained: every request answered; those answers may still be queued in ZeroMQ, so close every socket letting
    # the frontends' linger that long (the others drop what they hold) and wait for them
    loop.frontends.socket.setsockopt(zmq.LINGER, FLUSH_LINGER_MS)
    zmq.Context.instance().destroy()


if __name__ == "__main__":
    main()
