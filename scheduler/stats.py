"""Per-step figures: the lists the frontend turns into histograms, and the periodic throughput log line."""

from __future__ import annotations

import logging
import time

import msgspec

from shuttle.common.messages import SchedulerStats

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
        self._decode_counts: list[int] = []
        self._window_start = time.monotonic()
        self._prompt_tokens = 0
        self._generated_tokens = 0
        self._drafts_at_window_start = (0, 0, 0)  # (draft tokens, accepted, drafts) counted before this window

    def on_step(self, num_seqs: int, num_tokens: int, num_prompt_tokens: int, num_sampled: int,
                num_decode_tokens: int = 0) -> None:
        """Record one settled step: `num_tokens` computed, of which `num_prompt_tokens` prompt tokens and
        `num_decode_tokens` decodes; `num_sampled` tokens sampled."""
        self._batch_sizes.append(num_seqs)
        self._token_counts.append(num_tokens)
        self._decode_counts.append(num_decode_tokens)
        self._prompt_tokens += num_prompt_tokens
        self._generated_tokens += num_sampled

    def attach(self, stats: SchedulerStats) -> SchedulerStats:
        """A copy of `stats` carrying the per-step lists gathered since the last call (`stats` itself when
        no step ran since)."""
        if not self._batch_sizes:
            return stats
        message = msgspec.structs.replace(stats, step_batch_sizes=self._batch_sizes,
                                          step_token_counts=self._token_counts,
                                          step_decode_token_counts=self._decode_counts)
        self._batch_sizes, self._token_counts, self._decode_counts = [], [], []
        return message

    def _acceptance(self, stats: SchedulerStats) -> str:
        """The stats line's tail under --speculative-config: this window's draft acceptance rate ("" if none)."""
        drafted = stats.spec_num_draft_tokens - self._drafts_at_window_start[0]
        if not drafted:
            return ""
        accepted = stats.spec_num_accepted_tokens - self._drafts_at_window_start[1]
        drafts = stats.spec_num_drafts - self._drafts_at_window_start[2]
        return (f", draft acceptance rate {100.0 * accepted / drafted:.1f}% ({accepted} of {drafted}), mean "
                f"acceptance length {1 + accepted / max(drafts, 1):.2f}")

    def maybe_log(self, stats: SchedulerStats) -> None:
        """Every log_interval seconds, if anything ran: prompt and generation throughput, queue and KV state."""
        elapsed = time.monotonic() - self._window_start
        if elapsed < self.log_interval:
            return
        if self._prompt_tokens or self._generated_tokens or stats.num_running or stats.num_waiting:
            hit_rate = stats.prefix_cache_hits / stats.prefix_cache_queries if stats.prefix_cache_queries else 0.0
            log.info("prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, running %d, waiting %d, "
                     "KV cache usage %.1f%%, prefix cache hit rate %.1f%%, preemptions %d%s",
                     self._prompt_tokens / elapsed, self._generated_tokens / elapsed, stats.num_running,
                     stats.num_waiting, 100.0 * stats.num_blocks_in_use / max(stats.num_total_blocks, 1),
                     100.0 * hit_rate, stats.num_preemptions, self._acceptance(stats))
        self._window_start = time.monotonic()
        self._prompt_tokens = self._generated_tokens = 0
        self._drafts_at_window_start = (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens,
                                        stats.spec_num_drafts)
