"""Issue 9 units without processes: the scheduler's admission counts (which the Retry-After estimate feeds on;
its own tests are in test_retry_after.py), the step watchdog, silent frontends, and the scheduler aborting a gone
frontend's requests."""

import os
import signal
import subprocess
import sys
import time

import pytest

from shuttle.common.messages import FinishReason
from shuttle.common.process import boot_id
from shuttle.scheduler.liveness import FrontendWatch, StepWatchdog, WorkerCpuClocks, WorkerHung
from tests.unit.test_scheduler import make_scheduler, run_step, submit


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


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_step_watchdog_fires_only_when_a_step_is_overdue():
    clock = FakeClock()
    watchdog = StepWatchdog(timeout=5.0, clock=clock)
    watchdog.sent(7)
    watchdog.check()  # just sent: fine
    assert watchdog.poll_ms() == 1000  # bounded: the loop checks at least once a second
    for _ in range(5):
        clock.now += 1.0
        watchdog.check()  # 5.0 s: not over the limit yet
    assert watchdog.poll_ms() == 1
    clock.now += 0.5
    with pytest.raises(WorkerHung, match="step 7"):
        watchdog.check()
    StepWatchdog(timeout=0).check()  # 0: no limit


def test_step_watchdog_does_not_count_time_the_scheduler_was_not_running():
    """A 30 s gap between two checks (the machine paused) counts as MAX_LOOK_GAP_S of the step's time."""
    clock = FakeClock()
    watchdog = StepWatchdog(timeout=5.0, clock=clock)
    watchdog.sent(3)
    clock.now += 30.0
    watchdog.check()  # 2 s counted
    for _ in range(3):
        clock.now += 1.0
        watchdog.check()  # 5 s counted
    clock.now += 0.1
    with pytest.raises(WorkerHung, match="step 3"):
        watchdog.check()


class FakeWork:
    """Per-rank CPU seconds the test moves by hand."""

    def __init__(self, ranks: int):
        self.cpu: list[float | None] = [0.0] * ranks

    def __call__(self) -> list[float | None]:
        return list(self.cpu)


def test_a_slow_step_whose_worker_keeps_using_cpu_is_not_hung():
    """Starved or compiling, the worker's step thread keeps running: 30 s into a 5 s --step-timeout, not hung."""
    clock, work = FakeClock(), FakeWork(2)
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    watchdog.sent(4)
    for _ in range(60):
        clock.now += 0.5
        work.cpu = [c + 0.01 for c in work.cpu]  # a sliver of a core each half second
        watchdog.check()
        assert 1 <= watchdog.poll_ms() <= 1000
    assert watchdog.poll_ms() > 1  # the next deadline is ahead: no busy polling while it waits


def test_a_stopped_rank_is_hung_within_the_step_timeout_even_while_another_works():
    clock, work = FakeClock(), FakeWork(2)
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    watchdog.sent(9)
    watchdog.check()  # the first look, as the loop takes it: the baseline
    for _ in range(10):  # 5 s: rank 1 stopped (SIGSTOP: its CPU time stands still), rank 0 spins in a collective
        clock.now += 0.5
        work.cpu[0] += 0.5
        watchdog.check()
    clock.now += 0.5
    work.cpu[0] += 0.5
    with pytest.raises(WorkerHung, match=r"no progress on step 9 .* rank\(s\) \[1\]"):
        watchdog.check()


def test_a_step_that_keeps_using_cpu_is_hung_after_ten_timeouts():
    clock, work = FakeClock(), FakeWork(1)
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    watchdog.sent(2)
    while clock.now < 100.0 + 50.0:
        clock.now += 0.5
        work.cpu[0] += 0.5
        watchdog.check()
    clock.now += 0.5
    work.cpu[0] += 0.5
    with pytest.raises(WorkerHung, match="step 2 within 10 x 5 s"):
        watchdog.check()


class CountedWork(FakeWork):
    def __init__(self, ranks: int):
        super().__init__(ranks)
        self.reads = 0

    def __call__(self) -> list[float | None]:
        self.reads += 1
        return super().__call__()


def test_short_steps_read_the_workers_cpu_time_twice_a_second_not_once_a_step():
    """At one sequence the loop times about a hundred steps a second; each reading is a /proc read in the
    scheduler's loop, so a step takes the previous step's last reading as its baseline."""
    clock, work = FakeClock(), CountedWork(1)
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    for step in range(200):  # 2 s of 10 ms steps, each looked at twice
        watchdog.sent(step)
        for _ in range(2):
            clock.now += 0.005
            work.cpu[0] += 0.005
            watchdog.check()
    assert 4 <= work.reads <= 5


def test_a_rank_stopped_between_short_steps_is_hung_one_timeout_after_its_last_reading_moved():
    """The stop is seen at most one reading interval (0.5 s) later than with a fresh baseline: the CPU time the rank
    used between the previous step's last reading and its stop counts as progress at the next reading."""
    clock, work = FakeClock(), FakeWork(2)
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    for step in range(30):  # both ranks working through 10 ms steps
        watchdog.sent(step)
        clock.now += 0.01
        work.cpu = [c + 0.01 for c in work.cpu]
        watchdog.check()
    watchdog.sent(30)  # rank 1 stops now; rank 0 spins in a collective
    watched = clock.now
    with pytest.raises(WorkerHung, match=r"no progress on step 30 .* rank\(s\) \[1\]"):
        while clock.now < watched + 10.0:
            clock.now += 0.05
            work.cpu[0] += 0.05
            watchdog.check()
    assert watched + 5.0 < clock.now <= watched + 5.0 + 0.5 + 0.05


def test_an_unreadable_rank_falls_back_to_the_wall_clock():
    clock, work = FakeClock(), FakeWork(1)
    work.cpu = [None]  # the worker on another host
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    watchdog.sent(5)
    for _ in range(10):
        clock.now += 0.5
        watchdog.check()
    clock.now += 0.1
    with pytest.raises(WorkerHung, match="step 5 within 5 s"):
        watchdog.check()


def test_worker_cpu_clocks_read_a_working_process_and_a_stopped_one():
    """The /proc reading itself: this process advances while it spins; a SIGSTOPped busy child stands still;
    another host's boot id, or a process that is gone, reads None."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        clocks = WorkerCpuClocks([(boot_id(), os.getpid()), (boot_id(), busy.pid), ("another-host", busy.pid)])
        first = clocks()
        deadline = time.monotonic() + 30
        while clocks()[1] == first[1] or clocks()[0] == first[0]:  # the tick is 10 ms: spin until both moved
            assert time.monotonic() < deadline, "neither process's CPU time moved in 30 s"
        assert first[2] is None
        busy.send_signal(signal.SIGSTOP)
        while open(f"/proc/{busy.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":  # the stop lands
            assert time.monotonic() < deadline, "the child did not stop"
            time.sleep(0.01)
        stopped = clocks()[1]
        time.sleep(0.3)
        assert clocks()[1] == stopped
    finally:
        busy.kill()
        busy.wait()
    assert clocks()[1] is None  # reaped: gone


def test_silent_frontend_is_named_once():
    clock = FakeClock()
    watch = FrontendWatch(timeout=10.0, clock=clock)
    watch.seen(b"a")
    watch.seen(b"b")
    for _ in range(10):
        clock.now += 1.0
        watch.seen(b"b")  # b heartbeats every second
        assert watch.gone() == []  # a: 10 s silent, not more
    clock.now += 1.0
    assert watch.gone() == [b"a"]  # 11 s
    clock.now += 1.0
    assert watch.gone() == []  # named once


def test_a_pause_of_the_scheduler_is_not_silence_of_its_frontends():
    """The machine stops for 12 s (the scheduler and the frontend alike): on waking, the frontend has not sent its
    next heartbeat yet, and is not taken for gone; it is once it stays silent while the scheduler runs."""
    clock = FakeClock()
    watch = FrontendWatch(timeout=10.0, clock=clock)
    watch.seen(b"a")
    clock.now += 0.5
    assert watch.gone() == []
    clock.now += 12.0  # nobody ran
    assert watch.gone() == []  # 0.5 + 2 s counted
    for _ in range(7):
        clock.now += 1.0
        assert watch.gone() == []  # 9.5 s counted
    clock.now += 1.0
    assert watch.gone() == [b"a"]


def test_abort_client_frees_every_block_of_that_frontend_only():
    s = make_scheduler()
    for i in range(3):
        submit(s, f"gone{i}", 10, client=b"gone")
    submit(s, "kept", 10, client=b"kept")
    run_step(s)
    assert s.kv.pool.num_free < s.kv.pool.num_blocks
    assert sorted(s.abort_client(b"gone", "silent")) == ["gone0", "gone1", "gone2"]
    s.kv.pool.check_invariants()
    assert list(s.requests) == ["kept"]
    # each still gets its one terminal output: a frontend taken for gone that was only slow must not wait forever
    ended = [o for o in s.take_outputs()[b"gone"] if o.finish_reason is not None]
    assert sorted((o.request_id, o.finish_reason, o.error_status, o.error_message) for o in ended) == [
        (f"gone{i}", FinishReason.ERROR, 503, "silent") for i in range(3)]
    while s.has_work:
        run_step(s)
    assert s.kv.pool.num_free == s.kv.pool.num_blocks


def test_a_step_timed_long_after_it_was_sent_gets_a_full_window_from_the_first_look():
    """Overlapped scheduling times step N+1 only once step N returned, maybe a minute after N+1 was sent: the worker
    that keeps working on it is not hung at the first look."""
    clock, work = FakeClock(), FakeWork(1)
    watchdog = StepWatchdog(timeout=5.0, clock=clock, work=work)
    sent = clock.now
    clock.now += 60.0
    watchdog.sent(1, at=sent)
    watchdog.check()  # the first look: a baseline, no verdict
    for _ in range(20):
        clock.now += 0.5
        work.cpu[0] += 0.1
        watchdog.check()
