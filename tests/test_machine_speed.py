"""The machine's speed: traced by a monitor process, attached to a profile for the simulator."""

import math
import time

import pytest

from capacity.machine_speed import SpeedMonitor, with_speed_trace
from common.step_cost import StepCostModel


def test_speed_monitor_traces_the_speed_relative_to_a_reference():
    """A second of monitoring at 20 ms: its unit of work ran about 50 times; the trace over the same window,
    relative to that window's own reference, averages 1 (a harmonic mean); relative to a unit twice as long
    it reads twice as fast."""
    with SpeedMonitor(period_s=0.02) as monitor:
        start = time.monotonic()
        time.sleep(1.0)
        end = time.monotonic()
    assert 25 <= sum(start <= at < end for at, _ in monitor.samples) <= 55
    reference = monitor.reference_cpu_s([(start, end)], 0.25)
    trace = monitor.trace(start, end, 0.25, reference)
    assert len(trace) == math.ceil((end - start) / 0.25)
    # exactly 1 when every interval has samples; one without (here the last, a fraction of a millisecond long)
    # repeats the one before, which the reference leaves out
    assert sum(trace) / len(trace) == pytest.approx(1.0, abs=0.05)
    doubled = monitor.trace(start, end, 0.25, 2 * reference)
    assert doubled == pytest.approx([2 * v for v in trace])
    assert monitor.reference_cpu_s([(end + 10, end + 11)], 0.25) is None  # no samples then


def test_with_speed_trace_keeps_only_the_fresh_part_of_the_step_jitter():
    """sigma 0.2 with 36% of its variance persisting: the trace carries the persistent part, 0.2 x sqrt(0.64) is
    left to draw afresh per step."""
    cost = StepCostModel({"step": 0.01}, jitter=0.2, jitter_slow_share=0.36, jitter_memory_s=0.4)
    traced = with_speed_trace(cost, [0.9, 1.1], 0.5)
    assert traced.speed_trace == [0.9, 1.1] and traced.speed_interval_s == 0.5
    assert traced.jitter == pytest.approx(0.16)
    assert traced.jitter_slow_share == 0.0 and traced.jitter_memory_s == 0.0
    for trace, interval in (([], 0.5), ([1.0, 0.0], 0.5), ([1.0], 0.0)):
        with pytest.raises(ValueError):
            with_speed_trace(cost, trace, interval)
