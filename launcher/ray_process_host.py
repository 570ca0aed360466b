"""The Ray actor that runs one shuttle worker process on the node Ray placed it on (--distributed-executor-backend ray).

The actor holds its placement-group bundle (CPUs, a GPU) for as long as the process lives, starts the process with
the same command line a local launch uses, reports its pid and node address, and outlives it only to report its exit
status. The process is tied to the actor: it is started from a thread of the actor's own that waits for it, with the
parent-death signal set (common/process.py's die_with_parent), so when the actor dies (killed by the launcher, by
`ray stop`, or with its node) the kernel kills the process too, and nothing of shuttle outlives its actor.

Imported by Ray on every node: it imports nothing heavy (Ray itself only inside the actor).
"""

from __future__ import annotations

import os
import subprocess
import threading

from shuttle.common.process import die_with_parent
from shuttle.launcher.ports import free_listen_ports


class ProcessHost:
    """One process on this node, run for the launcher (an actor with max_concurrency > 1: `exit_status` blocks)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._returncode: int | None = None
        self._done = threading.Event()

    def node(self) -> tuple[str, int, str]:
        """This node's address as Ray knows it (other nodes reach it there), a TCP port free on it now (for a
        torch.distributed rendezvous), and its Ray node id."""
        import ray  # this runs inside a Ray worker process

        address = ray.util.get_node_ip_address()
        (port,) = free_listen_ports(1, address)  # below the ephemeral range: a busy node's connections miss it
        return address, port, ray.get_runtime_context().get_node_id()

    def start(self, argv: list[str], env: dict[str, str]) -> int:
        """Start `argv` with this actor's environment updated by `env`; its pid.

        Raises:
            OSError: the program could not be started.
        """
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:  # this thread lives exactly as long as the process: its death signal follows the actor
            try:
                self._proc = subprocess.Popen(argv, env={**os.environ, **env}, preexec_fn=die_with_parent)
            except BaseException as exc:  # handed to start()'s caller
                failure.append(exc)
                started.set()
                return
            started.set()
            self._returncode = self._proc.wait()
            self._done.set()

        threading.Thread(target=run, name="shuttle-process", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]
        assert self._proc is not None
        return self._proc.pid

    def exit_status(self) -> int:
        """Block until the process exits; its return code (negative: the signal that killed it)."""
        self._done.wait()
        assert self._returncode is not None
        return self._returncode

    def signal(self, signum: int) -> None:
        """Send `signum` to the process while it runs."""
        if self._proc is not None and self._returncode is None:
            try:
                self._proc.send_signal(signum)
            except ProcessLookupError:
                pass  # exited meanwhile

