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
            "num_timed_out", "num_admitted", "num_scheduled_tokens", "spec_num_drafts", "spec_num_draft_tokens",
            "spec_num_accepted_tokens")


class StatTotals:
    """One serving group's counters carried across its schedulers (see the module)."""

    def __init__(self) -> None:
        self._carried = dict.fromkeys(COUNTERS, 0)  # what earlier schedulers counted
        self._carried_per_pos: list[int] = []  # and their spec_accepted_per_pos, position by position
        self._last = SchedulerStats()  # the current scheduler's latest report, as it sent it

    def add(self, stats: SchedulerStats) -> SchedulerStats:
        """The scheduler's report with its counters made totals. A counter below the previous report's means a new
        scheduler that nobody announced: the previous one's counts are carried as at restarted()."""
        if any(getattr(stats, name) < getattr(self._last, name) for name in COUNTERS):
            self.restarted()
        self._last = stats
        return msgspec.structs.replace(stats, **{name: getattr(stats, name) + self._carried[name]
                                                 for name in COUNTERS},
                                       spec_accepted_per_pos=_plus(stats.spec_accepted_per_pos, self._carried_per_pos))

    def restarted(self) -> SchedulerStats:
        """The scheduler is gone: carry its counts. Returns the stats to show until the next one reports (empty
        queues and cache, the totals so far)."""
        for name in COUNTERS:
            self._carried[name] += getattr(self._last, name)
        self._carried_per_pos = _plus(self._carried_per_pos, self._last.spec_accepted_per_pos)
        self._last = SchedulerStats()
        return msgspec.structs.replace(SchedulerStats(), **self._carried, spec_accepted_per_pos=self._carried_per_pos)


def _plus(a: list[int], b: list[int]) -> list[int]:
    """Position by position sum of two per-position counts (the shorter one padded with zeros)."""
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]
