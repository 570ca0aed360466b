"""Start-up shared by every child process: config from the command line, logging, signals, readiness, liveness."""

from __future__ import annotations

import argparse
import ctypes
import gc
import logging
import os
import resource
import signal
import sys
import threading
import time

import zmq

from shuttle.common.config import DP_GROUP_ENV, LOG_LEVEL_ENV, ShuttleConfig
from shuttle.common.ipc import Channel
from shuttle.common.log_format import configure_logging
from shuttle.common.messages import Heartbeat, ProcessReady

log = logging.getLogger("shuttle")

HEARTBEAT_INTERVAL_S = 1.0
# A watcher (the scheduler's step loop, the launcher's supervision loop) looks at its clocks at least this often; a
# longer gap between two looks is time the watcher itself did not run (the machine or the process group was paused,
# or starved): silence it was not there to hear counts only this much of that gap.
MAX_LOOK_GAP_S = 2.0
# When the launcher replaces a live frontend: this signal (then SIGCONT), this long to end its open streams with an
# error itself (frontend/last_words.py), then SIGKILL.
LAST_WORDS_SIGNAL = signal.SIGUSR2
LAST_WORDS_S = 2.0
# The launcher asks its frontend, or under `shuttle engine` its scheduler, to drain with this signal (children ignore
# SIGTERM: see child_main_args); the frontend takes a second one as "end the drain now".
DRAIN_SIGNAL = signal.SIGUSR1
# The frontend's parent-death signal (the engine's processes get SIGKILL): its launcher is gone (killed, OOM-killed,
# aborted by Ray's client when its cluster went away) and with it the engine and all supervision; the frontend ends
# every request in flight with an error and exits, instead of dying with all of them unanswered.
PARENT_GONE_SIGNAL = signal.SIGHUP


def parent_death_signal(role: str) -> int:
    """The signal a launched child of `role` gets when its launcher dies: PARENT_GONE_SIGNAL for the frontend,
    SIGKILL for the engine's processes. Set twice: by the launcher between fork and exec (no gap) and by the child
    at start-up (child_main_args), which must not undo it."""
    return PARENT_GONE_SIGNAL if role == "frontend" else signal.SIGKILL
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Have Linux send `sig` to this process when the thread that started it exits (prctl PR_SET_PDEATHSIG).

    Safe as a subprocess `preexec_fn` (it runs between fork and exec, and the setting survives exec). A no-op
    off Linux. Exits at once if the parent is already gone (the race between fork and this call).
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if parent == 1 or os.getppid() != parent:
        os._exit(1)


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's open-file soft limit to its hard limit (one socket per client needs one fd each).

    Returns (old soft limit, new soft limit); children inherit the new one.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return soft, hard
    return soft, soft


def child_main_args(name: str) -> ShuttleConfig:
    """Parse `--config JSON`, set up logging, and tie this process's life to its launcher's.

    A launched child ignores SIGINT and SIGTERM: Ctrl-C reaches the whole process group, and so does SIGTERM when a
    service manager stops the group (systemd's default KillMode=control-group); the launcher alone decides the order
    of shutdown and tells each child with a signal of its own (DRAIN_SIGNAL: drain; LAST_WORDS_SIGNAL: end now;
    SIGKILL). The kernel kills a child as soon as its launcher is gone, so no child outlives it; the frontend is sent
    PARENT_GONE_SIGNAL instead, to answer what it holds first (frontend/lifecycle.py Shutdown.on_parent_gone).
    """
    parser = argparse.ArgumentParser(prog=f"python -m shuttle.{name}")
    parser.add_argument("--config", required=True, help="ShuttleConfig as JSON (written by the launcher)")
    args = parser.parse_args()
    group = os.environ.get(DP_GROUP_ENV)  # set for an engine's processes: their lines name their serving group
    configure_logging(name, os.environ.get(LOG_LEVEL_ENV, "INFO"), int(group) if group is not None else None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent_death_signal(name))
    old, new = raise_fd_limit()
    if new != old:
        log.info("raised the open-file limit from %d to %d", old, new)
    return ShuttleConfig.from_json(args.config)


def report_ready(config: ShuttleConfig, name: str, **info: int | float | str) -> None:
    """Tell the launcher this process is up (its control socket; no-op in the launcher's absence). Start-up is
    over then, so its heap is frozen first (freeze_startup_heap)."""
    freeze_startup_heap()
    ctx: zmq.Context = zmq.Context.instance()
    channel: Channel[None] = Channel(ctx, zmq.PUSH, config.ipc.control, bind=False,
                                     curve=config.ipc.curve)  # send-only; tcp:// under Ray
    channel.socket.setsockopt(zmq.LINGER, 2000)
    channel.send(ProcessReady(name=name, pid=os.getpid(), info=dict(info)))
    channel.socket.close(linger=2000)


def freeze_startup_heap() -> None:
    """Collect garbage once, then move every object still alive into the collector's permanent generation
    (gc.freeze), so that the oldest generation's collections while serving no longer walk the modules, the
    tokenizer and the model objects built at start-up, which stay alive to the end anyway. Each such collection
    stops the process for tens of milliseconds on a busy frontend (two of 43 and 74 ms in 20 s of stories260K at 70
    req/s), each stalling every stream and arrival of that moment (vLLM's engine core freezes its start-up heap for
    the same reason)."""
    gc.collect()
    gc.freeze()


class HeartbeatSender:
    """Tells the launcher this process is alive, at most once per HEARTBEAT_INTERVAL_S.

    Call `beat()` from the loop whose progress proves liveness (the scheduler's step loop), or
    `start_thread()` where a long computation may block that loop (the worker's forward pass: its step
    watchdog is the scheduler's business; the heartbeat only proves the process runs).
    """

    def __init__(self, config: ShuttleConfig, name: str):
        self._endpoint = config.ipc.control
        self._curve = config.ipc.curve
        self._message = Heartbeat(name=name, pid=os.getpid())
        self._channel: Channel | None = None
        self._last = 0.0

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last < HEARTBEAT_INTERVAL_S:
            return
        self._last = now
        if self._channel is None:  # made on first use, in the thread that uses it (sockets are not thread-safe)
            self._channel = Channel(zmq.Context.instance(), zmq.PUSH, self._endpoint, bind=False, curve=self._curve)
        self._channel.try_send(self._message)  # False: no launcher listening (a process driven alone by a test)

    def start_thread(self) -> None:
        def run() -> None:
            while True:
                self.beat()
                time.sleep(HEARTBEAT_INTERVAL_S / 4)

        threading.Thread(target=run, name="heartbeat", daemon=True).start()


def unwatched(gap: float) -> float:
    """The part of a gap between a watcher's two looks (seconds) that it was not running for."""
    return max(0.0, gap - MAX_LOOK_GAP_S)


def boot_id() -> str:
    """This host's boot id (Linux's /proc/sys/kernel/random/boot_id); "" where there is none. Two processes that
    read the same one share a kernel, so one can read the other's /proc entries."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
