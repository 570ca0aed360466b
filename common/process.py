"""Start-up shared by every child process: config from the command line, logging, signals, readiness."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

import zmq

from common.config import ShuttleConfig
from common.ipc import Channel
from common.messages import ProcessReady


def child_main_args(name: str) -> ShuttleConfig:
    """Parse `--config JSON`, set up logging, and tie this process's life to its launcher's.

    A launched child ignores SIGINT (Ctrl-C reaches the whole process group; the launcher decides the
    order of shutdown) and exits on SIGTERM or as soon as its parent is gone, so no child outlives it.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {name}")
    parser.add_argument("--config", required=True, help="ShuttleConfig as JSON (written by the launcher)")
    args = parser.parse_args()
    logging.basicConfig(level=os.environ.get("SHUTTLE_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {name} %(levelname)s %(message)s", stream=sys.stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    _exit_with_parent()
    return ShuttleConfig.from_json(args.config)


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def report_ready(config: ShuttleConfig, name: str, **info: int | float | str) -> None:
    """Tell the launcher this process is up (its control socket; no-op in the launcher's absence)."""
    ctx = zmq.Context.instance()
    channel = Channel(ctx, zmq.PUSH, config.ipc.control, bind=False)
    channel.socket.setsockopt(zmq.LINGER, 2000)
    channel.send(ProcessReady(name, os.getpid(), dict(info)))
    channel.socket.close(linger=2000)
