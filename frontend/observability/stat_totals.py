"""Scheduler counters that never go down while the frontend lives, across scheduler restarts.

A restarted scheduler counts from zero again. Handed on as they come, its totals would fall (Prometheus reads a
fall as a counter reset and double counts, and a sum over serving groups falls with one group's restart), so each
serving group keeps what its earlier schedulers counted and adds it to what the current one reports.
"""

from __future__ import annotations

import msgspec

from shuttle.common.messages import SchedulerStats

# SchedulerStats' cumulative fields; the rest are gauges (queues, blocks) or per-message step lists
COUNTERS = ("num_preemptions", "prefix_cache_queries", "prefix_cache_hits", "num_steps", "num_rejected",
            "num_timed_out", "num_admitted", "num_scheduled_tokens")


class StatTotals:
    """One serving group's counters carried across its schedulers (see the module)."""

    def __init__(self) -> None:
        self._carried = dict.fromkeys(COUNTERS, 0)  # what earlier schedulers counted
        self._last = SchedulerStats()  # the current scheduler's latest report, as it sent it

    def add(self, stats: SchedulerStats) -> SchedulerStats:
        """The scheduler's report with its counters made totals. A counter below the previous report's means a new
        scheduler that nobody announced: the previous one's counts are carried as at restarted()."""
        if any(getattr(stats, name) < getattr(self._last, name) for name in COUNTERS):
            self.restarted()
        self._last = stats
        return msgspec.structs.replace(stats, **{name: getattr(stats, name) + self._carried[name]
                                                 for name in COUNTERS})

    def restarted(self) -> SchedulerStats:
        """The scheduler is gone: carry its counts. Returns the stats to show until the next one reports (empty
        queues and cache, the totals so far)."""
        for name in COUNTERS:
            self._carried[name] += getattr(self._last, name)
        self._last = SchedulerStats()
        return msgspec.structs.replace(SchedulerStats(), **self._carried)
