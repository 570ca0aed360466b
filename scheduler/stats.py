"""Per-step figures: the lists the frontend turns into histograms, and the periodic throughput log line."""

from __future__ import annotations

import logging
import time

from common.messages import SchedulerStats, StepPlan

log = logging.getLogger("shuttle.scheduler")


class StepStats:
    """Accumulates what each step did; `attach()` moves the per-step lists into a stats message.

    Args:
        log_interval: seconds between throughput log lines while the scheduler is busy.
    """

    def __init__(self, log_interval: float = 5.0):
        self.log_interval = log_interval
        self._batch_sizes: list[int] = []
        self._token_counts: list[int] = []
        self._window_start = time.monotonic()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._num_admitted = 0
        self._num_scheduled_tokens = 0

    def on_step(self, num_seqs: int, num_tokens: int, num_prompt_tokens: int, num_sampled: int) -> None:
        self._batch_sizes.append(num_seqs)
        self._token_counts.append(num_tokens)
        self._prompt_tokens += num_prompt_tokens
        self._generated_tokens += num_sampled

    def on_plan(self, plan: StepPlan) -> None:
        """Count what left the waiting queue with this plan: new requests, and preempted ones resumed."""
        self._num_admitted += len(plan.new_requests) + sum(1 for c in plan.cached_requests if c.resumed)
        self._num_scheduled_tokens += sum(r.num_scheduled_tokens for r in plan.new_requests) + sum(
            c.num_scheduled_tokens for c in plan.cached_requests)

    def attach(self, stats: SchedulerStats) -> SchedulerStats:
        stats.step_batch_sizes, self._batch_sizes = self._batch_sizes, []
        stats.step_token_counts, self._token_counts = self._token_counts, []
        stats.num_admitted, stats.num_scheduled_tokens = self._num_admitted, self._num_scheduled_tokens
        return stats

    def maybe_log(self, stats: SchedulerStats) -> None:
        """Every log_interval seconds, if anything ran: prompt and generation throughput, queue and KV state."""
        elapsed = time.monotonic() - self._window_start
        if elapsed < self.log_interval:
            return
        if self._prompt_tokens or self._generated_tokens or stats.num_running or stats.num_waiting:
            hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            log.info("prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, waiting %d, "
                     "KV cache usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d",
                     self._prompt_tokens / elapsed, self._generated_tokens / elapsed, stats.num_running,
                     stats.num_waiting, 100.0 * stats.num_blocks_in_use / max(stats.num_total_blocks, 1),
                     100.0 * hit_rate, stats.num_preemptions)
        self._window_start = time.monotonic()
        self._prompt_tokens = self._generated_tokens = 0
