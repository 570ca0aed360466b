"""Issue 9 units without processes: the scheduler's admission counts (which the Retry-After estimate feeds on;
its own tests are in test_retry_after.py), the step watchdog, silent frontends, and the scheduler aborting a gone
frontend's requests."""

import time

import pytest

from scheduler.liveness import FrontendWatch, StepWatchdog, WorkerHung
from tests.test_scheduler import make_scheduler, run_step, submit


def test_scheduler_stats_count_admissions_resumptions_and_tokens():


    s = make_scheduler(num_blocks=4, block_size=2)
    submit(s, "a", 2, max_tokens=4, ignore_eos=True)
    submit(s, "b", 2, max_tokens=4, ignore_eos=True)
    run_step(s)  # both admitted: 2 + 2 prompt tokens
    assert (s.stats().num_admitted, s.stats().num_scheduled_tokens) == (2, 4)
    for _ in range(3):  # decodes until the cache runs out: "b" is preempted, later resumed (admitted again)
        run_step(s)
    assert s.num_preemptions >= 1
    while s.has_work:
        run_step(s)
    stats = s.stats()
    assert stats.num_admitted == 2 + s.num_preemptions
    assert stats.num_scheduled_tokens > 4


def test_step_watchdog_fires_only_when_a_step_is_overdue():
    watchdog = StepWatchdog(timeout=0.05)
    watchdog.sent(7)
    watchdog.check()  # just sent: fine
    assert 1 <= watchdog.poll_ms() <= 51
    deadline = time.monotonic() + 30
    with pytest.raises(WorkerHung, match="step 7"):
        while time.monotonic() < deadline:
            watchdog.check()
            time.sleep(0.01)
    StepWatchdog(timeout=0).check()  # 0: no limit


def test_silent_frontend_is_named_once():
    watch = FrontendWatch(timeout=0.0)
    watch.seen(b"a")
    time.sleep(0.001)
    assert watch.gone() == [b"a"]
    assert watch.gone() == []  # named once (and checked at most once a second)


def test_abort_client_frees_every_block_of_that_frontend_only():
    s = make_scheduler()
    for i in range(3):
        submit(s, f"gone{i}", 10, client=b"gone")
    submit(s, "kept", 10, client=b"kept")
    run_step(s)
    assert s.kv.pool.num_free < s.kv.pool.num_blocks
    assert sorted(s.abort_client(b"gone")) == ["gone0", "gone1", "gone2"]
    s.kv.pool.check_invariants()
    assert list(s.requests) == ["kept"]
    assert b"gone" not in s.take_outputs()  # nobody to send them to
    while s.has_work:
        run_step(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks
