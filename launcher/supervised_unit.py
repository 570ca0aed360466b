"""One supervised unit of processes: the frontend, or one serving group's engine (scheduler + worker ranks).

A unit's processes start, fail and restart together; launcher/launcher.py owns the units and the policy around them
(backoff, bounded restarts, telling the frontend), this module only what one unit is and how it starts and stops.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from shuttle.common.config import DEVICE_ENV, DP_GROUP_ENV, TP_RANK_ENV, ShuttleConfig
from shuttle.common.cpu_threads import CorePlan, other_env, pin, worker_env
from shuttle.common.devices import device_type
from shuttle.common.messages import ControlMessage, Heartbeat, ProcessReady
from shuttle.common.process import LAST_WORDS_SIGNAL, die_with_parent, parent_death_signal
from shuttle.launcher.ports import free_listen_ports
from shuttle.launcher.processes import FailedProcess, Process, process_end
from shuttle.launcher.ray_backend import RayUnavailable

if TYPE_CHECKING:
    from shuttle.launcher.ray_backend import RayPlacer

RESTART_RESET_S = 60.0  # a unit that served this long after a restart starts counting its failures afresh
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 10.0

FRONTEND = ("frontend",)


def engine_roles(tensor_parallel_size: int) -> tuple[str, ...]:
    """The engine's processes: worker rank 0 is "worker" (as with one rank), rank r > 0 is "worker{r}"."""
    return ("worker", *(f"worker{rank}" for rank in range(1, tensor_parallel_size)), "scheduler")


def worker_rank(role: str) -> int | None:
    """The tensor-parallel rank of an engine role ("worker" -> 0, "worker3" -> 3), None for other roles."""
    if role == "worker":
        return 0
    if role.startswith("worker") and role[len("worker"):].isdigit():
        return int(role[len("worker"):])
    return None



def _before_exec(cores: tuple[int, ...], parent_gone: int = signal.SIGKILL) -> None:
    """In the child between fork and exec: be sent `parent_gone` when the launcher dies (common/process.py
    parent_death_signal), and bind to `cores` before Python, torch or OpenMP start a thread (every thread they start
    inherits it)."""
    die_with_parent(parent_gone)
    pin(cores)


def free_tcp_endpoints(n: int, host: str = "127.0.0.1") -> list[str]:
    """`n` tcp:// endpoints on `host` (default loopback) on distinct ports free right now (launcher/ports.py)."""
    return [f"tcp://{host}:{p}" for p in free_listen_ports(n, host)]


class Unit:
    """Processes that start, fail and restart together (the engine's two, or the frontend).

    Attributes:
        ready: role -> the info its ProcessReady carried, for this incarnation.
        failures_in_a_row: restarts since the unit last served RESTART_RESET_S seconds.
    """

    def __init__(self, name: str, roles: tuple[str, ...], group: int | None = None, cores: CorePlan | None = None,
                 placer: RayPlacer | None = None):
        self.name = name
        self.placer = placer  # --distributed-executor-backend ray: the worker ranks run on Ray's nodes
        self.roles = roles
        self.group = group  # the serving group's index (None: the frontend)
        self.cores = cores  # each process's cores and the workers' threads (None: inherited, as the launcher's)
        self.procs: dict[str, Process] = {}
        self.ready: dict[str, dict] = {}
        self.heartbeats: dict[str, float] = {}
        self.started_at = 0.0
        self.serving_since: float | None = None
        self.failures_in_a_row = 0
        self.restart_at: float | None = None
        self.start_durations: list[float] = []  # seconds from start to ready, most recent last
        self.ready_announced = True  # False from a failure until the restarted unit is ready

    def start(self, config: ShuttleConfig, env: dict[str, str]) -> None:
        parallel = config.parallel
        self.ready, self.heartbeats, self.restart_at = {}, {}, None
        self.started_at, self.serving_since = time.monotonic(), None
        actors: list = []
        if self.placer is not None and self.group is not None:
            try:
                actors = self.placer.place(self.group, config)
                if parallel.tensor_parallel_size > 1:  # the rendezvous is on rank 0's node
                    address, port = self.placer.rendezvous(actors[0])
                    config = dataclasses.replace(config, parallel=dataclasses.replace(
                        parallel, master_addr=address, master_port=port))
            except RayUnavailable as exc:  # the group is not placed: a failed start, retried with the backoff
                self.procs = {"worker": FailedProcess(str(exc))}
                return
        elif parallel.tensor_parallel_size > 1:
            # A fresh rendezvous port for each start (the previous incarnation's may still be held by a dying rank);
            # a given --master-port is group 0's, and group g rendezvouses on the port g above it.
            port = parallel.master_port + (self.group or 0) if parallel.master_port else \
                int(free_tcp_endpoints(1)[0].rsplit(":", 1)[1])
            config = dataclasses.replace(config, parallel=dataclasses.replace(parallel, master_port=port))
        payload = config.to_json()
        self.procs = {}
        for role in self.roles:
            child_env = dict(env)
            if role != "frontend":
                child_env.pop("SHUTTLE_API_KEY", None)
            rank = worker_rank(role)
            if self.group is not None:  # an engine process: a worker's device, and every line it logs, name it
                child_env[DP_GROUP_ENV] = str(self.group)
            if rank is not None:  # every rank runs `python -m shuttle.worker`; its rank travels like torchrun's RANK
                child_env[TP_RANK_ENV] = str(rank)
            module = "shuttle." + ("worker" if rank is not None else role)
            argv = [sys.executable, "-m", module, "--config", payload]
            if actors and rank is not None and self.placer is not None:
                threads = int(self.placer.bundle(config)["CPU"])
                # Ray hands the actor its one GPU as the only visible device
                child_env[DEVICE_ENV] = "cpu" if device_type(config.worker.device) == "cpu" else "cuda:0"
                try:
                    self.procs[role] = self.placer.start(actors[rank], argv, worker_env(child_env, threads))
                except RayUnavailable as exc:
                    self.procs[role] = FailedProcess(str(exc))
                continue
            child_env, cores = self._placement(role, rank, parallel.tensor_parallel_size, child_env)
            self.procs[role] = subprocess.Popen(
                argv, env=child_env, preexec_fn=functools.partial(_before_exec, cores, parent_death_signal(role)))

    def _placement(self, role: str, rank: int | None, tensor_parallel_size: int,
                   env: dict[str, str]) -> tuple[dict[str, str], tuple[int, ...]]:
        """A process's environment (thread counts, OpenMP wait policy) and the cores to pin it to (() = none)."""
        if self.cores is None:
            return env, ()
        if rank is None:
            return other_env(env), self.cores.others if self.cores.pinned else ()
        index = (self.group or 0) * tensor_parallel_size + rank
        bind = self.cores.binds(index, env)
        pin_to = self.cores.workers[index] if self.cores.pinned or bind else ()
        return worker_env(env, self.cores.threads[index], bind), pin_to

    @property
    def engine_group(self) -> int:
        """The serving group of an engine's unit (the frontend's serves none)."""
        if self.group is None:
            raise ValueError(f"the {self.name} is no serving group's engine")
        return self.group

    @property
    def is_ready(self) -> bool:
        return bool(self.procs) and all(role in self.ready for role in self.roles)

    def on_control(self, msg: ControlMessage) -> None:
        proc = self.procs.get(msg.name)
        if proc is None or proc.pid != msg.pid:
            return  # from an earlier incarnation
        if isinstance(msg, ProcessReady):
            self.ready[msg.name] = msg.info
            self.heartbeats[msg.name] = time.monotonic()
            if self.is_ready:
                self.serving_since = time.monotonic()
                self.start_durations = (self.start_durations + [self.serving_since - self.started_at])[-3:]
        elif isinstance(msg, Heartbeat):
            self.heartbeats[msg.name] = time.monotonic()

    def paused(self, seconds: float) -> None:
        """The launcher did not run for `seconds` (the whole process group was stopped, the machine paused): that
        time is not its children's silence."""
        self.heartbeats = {role: last + seconds for role, last in self.heartbeats.items()}

    def failure(self, heartbeat_timeout: float) -> str | None:
        """Why the unit must go (a process died, or a ready one fell silent), else None."""
        for role, proc in self.procs.items():
            if proc.poll() is not None:
                return process_end(role, proc)
        if heartbeat_timeout > 0:
            now = time.monotonic()
            for role, last in self.heartbeats.items():
                if now - last > heartbeat_timeout:
                    return f"{role} (pid {self.procs[role].pid}) sent no heartbeat for {now - last:.0f} s"
        return None

    def kill(self, last_words_s: float = 0.0) -> None:
        """SIGKILL every process of the unit (a stopped or hung one too) and reap it. With `last_words_s`, each
        live process first gets LAST_WORDS_SIGNAL and SIGCONT (in case it was stopped) and that many seconds to exit on
        its own: the frontend ends its open streams with an error then (frontend/last_words.py)."""
        if last_words_s > 0:
            live = [proc for proc in self.procs.values() if proc.poll() is None]
            for proc in live:
                proc.send_signal(LAST_WORDS_SIGNAL)
                proc.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + last_words_s
            for proc in live:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
                except subprocess.TimeoutExpired:
                    pass
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs.values():
            proc.wait()
        self.ready, self.heartbeats = {}, {}
        self._release()

    def _release(self) -> None:
        """Give a Ray-placed group's bundles back (its processes are gone)."""
        if self.placer is not None and self.group is not None:
            self.placer.release(self.group)

    def expected_start_s(self) -> float:
        """The next start-up is expected to take as long as the last one (the first start-up, then each restart:
        the same machine under about the same load, with warm caches after the first). No margin on top: a client
        told too short a wait is refused at once by the frontend and told again, one told too long sleeps while
        the engine serves (frontend/engine/backpressure.py). 10 s before any start was measured."""
        return self.start_durations[-1] if self.start_durations else 10.0

    def next_backoff(self) -> float:
        return min(BACKOFF_FIRST_S * 2 ** self.failures_in_a_row, BACKOFF_MAX_S)

    def pids(self, suffix: str = "") -> dict[str, int]:
        return {role + suffix: proc.pid for role, proc in self.procs.items()}
