"""`--distributed-executor-backend ray`: the serving groups' worker ranks placed on a Ray cluster.

The launcher joins the cluster (`ray.init` at --ray-address, else $RAY_ADDRESS, else a local one) as its driver. The
frontend and each group's scheduler stay on the launcher's machine, as vLLM keeps its engine core beside the driver
and places only its workers with Ray. Each start of a serving group:
- makes one placement group for it, one bundle per tensor-parallel rank (`--worker-threads` CPUs, default 1, and on
  CUDA one GPU), with --ray-placement-strategy (STRICT_PACK by default: the group's ranks on one node; PACK, SPREAD or
  STRICT_SPREAD when a group must span nodes); data-parallel groups aim at different nodes (a soft target under
  STRICT_PACK, group g at the g-th node that has room);
- waits at most PLACEMENT_TIMEOUT_S for Ray to reserve it; a group Ray cannot place fails its start, which the
  launcher retries with its backoff, bounded by --max-restarts, as any failed start;
- starts one ProcessHost actor in each bundle (launcher/ray_process_host.py), which runs the rank's `python -m
  shuttle.worker` on its node with the launcher's configuration and environment, rank 0's node address and a port
  free there as the torch.distributed rendezvous (gloo on CPU, NCCL on CUDA).
The ranks reach their scheduler over tcp:// on the launcher's address, authenticated with ZeroMQ CURVE keys the
launcher makes and hands to its actors in their environment; nothing is copied by hand. Ray reports a rank whose actor
died (killed, or lost with its node) through the actor's pending call, and the launcher fails that group alone: its
in-flight requests end with one error each, and the group is placed again where resources remain. The placement groups
and actors belong to the launcher's Ray job, so they go with it: a stopped launcher, and `ray stop`, leave none behind.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from shuttle.common.config import ShuttleConfig
from shuttle.common.devices import device_type
from shuttle.launcher.processes import describe_exit

GCS_PROBE_TIMEOUT_S = 5.0  # for the cluster's address to accept a connection at all
PLACEMENT_TIMEOUT_S = 60.0  # how long a start waits for Ray to reserve a group's bundles
ACTOR_START_TIMEOUT_S = 120.0  # for an actor to come up on its node and start its process
# the launcher's environment that a rank takes to its node: shuttle's own settings (keys, log format, rank, group),
# the thread counts it was given, and where models and caches are found
FORWARDED_PREFIXES = ("SHUTTLE_", "HF_", "TRANSFORMERS_", "OMP_", "GOMP_", "MKL_", "KMP_", "NUMBA_", "TORCH",
                      "PYTORCH_", "NCCL_", "GLOO_")


def model_source(model_dir: str, typed: str) -> str | None:
    """"org/name@commit" when `model_dir` is the Hugging Face cache's snapshot of the id `typed`, else None (a
    directory given as such: the nodes must have it at the same path)."""
    path = Path(model_dir)
    if path.parent.name == "snapshots" and path.parent.parent.name == "models--" + typed.replace("/", "--"):
        return f"{typed}@{path.name}"
    return None


class RayUnavailable(Exception):
    """Ray is not installed, or its cluster cannot be joined (one line for the launcher to print)."""


def _probe_gcs(address: str) -> None:
    """Raise RayUnavailable unless something accepts a TCP connection at `address` (HOST:PORT, the cluster's GCS)
    within GCS_PROBE_TIMEOUT_S."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=GCS_PROBE_TIMEOUT_S):
            pass
    except ValueError:
        raise RayUnavailable(f"--ray-address {address!r} is not HOST:PORT") from None
    except OSError as exc:
        raise RayUnavailable(f"cannot join the Ray cluster at {address}: nothing answers there ({exc}); start its "
                             f"head with `ray start --head`, or give its address") from None


def join_ray(address: str) -> str:
    """Join the Ray cluster at `address` ("" : $RAY_ADDRESS, else a local cluster, as `ray.init()` decides); the
    launcher's node address, which the ranks reach it at.

    Raises:
        RayUnavailable: Ray is not installed, or the cluster did not answer.
    """
    try:
        import ray
    except ImportError:
        raise RayUnavailable("--distributed-executor-backend ray needs Ray (pip install 'shuttle[ray]')") from None
    named = address or os.environ.get("RAY_ADDRESS", "")
    if named and named != "auto" and not named.startswith("ray://"):
        _probe_gcs(named)  # ray.init retries an absent GCS for minutes, deaf to Ctrl-C: ask once, briefly
    try:
        ray.init(address=address or None, logging_level=logging.WARNING, log_to_driver=False,
                 namespace="shuttle")
    except (ConnectionError, ValueError, RuntimeError) as exc:
        raise RayUnavailable(f"cannot join the Ray cluster at {address or os.environ.get('RAY_ADDRESS') or 'auto'}: "
                             f"{exc}") from None
    return ray.util.get_node_ip_address()


class RayProcess:
    """A worker rank running under a ProcessHost actor, with the subset of subprocess.Popen the launcher uses
    (pid, returncode, poll, wait, send_signal, terminate, kill).

    Attributes:
        pid: the process's pid on its node (what its ProcessReady and heartbeats carry).
        node: the node's address. node_id: its Ray node id.
    """

    def __init__(self, actor: Any, pid: int, node: str, node_id: str):
        import ray

        self._ray = ray
        self.actor = actor
        self.pid = pid
        self.node = node
        self.node_id = node_id
        self.returncode: int | None = None
        self.lost = False  # the actor died (killed, or its node was lost) before reporting the exit
        self._exit = actor.exit_status.remote()

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = self._ray.wait([self._exit], timeout=0)
            if ready:
                try:
                    self.returncode = self._ray.get(self._exit)
                except self._ray.exceptions.RayError:
                    self.lost, self.returncode = True, -9
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"worker on {self.node}", timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            self.actor.signal.remote(signum)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """Kill the actor, and with it the process (its parent-death signal)."""
        try:
            self._ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already, with its node or the cluster
            self.lost, self.returncode = True, -9

    def describe(self) -> str:
        """How it ended, in words, for the launcher's line."""
        if self.lost:
            return f"was lost with its Ray actor on node {self.node} (the node went away, or the actor was killed)"
        return f"on Ray node {self.node} {describe_exit(self.returncode or 0)}"


class RayPlacer:
    """Places serving groups' worker ranks on the Ray cluster the launcher joined (join_ray), one placement group per
    start of a group.

    Args:
        strategy: the placement groups' strategy (--ray-placement-strategy).
    """

    def __init__(self, strategy: str = "STRICT_PACK"):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from shuttle.launcher.ray_process_host import ProcessHost

        self._ray = ray
        self._placement_group = placement_group
        self._remove = remove_placement_group
        self._in_bundle = PlacementGroupSchedulingStrategy
        self._host = ray.remote(ProcessHost)
        self.strategy = strategy
        self.groups: dict[int, Any] = {}  # group -> its current placement group

    def cluster_gpus(self) -> int:
        """The GPUs of the whole cluster (what --device auto and the device count check see under Ray)."""
        return int(self._ray.cluster_resources().get("GPU", 0))

    def bundle(self, config: ShuttleConfig) -> dict[str, float]:
        """One rank's resources: --worker-threads CPUs (default 1), and a GPU on CUDA."""
        bundle = {"CPU": float(config.worker.worker_threads or 1)}
        if device_type(config.worker.device) == "cuda":
            bundle["GPU"] = 1.0
        return bundle

    def check_fits(self, config: ShuttleConfig) -> None:
        """Refuse a group that no node of the cluster could ever hold (its bundles against each node's total
        resources), so that it is one line at start-up, not a minute's wait for a reservation that cannot come.

        Raises:
            RayUnavailable: no node (under STRICT_PACK: no single node for all the ranks) has the resources.
        """
        bundle = self.bundle(config)
        ranks = config.parallel.tensor_parallel_size if self.strategy == "STRICT_PACK" else 1
        if not self._nodes_that_hold(bundle, ranks):
            largest = max((n["Resources"].get("CPU", 0) for n in self._ray.nodes() if n.get("Alive")), default=0)
            raise RayUnavailable(f"no node of the Ray cluster can hold {ranks} x {bundle} ({self.strategy}); its "
                                 f"largest node has {largest:g} CPUs (lower --worker-threads, or add nodes)")

    def place(self, group: int, config: ShuttleConfig) -> list[Any]:
        """Reserve group `group`'s bundles (releasing any earlier placement of it) and start one actor in each, rank
        order; rank 0's actor first answers where the rendezvous is (its node address and a free port).

        Raises:
            RayUnavailable: Ray did not reserve the bundles within PLACEMENT_TIMEOUT_S, or an actor did not start.
        """
        self.release(group)
        tp = config.parallel.tensor_parallel_size
        bundle = self.bundle(config)
        try:
            target = self._target_node(group, bundle, tp) if self.strategy == "STRICT_PACK" else None
            pg = self._placement_group([dict(bundle) for _ in range(tp)], strategy=self.strategy,
                                       name=f"shuttle-group-{group}-{os.getpid()}", _soft_target_node_id=target)
        except Exception as exc:  # the cluster is gone
            raise RayUnavailable(f"Ray did not place serving group {group}: {exc}") from None
        self.groups[group] = pg
        try:
            self._ray.get(pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            raise RayUnavailable(f"Ray could not reserve {tp} x {bundle} ({self.strategy}) for serving group {group} "
                                 f"within {PLACEMENT_TIMEOUT_S:.0f} s: no node has the resources free") from None
        except Exception as exc:  # the cluster itself is gone (`ray stop`): a failed start like any other
            raise RayUnavailable(f"Ray did not place serving group {group}: {exc}") from None
        try:
            return [self._host.options(num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=4,
                                       scheduling_strategy=self._in_bundle(placement_group=pg,
                                                                           placement_group_bundle_index=rank)).remote()
                    for rank in range(tp)]
        except Exception as exc:  # the cluster went away meanwhile
            raise RayUnavailable(f"Ray did not start serving group {group}'s actors: {exc}") from None

    def rendezvous(self, actor: Any) -> tuple[str, int]:
        """Rank 0's node address and a port free there.

        Raises:
            RayUnavailable: the actor did not come up (its node went away, or it did not start in time).
        """
        try:
            address, port, _ = self._ray.get(actor.node.remote(), timeout=ACTOR_START_TIMEOUT_S)
        except self._ray.exceptions.RayError as exc:
            raise RayUnavailable(f"rank 0's Ray actor did not come up: {exc}") from None
        return address, port

    def start(self, actor: Any, argv: list[str], env: dict[str, str]) -> RayProcess:
        """Run `argv` under `actor` with the forwarded part of `env` (FORWARDED_PREFIXES).

        Raises:
            RayUnavailable: the actor did not start the process.
        """
        forwarded = {k: v for k, v in env.items() if k.startswith(FORWARDED_PREFIXES)}
        try:
            pid = self._ray.get(actor.start.remote(argv, forwarded), timeout=ACTOR_START_TIMEOUT_S)
            node, _, node_id = self._ray.get(actor.node.remote(), timeout=ACTOR_START_TIMEOUT_S)
        except (self._ray.exceptions.RayError, OSError) as exc:
            raise RayUnavailable(f"a Ray actor did not start its worker: {exc}") from None
        return RayProcess(actor, pid, node, node_id)

    def release(self, group: int) -> None:
        """Remove group `group`'s placement group (its actors were killed first), if it has one."""
        pg = self.groups.pop(group, None)
        if pg is not None:
            try:
                self._remove(pg)
            except Exception:  # noqa: BLE001 - already gone with the cluster: nothing left to release
                pass

    def close(self) -> None:
        for group in list(self.groups):
            self.release(group)
        self._ray.shutdown()

    def _target_node(self, group: int, bundle: dict[str, float], ranks: int) -> str | None:
        """The node group `group` aims at: the group-th (cyclically) of the alive nodes that can hold its `ranks`,
        so that data-parallel groups land on different nodes while there are enough."""
        fits = self._nodes_that_hold(bundle, ranks)
        return fits[group % len(fits)] if fits else None

    def _nodes_that_hold(self, bundle: dict[str, float], ranks: int) -> list[str]:
        """The ids, in a fixed order, of the alive nodes whose total resources hold `ranks` x `bundle`."""
        nodes = sorted((n for n in self._ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])
        return [n["NodeID"] for n in nodes if all(n["Resources"].get(k, 0) >= v * ranks for k, v in bundle.items())]
