"""A real SchedulerLoop over ZeroMQ in the test's own process, with the test holding the other ends of its sockets:
the worker's results (PUSH), a frontend (DEALER) and the worker's plans (PULL). Everything is closed on exit."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import zmq

from shuttle.common.config import IpcConfig, ShuttleConfig
from shuttle.common.ipc import Channel
from shuttle.common.messages import PlanMessage
from shuttle.common.model_config import ModelConfig
from shuttle.scheduler.loop import SchedulerLoop
from tests.server import MODEL_DIR


@dataclass
class SchedulerPeers:
    loop: SchedulerLoop
    results: zmq.Socket  # as the worker: its StepResults and WorkerReady go here
    frontend: zmq.Socket  # as a frontend: Submits and Aborts
    plans: Channel[PlanMessage]  # as the worker: the plans the loop sends


@contextlib.contextmanager
def scheduler_with_peers(directory: Path, **config) -> Iterator[SchedulerPeers]:
    """A SchedulerLoop on ipc sockets in `directory`, on the test model, `config` passed to ShuttleConfig."""
    ipc = IpcConfig.in_directory(str(directory))
    ctx = zmq.Context()
    loop = SchedulerLoop(ShuttleConfig(ModelConfig.from_dir(MODEL_DIR), ipc, **config), ctx)
    results, frontend = ctx.socket(zmq.PUSH), ctx.socket(zmq.DEALER)
    results.connect(ipc.results)
    frontend.connect(ipc.requests)
    plans = Channel(ctx, zmq.PULL, ipc.plans, bind=False, recv_type=PlanMessage)
    try:
        yield SchedulerPeers(loop, results, frontend, plans)
    finally:
        for sock in (results, frontend):
            sock.close(linger=0)
        for channel in (plans, loop.results, loop.frontends, *loop.plans):
            channel.close()
        ctx.term()
