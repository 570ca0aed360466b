"""Which CPU cores each process may use, and how many threads the worker runs on them.

The rule (docs/operations.md "Threads and cores"), applied by the launcher when it starts a serving group:
1. The cores come from the launcher's affinity (os.sched_getaffinity: what taskset, cgroups or a container allow),
   not from the machine's core count.
2. --worker-cores LIST (e.g. `0-3,6`) gives the workers those cores (each must be allowed); the frontend and the
   scheduler are pinned to the allowed cores outside the list (left unpinned when none are left). Without it, the
   workers get every allowed core but one when more than 2 are allowed (that one is for the frontend and the
   scheduler, which are light but wake on every step), all of them on 1 or 2 cores; only a worker is pinned, to
   its slice (rule 5).
3. The worker processes of all local serving groups (data parallel x tensor parallel) split those cores between
   them in contiguous slices, never oversubscribing: with fewer cores than workers, each worker gets one core
   (shared round-robin). Pinned (--worker-cores), each worker is bound to its slice.
4. A worker runs as many intra-op threads as its slice has cores, unless --worker-threads N says otherwise;
   OMP_NUM_THREADS in the launcher's environment is not read (the launcher sets the worker's own, so that a value
   left over in a shell or a test harness cannot make the default differ from the same count given explicitly).
   torch's inter-op pool gets one thread (the worker runs one op at a time), numba's decode kernel torch's count.
5. A CPU worker whose slice is its own (no core shared with another worker) and who runs one thread per core of it
   (the default) is bound to its slice, pinned or not, and its OpenMP threads one per core (OMP_PROC_BIND=close:
   GNU OpenMP places them from the process's affinity, so numba's copy of the runtime, started later, agrees).
   The main thread is OpenMP's first, bound to the slice's first core; threads it starts afterwards (ZMQ's, the
   heartbeat's) inherit that core, so `taskset -p` of the worker's pid shows that one core.
   Bound threads are never moved, nor stacked on one core while another idles; at one sequence on a 2-core machine
   beside busy neighbours the served decode step's p99 fell by 40%, level alone (docs/operations.md, threads and
   cores: scripts/dev/bench_threads.py).
   An operator's own OMP_PROC_BIND or OMP_PLACES wins (OMP_PROC_BIND=false: neither bound nor pinned).
6. A worker's waiting OpenMP threads spin briefly, then sleep: GNU OpenMP (torch's pip builds) polls WAIT_SPINS
   times (GOMP_SPINCOUNT, under a millisecond) before it sleeps, other runtimes sleep at once
   (OMP_WAIT_POLICY=PASSIVE, KMP_BLOCKTIME=0). The short spin covers the gaps between the operators of a step and
   between steps (sleeping there cost a wake-up per parallel region, a third of a one-sequence decode step of a
   110M Llama); OpenMP's own default (300,000 polls, milliseconds) made steps several-fold slower beside busy
   neighbours. The frontend and scheduler never spin. The launcher puts all of this into the worker's environment
   and affinity before Python starts, so torch and numba read it when they start their pools.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

# The worker's intra-op thread count, as the launcher chose it (read by worker/worker.py; unset: torch's own)
WORKER_THREADS_ENV = "SHUTTLE_WORKER_THREADS"

# How many times a worker's idle GNU OpenMP thread polls for the next parallel region before it sleeps. A poll is
# one pause instruction: 24 ns on a Zen 5 core, tens of ns on others, so 10,000 polls last a quarter to half a
# millisecond: longer than the host work between two operators of a step or between two steps (input preparation,
# sampling, the next plan's arrival), far shorter than a neighbour's time slice. scripts/dev/bench_threads.py
# measures it alone and beside busy neighbours (docs/operations.md, threads and cores).
WAIT_SPINS = 10_000


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """A Linux CPU list ("0-3,6", as taskset -c and /sys take it) as sorted, distinct core ids.

    Raises ValueError naming the bad part ("" gives ()).
    """
    cores: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part and not text.strip():
            continue
        first, dash, last = part.partition("-")
        try:
            low = int(first)
            high = int(last) if dash else low
        except ValueError:
            raise ValueError(f"not a CPU list (like 0-3,6): {part!r} in {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"not a CPU range (low-high, 0 <= low <= high): {part!r} in {text!r}")
        cores.update(range(low, high + 1))
    return tuple(sorted(cores))


def format_cpu_list(cores) -> str:
    """The shortest CPU list of `cores` ((0, 1, 2, 3, 6) -> "0-3,6")."""
    ranges: list[list[int]] = []
    for core in sorted(set(cores)):
        if ranges and core == ranges[-1][1] + 1:
            ranges[-1][1] = core
        else:
            ranges.append([core, core])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


def cpu_list(text: str) -> str:
    """--worker-cores's type: a CPU list, normalised ("3,0-2" -> "0-3"); "" for none."""
    import argparse
    try:
        return format_cpu_list(parse_cpu_list(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class CoreError(ValueError):
    """--worker-cores names cores this process may not use."""


@dataclass(frozen=True)
class CorePlan:
    """Cores and threads of one launch (rule: the module docstring).

    Attributes:
        workers: per worker process (group-major: group g's rank r at g x tp + r), the cores it may use.
        threads: per worker process, its intra-op thread count.
        others: the cores of the frontend and the scheduler (the allowed set when nothing is set aside).
        pinned: whether processes are bound to those cores (only with --worker-cores).
        on_cpu: whether the workers compute on the CPU (only those bind their threads, rule 5: a GPU worker's few
            busy host threads keep the freedom of its slice).
    """

    workers: tuple[tuple[int, ...], ...]
    threads: tuple[int, ...]
    others: tuple[int, ...]
    pinned: bool
    on_cpu: bool = True

    @property
    def exclusive(self) -> bool:
        """Whether no core is in two workers' slices (False: fewer cores than workers, shared round-robin)."""
        cores = [core for share in self.workers for core in share]
        return len(cores) == len(set(cores))

    def binds(self, index: int, base: dict[str, str]) -> bool:
        """Whether worker `index` is bound to its slice, a thread per core (rule 5): it computes on the CPU, its
        slice is its own, it runs one thread per core of it, and `base` (the launcher's environment) sets no
        OMP_PROC_BIND or OMP_PLACES."""
        return (self.on_cpu and self.exclusive and self.threads[index] == len(self.workers[index])
                and "OMP_PROC_BIND" not in base and "OMP_PLACES" not in base)

    def describe(self, base: dict[str, str] | None = None) -> str:
        """For the start-up line: "worker: 2 threads on cores 0-1" / "... bound one per core" (rule 5, judged with
        the launcher's environment `base`) / "... (pinned; frontend and scheduler on 2)", or "... unpinned: ..."
        when --worker-cores names every allowed core."""
        shares = sorted({(t, c, base is not None and self.binds(i, base))
                         for i, (t, c) in enumerate(zip(self.threads, self.workers))})
        text = "; ".join(f"{t} thread{'s' * (t != 1)} on core{'s' * (len(c) != 1)} {format_cpu_list(c)}"
                         f"{', bound one per core' * bound}" for t, c, bound in shares)
        if self.pinned and {core for share in self.workers for core in share}.isdisjoint(self.others):
            text += f" (pinned; frontend and scheduler on {format_cpu_list(self.others)})"
        elif self.pinned:  # others fell back to every allowed core, the workers' included
            text += " (pinned; frontend and scheduler unpinned: --worker-cores leaves no other core)"
        return f"{len(self.workers)} worker(s): {text}" if len(self.workers) > 1 else f"worker: {text}"


def plan_cores(allowed, num_workers: int, worker_cores: str = "", worker_threads: int = 0,
               on_cpu: bool = True) -> CorePlan:
    """The rule of the module docstring for `num_workers` worker processes on the `allowed` cores.

    Raises CoreError when --worker-cores names a core outside `allowed`.
    """
    allowed = tuple(sorted(set(allowed)))
    chosen = parse_cpu_list(worker_cores)
    if chosen:
        outside = sorted(set(chosen) - set(allowed))
        if outside:
            raise CoreError(f"--worker-cores {worker_cores} names cores this process may not use "
                             f"({format_cpu_list(outside)}; allowed: {format_cpu_list(allowed)})")
        pool, others = chosen, tuple(c for c in allowed if c not in chosen) or allowed
    else:
        pool = allowed[:-1] if len(allowed) > 2 else allowed
        others = allowed[-1:] if len(allowed) > 2 else allowed
    shares = split_cores(pool, num_workers)
    threads = tuple(worker_threads or len(share) for share in shares)
    return CorePlan(shares, threads, others, pinned=bool(chosen), on_cpu=on_cpu)


def split_cores(pool: tuple[int, ...], num_workers: int) -> tuple[tuple[int, ...], ...]:
    """`pool` in `num_workers` contiguous slices as even as can be (the first ones one longer); with fewer cores
    than workers, worker i gets core i mod len(pool)."""
    if num_workers == 0:
        return ()
    if num_workers <= len(pool):
        size, extra = divmod(len(pool), num_workers)
        starts = [i * size + min(i, extra) for i in range(num_workers + 1)]
        return tuple(pool[starts[i]:starts[i + 1]] for i in range(num_workers))
    return tuple((pool[i % len(pool)],) for i in range(num_workers))


def worker_env(base: dict[str, str], threads: int, bind: bool = False) -> dict[str, str]:
    """The environment of a worker process running `threads` intra-op threads: every thread pool it starts
    (OpenMP's, MKL's, numba's) sized to `threads`, and waiting OpenMP threads polling WAIT_SPINS times before they
    sleep (GNU OpenMP reads GOMP_SPINCOUNT before OMP_WAIT_POLICY; other runtimes sleep at once), unless `base`
    sets GOMP_SPINCOUNT itself. With `bind` (CorePlan.binds), its OpenMP threads are bound one per core of the
    process's affinity (rule 5)."""
    env = dict(base)
    count = str(threads)
    env.update({"OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count, "NUMBA_NUM_THREADS": count,
                WORKER_THREADS_ENV: count, "OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"})
    env.setdefault("GOMP_SPINCOUNT", str(WAIT_SPINS))  # an operator's own count wins (0: sleep at once)
    if bind:
        env["OMP_PROC_BIND"] = "close"
    return env


def other_env(base: dict[str, str]) -> dict[str, str]:
    """The environment of the frontend and the scheduler: one OpenMP thread, sleeping when idle, for anything
    that would spread over the cores, so that they stay off the worker's."""
    env = dict(base)
    env.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
                "KMP_BLOCKTIME": "0"})
    return env


def pin(cores: tuple[int, ...]) -> None:
    """Bind the calling process to `cores` (no-op for () or off Linux); children inherit it."""
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)


def allowed_cores() -> tuple[int, ...]:
    """The cores this process may run on (its affinity; all of os.cpu_count() where there is none)."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))
