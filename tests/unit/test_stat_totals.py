"""frontend/observability/stat_totals.py: the scheduler's counters, as the frontend shows them, never go down across
scheduler restarts, announced (the launcher's engine_down) or not."""

from shuttle.common.messages import SchedulerStats
from shuttle.frontend.observability.stat_totals import COUNTERS, StatTotals


def test_every_cumulative_field_of_scheduler_stats_is_carried():
    gauges_and_step_lists = {"num_waiting", "num_running", "num_free_blocks", "num_cached_blocks",
                             "num_total_blocks", "num_blocks_in_use", "step_batch_sizes", "step_token_counts",
                             "step_decode_token_counts", "spec_accepted_per_pos", "lora_running", "lora_waiting"}
    assert set(COUNTERS) | gauges_and_step_lists == set(SchedulerStats.__struct_fields__)


def test_counts_of_a_restarted_scheduler_add_to_the_old_ones_and_gauges_do_not():
    totals = StatTotals()
    shown = totals.add(SchedulerStats(prefix_cache_queries=27, prefix_cache_hits=9, num_running=3, num_steps=40))
    assert (shown.prefix_cache_queries, shown.num_running) == (27, 3)
    down = totals.restarted()  # the launcher: the engine stopped
    assert (down.prefix_cache_queries, down.prefix_cache_hits, down.num_steps, down.num_running) == (27, 9, 40, 0)
    shown = totals.add(SchedulerStats(prefix_cache_queries=5, num_running=1, num_steps=2))
    assert (shown.prefix_cache_queries, shown.prefix_cache_hits, shown.num_steps, shown.num_running) == (32, 9, 42, 1)


def test_an_unannounced_restart_is_found_by_a_counter_that_fell():
    totals = StatTotals()
    totals.add(SchedulerStats(num_admitted=100, num_scheduled_tokens=5000))
    shown = totals.add(SchedulerStats(num_admitted=3, num_scheduled_tokens=90))
    assert (shown.num_admitted, shown.num_scheduled_tokens) == (103, 5090)
    shown = totals.add(SchedulerStats(num_admitted=4, num_scheduled_tokens=95))
    assert (shown.num_admitted, shown.num_scheduled_tokens) == (104, 5095)


def test_accepted_drafts_per_position_are_carried_position_by_position():
    totals = StatTotals()
    totals.add(SchedulerStats(spec_num_drafts=4, spec_num_accepted_tokens=5, spec_accepted_per_pos=[3, 2, 0]))
    totals.restarted()
    shown = totals.add(SchedulerStats(spec_num_drafts=1, spec_num_accepted_tokens=1, spec_accepted_per_pos=[1, 0, 0]))
    assert (shown.spec_num_drafts, shown.spec_num_accepted_tokens, shown.spec_accepted_per_pos) == (5, 6, [4, 2, 0])
