"""Starts and supervises the serving groups and the frontend, each process its own.

A serving group is one unit: its engine (scheduler + worker, or + N worker ranks under --tensor-parallel-size N)
shares request and KV state, so its processes live, die and restart together. With --data-parallel-size M there are
M such units, each with its own sockets (the frontend's router spreads requests over them); the frontend holds the
clients' connections and is restarted alone. `shuttle engine --listen ENDPOINT` runs one group without a frontend,
for a frontend on another host. The launcher waits until every child reports ready on the control socket, prints
the URL and the KV capacity, and then watches:
- a unit whose process dies, or stops sending heartbeats for --heartbeat-timeout seconds, is killed
  (all of its processes) and started again after a backoff (0.5 s doubling up to 10 s), at most
  --max-restarts times in a row; a unit that then serves for RESTART_RESET_S seconds starts counting afresh.
  When a group's engine goes, the frontend is told at once (EngineDown naming the group): it ends that group's
  in-flight requests with one error each and routes new ones to the other groups (503 only when none serves)
  until the new scheduler answers it.
- SIGTERM or Ctrl-C drains: the frontend stops admitting, lets in-flight requests finish for up to
  --shutdown-timeout seconds, ends the rest with an error and exits; then the engine stops; exit status 0.
  A second signal ends the drain at once. Under `shuttle engine` each scheduler drains instead (DRAIN_SIGNAL):
  it refuses new requests and tells its frontends to route around it while the rest finish.
Every child dies with the launcher (Linux parent-death signal), so a killed launcher leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from urllib.parse import urlsplit

import zmq

from shuttle.common.capacity import kv_cache_bytes, requests_that_fit
from shuttle.common.config import IpcConfig, ShuttleConfig
from shuttle.common.cpu_threads import CorePlan, allowed_cores, plan_cores
from shuttle.common.devices import device_type, rank_device
from shuttle.common.ipc import CURVE_ENV, Channel, CurveKeys
from shuttle.common.log_format import launcher_line
from shuttle.common.messages import ControlMessage, EngineDown
from shuttle.common.process import DRAIN_SIGNAL, LAST_WORDS_S, raise_fd_limit, unwatched
from shuttle.launcher.processes import process_end
from shuttle.launcher.ray_backend import RayPlacer, RayProcess
from shuttle.launcher.supervised_unit import (
    FRONTEND,
    RESTART_RESET_S,
    Unit,
    engine_roles,
)

STOP_TIMEOUT_S = 4.0  # a frontend still running when the launcher stops on its own: its drain, then last words
ENGINE_DRAIN_GRACE_S = 1.0  # beyond --shutdown-timeout, for a drained scheduler to send its last answers and exit
DRAIN_EXIT_GRACE_S = 5.0  # beyond --shutdown-timeout, for the frontend to write its last answers and exit
START_TIMEOUT_S = 300.0
POLL_MS = 50


def capacity_lines(config: ShuttleConfig, cap: dict, groups: int = 1) -> list[str]:
    """The start-up lines about the KV cache and the worker, from the scheduler's ready report `cap` (num_kv_blocks,
    block_size, kv_tokens, kv_bytes_per_token, weight_bytes; from a worker that reports them: device, dtype,
    attention_backend, activation_peak_bytes, kv_budget); `shuttle plan` predicts the KV figures.

    Line 1: blocks, tokens, KV bytes, how many max_model_len requests fit, weights and (CUDA) the profiled activation
    peak. Line 2 (when the worker reports its device): the devices of every rank of the `groups` local serving
    groups, the dtype, the attention backend and how the KV cache was sized.
    """
    max_len = config.model.max_model_len
    fit = requests_that_fit(cap["num_kv_blocks"], cap["block_size"], max_len)
    kv_bytes = kv_cache_bytes(cap["num_kv_blocks"], cap["block_size"], cap["kv_bytes_per_token"])
    memory = [f"weights {_mib(cap['weight_bytes'])}"] if "weight_bytes" in cap else []
    if cap.get("activation_peak_bytes"):
        memory.append(f"activation peak {_mib(cap['activation_peak_bytes'])}")
    line = (f"KV cache {cap['num_kv_blocks']} blocks x {cap['block_size']} tokens = {cap['kv_tokens']} tokens "
            f"({cap['kv_bytes_per_token']} bytes/token) in {_mib(kv_bytes)}; {fit} requests of max_model_len "
            f"{max_len} fit")
    lines = [line + (f"; {', '.join(memory)}" if memory else "")]
    if cap.get("device"):
        lines.append(f"worker on {device_span(config, cap['device'], groups)}, {cap.get('dtype', '?')}, "
                     f"{cap.get('attention_backend', '?')} attention; KV cache sized by {cap.get('kv_budget', '?')}")
    if fit == 0:
        lines.append(f"warning: the KV cache holds {cap['kv_tokens']} tokens, fewer than max_model_len {max_len}: "
                     f"requests needing more are rejected (raise --kv-cache-memory or --num-kv-blocks, or lower "
                     f"--max-model-len)")
    return lines


def _mib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB" if count >= 2**30 else f"{count / 2**20:.1f} MiB"


def device_span(config: ShuttleConfig, first: str, groups: int) -> str:
    """The devices the ranks of `groups` serving groups own, from the first rank's ('cuda:0' -> 'cuda:0..cuda:3')."""
    ranks = groups * config.parallel.tensor_parallel_size
    if device_type(first) == "cpu" or ranks == 1:
        return first + (f" ({ranks} workers)" if ranks > 1 else "")
    tp = config.parallel.tensor_parallel_size
    return f"{first}..{rank_device(first, groups - 1, tp - 1, tp)}"


def say(message: str, data: dict | None = None) -> None:
    """One line of the launcher's own output, `data` as JSON after the message (common/log_format.py)."""
    print(launcher_line(message, data), flush=True)


class Launcher:
    """The supervision loop. `run()` returns the exit status.

    Args:
        config: the frontend's configuration (its ipc names every group's requests endpoint).
        groups: each local serving group's endpoints (None: one group on config.ipc).
        with_frontend: False for `shuttle engine` (a group serving a frontend on another host).
    """

    def __init__(self, config: ShuttleConfig, api_key: str | None, groups: list[IpcConfig] | None = None,
                 with_frontend: bool = True, placer: RayPlacer | None = None):
        self.config = config
        self.env = dict(os.environ)
        self.env.pop("SHUTTLE_API_KEY", None)
        self.env.pop("VLLM_API_KEY", None)  # read above; the frontend alone gets the key, as SHUTTLE_API_KEY
        if api_key:
            self.env["SHUTTLE_API_KEY"] = api_key  # through the environment: argv is visible to every user
        if config.ipc.curve:
            # keys given to the launcher (multi-host: the same on every host) win over a fresh pair per launch
            keys = os.environ.get(CURVE_ENV)
            self.env[CURVE_ENV] = CurveKeys.from_env().to_env() if keys else CurveKeys.generate().to_env()
            os.environ[CURVE_ENV] = self.env[CURVE_ENV]  # this process's own sockets: a tcp:// control socket (Ray)
        self.group_configs = [dataclasses.replace(config, ipc=ipc) for ipc in groups] if groups is not None \
            else [config]
        single = len(self.group_configs) == 1
        tp = config.parallel.tensor_parallel_size
        roles = engine_roles(tp)
        # every local worker rank of every group shares the cores this launcher may use (common/cpu_threads.py);
        # raises ValueError for a --worker-cores outside them
        # (under Ray the workers are on Ray's nodes: only the frontend and the schedulers run here)
        self.placer = placer
        local_workers = 0 if placer is not None else len(self.group_configs) * tp
        self.cores: CorePlan = plan_cores(allowed_cores(), local_workers, config.worker.worker_cores,
                                          config.worker.worker_threads, device_type(config.worker.device) == "cpu")
        self.engines = [Unit("engine" if single else f"engine of group {g}", roles, group=g, cores=self.cores,
                             placer=placer) for g in range(len(self.group_configs))]
        self.frontend = Unit("frontend", FRONTEND, cores=self.cores) if with_frontend else None
        self.units = self.engines + ([self.frontend] if self.frontend else [])
        self.ctx: zmq.Context = zmq.Context.instance()
        self.control: Channel[ControlMessage] = Channel(self.ctx, zmq.PULL, config.ipc.control, bind=True,
                                                        recv_type=ControlMessage, curve=config.ipc.curve)
        self.to_frontend: Channel | None = None
        self.signals = 0
        self.frontend_config = config  # the restarted frontend reuses the first one's port and batch endpoint

    def run(self) -> int:
        old, new = raise_fd_limit()
        if new != old:
            say(f"raised the open-file limit from {old} to {new}")
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for unit in self.engines:
                unit.start(self.group_configs[unit.engine_group], self.env)
            if self.frontend is not None:
                self.frontend.start(self.config, self.env)
                self._link_frontend()
            if not self._wait_until_ready():
                if self.signals:
                    return 0
                refused = any(p.returncode == 2 for u in self.units for p in u.procs.values())
                return 2 if refused else 1  # 2: a child refused the model (main's rule, kept)
            self._announce()
            return self._supervise()
        finally:
            for sig in previous:
                signal.signal(sig, signal.SIG_IGN)
            for unit in reversed(self.units):  # the frontend first: its clients get answers, not a cut
                if unit is self.frontend:
                    self._stop_frontend(unit)
                else:
                    unit.kill()
            self.control.close()
            if self.to_frontend is not None:
                self.to_frontend.close()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.signals += 1  # the loop acts on it; nothing is interrupted halfway

    def _link_frontend(self) -> None:
        """A fresh PUSH for each frontend incarnation, so nothing meant for a dead one reaches its successor."""
        if self.to_frontend is not None:
            self.to_frontend.close()
        self.to_frontend = Channel(self.ctx, zmq.PUSH, self.config.ipc.supervisor, bind=False)

    def _read_control(self, timeout_ms: int) -> None:
        if not self.control.poll(timeout_ms):
            return
        while self.control.poll(0):
            msg = self.control.recv()
            if msg is None:
                continue  # malformed: counted and logged by the channel
            for unit in self.units:
                unit.on_control(msg)

    def _wait_until_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(unit.is_ready for unit in self.units):
            for unit in self.units:
                for role, proc in unit.procs.items():
                    if proc.poll() is not None:
                        say(f"{process_end(role, proc)} during start-up; "
                             f"stopping the others")
                        return False
            if self.signals:
                say("stopping")
                return False
            if time.monotonic() > deadline:
                waiting = [r for u in self.units for r in u.roles if r not in u.ready]
                say(f"start-up took over {START_TIMEOUT_S:.0f} s; waiting for {waiting}")
                return False
            self._read_control(100)
        if self.frontend is None:
            return True
        url = urlsplit(self.frontend.ready["frontend"]["url"])
        batch = self.frontend.ready["frontend"].get("batch_endpoint", "") or self.config.batch_endpoint
        # a restarted frontend listens where this one does (on --uds, the same socket: no port to keep)
        self.frontend_config = dataclasses.replace(self.config, port=self.config.port if url.port is None else url.port,
                                                   batch_endpoint=batch)
        return True

    def _supervise(self) -> int:
        heartbeat_timeout = self.config.ops.heartbeat_timeout
        last_look = time.monotonic()
        while True:
            self._read_control(POLL_MS)
            now = time.monotonic()
            gap, last_look = unwatched(now - last_look), now
            if gap:  # this loop did not run (stopped with its children, or starved): nobody was silent meanwhile
                for unit in self.units:
                    unit.paused(gap)
            if self.signals:
                return self._drain()
            for unit in self.units:
                if unit.restart_at is not None:
                    if time.monotonic() >= unit.restart_at:
                        say(f"restarting the {unit.name}")
                        unit.start(self.frontend_config if unit is self.frontend
                                   else self.group_configs[unit.engine_group], self.env)
                        if unit is self.frontend:
                            self._link_frontend()
                        # a start may take a while (under Ray it waits for a placement group, up to a minute): the
                        # heartbeats the other units sent meanwhile are read before anyone is judged silent
                        self._read_control(0)
                    continue
                if unit.serving_since is not None and unit.failures_in_a_row \
                        and time.monotonic() - unit.serving_since > RESTART_RESET_S:
                    unit.failures_in_a_row = 0
                if unit.is_ready and unit.ready_announced is False:
                    unit.ready_announced = True
                    say(f"the {unit.name} is serving again ({unit.start_durations[-1]:.1f} s to start)")
                    say("restarted", {"unit": unit.name, "pids": self._pids()})
                reason = unit.failure(heartbeat_timeout if unit.is_ready else 0.0)
                if reason is None and not unit.is_ready and time.monotonic() - unit.started_at > START_TIMEOUT_S:
                    reason = f"it did not start within {START_TIMEOUT_S:.0f} s"
                if reason is not None and not self._recover(unit, reason):
                    return 1

    def _recover(self, unit: Unit, reason: str) -> bool:
        """Kill the unit, tell the frontend if the engine went, and schedule a restart. False: give up. A frontend
        that is still alive gets its last words first: its open streams end with an error, not a cut."""
        unit.kill(LAST_WORDS_S if unit is self.frontend else 0.0)
        give_up = unit.failures_in_a_row >= self.config.ops.max_restarts
        backoff = unit.next_backoff()
        if unit is not self.frontend and self.to_frontend is not None:
            eta = backoff + unit.expected_start_s()
            self.to_frontend.try_send(EngineDown(reason=reason, retry_after=eta, group=unit.engine_group,
                                                 restarting=not give_up))
        if give_up:
            say(f"{reason}; {unit.failures_in_a_row} restart(s) in a row already (--max-restarts "
                 f"{self.config.ops.max_restarts}): stopping the others")
            return False
        unit.failures_in_a_row += 1
        unit.restart_at = time.monotonic() + backoff
        unit.ready_announced = False
        say(f"{reason}; the {unit.name} restarts in {backoff:.1f} s "
             f"(restart {unit.failures_in_a_row} of at most {self.config.ops.max_restarts} in a row)")
        return True

    def _stop_frontend(self, unit: Unit) -> None:
        """A frontend still running at the end (the launcher gave up, or start-up failed) drains for up to
        STOP_TIMEOUT_S (what is in flight on a lost engine has its 503 already; it writes those answers), then gets
        its last words and SIGKILL."""
        proc = unit.procs.get("frontend")
        if proc is not None and proc.poll() is None and unit.is_ready:
            proc.send_signal(DRAIN_SIGNAL)
            try:
                proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        unit.kill(LAST_WORDS_S)

    def _drain(self) -> int:
        """Graceful stop: the frontend drains (admission off, in-flight requests finish or time out), then the
        engine goes. Exit status 0."""
        timeout = self.config.ops.shutdown_timeout
        if self.frontend is None:
            return self._drain_engines(timeout)
        say(f"stopping: draining in-flight requests for up to {timeout:g} s (a second Ctrl-C ends them now)")
        frontend = self.frontend.procs.get("frontend")
        if frontend is None or frontend.poll() is not None or self.frontend.restart_at is not None:
            return 0
        frontend.send_signal(DRAIN_SIGNAL)
        forwarded = 1
        deadline = time.monotonic() + timeout + DRAIN_EXIT_GRACE_S
        while frontend.poll() is None and time.monotonic() < deadline:
            self._read_control(POLL_MS)
            if self.signals > forwarded:  # again: the frontend ends the rest now
                forwarded = self.signals
                frontend.send_signal(DRAIN_SIGNAL)
            for unit in self.engines:
                reason = unit.failure(0.0) if unit.restart_at is None else None
                if reason is not None:
                    unit.kill()
                    if self.to_frontend is not None:
                        self.to_frontend.try_send(EngineDown(reason=reason, retry_after=0.0, group=unit.engine_group,
                                                             restarting=False))
                    unit.restart_at = float("inf")  # no restart while stopping
        if frontend.poll() is None:
            say("the frontend did not finish draining in time; killing it")
            frontend.kill()
        frontend.wait()
        return 0

    def _drain_engines(self, timeout: float) -> int:
        """`shuttle engine`'s graceful stop: each scheduler drains (it refuses new requests, tells its frontends to
        route around it, lets the rest finish, then exits), for up to `timeout` seconds; what is left then ends when
        the group stops, each request answered by its frontend. Exit status 0."""
        say(f"stopping: draining in-flight requests for up to {timeout:g} s (a second Ctrl-C ends them now)")
        schedulers = [unit.procs["scheduler"] for unit in self.engines
                      if unit.restart_at is None and unit.procs.get("scheduler") is not None]
        for scheduler in schedulers:
            if scheduler.poll() is None:
                scheduler.send_signal(DRAIN_SIGNAL)
        deadline = time.monotonic() + timeout + ENGINE_DRAIN_GRACE_S
        while any(s.poll() is None for s in schedulers) and time.monotonic() < deadline and self.signals < 2:
            self._read_control(POLL_MS)
            if any(unit.failure(0.0) for unit in self.engines if unit.procs.get("scheduler") in schedulers
                   and unit.procs["scheduler"].poll() is None):
                break  # a worker died under the drain: nothing more will finish
        if any(s.poll() is None for s in schedulers):
            say("the drain did not finish; ending the requests left")
        return 0

    def _ray_line(self) -> str:
        """Where Ray placed each group's ranks (their nodes' addresses), for the start-up lines."""
        where = []
        for unit in self.engines:
            nodes = [getattr(proc, "node", "?") for role, proc in unit.procs.items() if role.startswith("worker")]
            where.append(f"group {unit.group} on {', '.join(nodes)}")
        return f"workers placed by Ray ({self.config.parallel.ray_placement_strategy}): {'; '.join(where)}"

    def _ray_nodes(self) -> dict[str, str]:
        """role (as in _pids) -> the Ray node id of each worker rank Ray placed."""
        nodes: dict[str, str] = {}
        for unit in self.engines:
            suffix = "" if len(self.engines) == 1 else f".{unit.group}"
            nodes.update({role + suffix: proc.node_id for role, proc in unit.procs.items()
                          if isinstance(proc, RayProcess)})
        return nodes

    def _pids(self) -> dict[str, int]:
        """role -> pid; with several groups, role.GROUP ("worker.1")."""
        pids: dict[str, int] = {}
        for unit in self.units:
            pids.update(unit.pids("" if len(self.engines) == 1 or unit is self.frontend else f".{unit.group}"))
        return pids

    def _announce(self) -> None:
        if self.engines:
            lines = capacity_lines(self.config, self.engines[0].ready["scheduler"], len(self.engines))
            if len(self.engines) > 1:
                lines[0] = f"{len(self.engines)} data-parallel groups, each: {lines[0]}"
            lines.append(self.cores.describe(self.env) if self.placer is None else self._ray_line())
            for line in lines:
                say(line)
        if self.frontend is None:
            endpoint = self.group_configs[0].ipc.requests
            say(f"engine serving {self.config.model.served_model_name} for frontends at {endpoint}  (Ctrl-C stops)")
            say("ready", {"url": "", "endpoint": endpoint, "batch_endpoint": "", "pids": self._pids(),
                          "launcher_pid": os.getpid()})
            return
        info = self.frontend.ready["frontend"]
        url = info["url"]
        remote = self.config.ipc.remote_groups
        if remote:
            say(f"remote serving groups (joining when they answer): {', '.join(remote)}")
        batch = info.get("batch_endpoint", "")
        say(f"serving {self.config.model.served_model_name} at {url}" + (f", batch jobs at {batch}" if batch else "")
             + "  (Ctrl-C stops)")
        ray_nodes = {"ray_nodes": self._ray_nodes()} if self.placer is not None else {}
        say("ready", {"url": url, "batch_endpoint": batch, "pids": self._pids(), "launcher_pid": os.getpid(),
                      **ray_nodes})
