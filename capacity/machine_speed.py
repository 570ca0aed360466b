"""The machine's speed over time, replayed by the simulator.

On a shared host the other tenants come and go, and every process here runs slower or faster with them: on this
2-core machine a Python-bound loop (interpreter work and small tensor operations, what a serving process does
between its kernels) ran at 0.55-0.85x of its mean rate for 2-15 seconds at a time, then at 1.2x, while a large
matrix multiply stayed within 3%. Near saturation such a spell builds the queue behind the tail latencies, so the
simulator needs the spells, not only the mean speed: calibrate.py traces them with a SpeedMonitor through its
real-server runs and the simulator replays the trace (StepCostModel.speed_trace) on every process's work;
check_simulator.py traces its real runs the same way, relative to the calibration's mean speed.
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing
import time
from typing import Callable

from common.step_cost import StepCostModel

SPEED_INTERVAL_S = 0.5  # the trace's resolution: the spells last seconds, a step a few milliseconds


def with_speed_trace(cost: StepCostModel, trace: list[float], interval_s: float) -> StepCostModel:
    """The cost model with the machine's measured speed trace: the simulator replays it on every process, so the
    step jitter keeps only its fresh part (the persistent part, measured from served steps, is what the trace now
    carries; keeping both would count the slow spells twice).

    Raises:
        ValueError: an empty trace, a non-positive value or interval (StepCostModel's check)."""
    if not trace:
        raise ValueError("an empty speed trace")
    fresh = cost.jitter * (1.0 - cost.jitter_slow_share) ** 0.5
    return dataclasses.replace(cost, speed_trace=list(trace), speed_interval_s=float(interval_s), jitter=fresh,
                               jitter_slow_share=0.0, jitter_memory_s=0.0)


def _unit_of_work() -> Callable[[], None]:
    """About a millisecond of what a serving process does between kernels: small tensor operations and Python
    objects (one torch thread)."""
    import torch

    torch.set_num_threads(1)
    x, w = torch.randn(32, 64), torch.randn(64, 64)

    def work() -> None:
        for _ in range(30):
            torch.nn.functional.silu(x @ w).add_(x)
            {i: i * 2 for i in range(30)}

    return work


def _monitor(conn, stop, period_s: float) -> None:
    work = _unit_of_work()
    work()  # warm-up: the first call pays lazy initialisation
    conn.send("ready")
    samples = []
    deadline = time.monotonic()
    while not stop.is_set():
        at, cpu = time.monotonic(), time.thread_time()
        work()
        samples.append((at, time.thread_time() - cpu))
        deadline = max(deadline + period_s, time.monotonic())
        stop.wait(deadline - time.monotonic())
    conn.send(samples)
    conn.close()


class SpeedMonitor:
    """The machine's speed while something else runs: a separate process does a fixed unit of work (about 1 ms of
    CPU) every `period_s` and records the CPU seconds it took (its own thread's time, so waiting for a core does
    not count: a busy machine does not read as a slow one; a host that slows every process does). At 50 ms about
    2% of a core.

    Use as a context manager (entering returns once the monitor runs; RuntimeError if it does not start);
    `samples` then holds (time.monotonic() seconds, CPU seconds of the unit) pairs.
    """

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.samples: list[tuple[float, float]] = []

    def __enter__(self) -> "SpeedMonitor":
        context = multiprocessing.get_context("spawn")
        self._receive, send = context.Pipe(duplex=False)
        self._stop = context.Event()
        self._process = context.Process(target=_monitor, args=(send, self._stop, self.period_s), daemon=True)
        self._process.start()
        try:  # starting takes a second or two (torch); what is measured starts after that
            if not self._receive.poll(120) or self._receive.recv() != "ready":
                raise RuntimeError("the speed monitor did not start within 120 s")
        except BaseException:
            self._process.kill()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        try:
            if self._receive.poll(30):
                self.samples = self._receive.recv()
        finally:
            self._process.join(5)
            if self._process.is_alive():
                self._process.kill()

    def unit_cpu_s(self, start: float, end: float) -> float:
        """Median CPU seconds of the unit between two time.monotonic() instants (NaN if none ran then)."""
        inside = sorted(cpu for at, cpu in self.samples if start <= at < end)
        return inside[len(inside) // 2] if inside else math.nan

    def reference_cpu_s(self, windows: list, interval_s: float) -> float | None:
        """The unit's CPU seconds at the mean speed of the given (start, end) windows: 1 / the mean over their
        intervals of 1 / the interval's median, so that trace() over the same windows averages 1 (None without
        samples)."""
        inverse = [1.0 / cpu for a, b in windows for cpu in self._medians(a, b, interval_s) if cpu == cpu]
        return len(inverse) / sum(inverse) if inverse else None

    def _medians(self, start: float, end: float, interval_s: float) -> list[float]:
        medians, at = [], start
        while at < end:
            medians.append(self.unit_cpu_s(at, at + interval_s))
            at += interval_s
        return medians

    def trace(self, start: float, end: float, interval_s: float, reference_cpu_s: float) -> list[float]:
        """The speed in each interval_s from start to end, relative to a reference (a unit's CPU seconds at the
        speed 1): reference / the interval's median (an interval without samples repeats the one before)."""
        speeds: list[float] = []
        for cpu in self._medians(start, end, interval_s):
            speeds.append(reference_cpu_s / cpu if cpu == cpu else (speeds[-1] if speeds else 1.0))
        return speeds
