"""Processes sharing cores in virtual time (capacity/shared_cores.py), checked by hand."""

import pytest

from capacity.shared_cores import SharedCores


def run(cores: SharedCores, jobs: list[tuple[str, float]]) -> dict[str, list[float]]:
    """Submit the jobs at 0 and run to the end: each lane's completion times."""
    done: dict[str, list[float]] = {}
    for lane, work in jobs:
        cores.submit(lane, work, lambda t, lane=lane: done.setdefault(lane, []).append(t))
    cores.advance(cores.next_event() * 10)
    return done


def test_a_core_each_without_sharing():
    done = run(SharedCores(("a", "b", "c")), [("a", 1.0), ("b", 2.0), ("c", 3.0), ("a", 1.0)])
    assert done == {"a": [1.0, 2.0], "b": [2.0], "c": [3.0]}  # a lane runs its jobs one after the other


def test_three_busy_processes_on_two_cores_run_at_two_thirds():
    """Each gets 2/3 of a core until the first finishes at 1.5 s; then two run at full speed."""
    cores = SharedCores(("a", "b", "c"), cores=2)
    done = run(cores, [("a", 1.0), ("b", 1.0), ("c", 2.0)])
    assert done == {"a": [pytest.approx(1.5)], "b": [pytest.approx(1.5)], "c": [pytest.approx(2.5)]}
    assert cores.cpu_seconds == pytest.approx({"a": 1.0, "b": 1.0, "c": 2.0})
    assert cores.wait_seconds == pytest.approx({"a": 0.5, "b": 0.5, "c": 0.5})


def test_weights_share_the_cores_unequally_and_no_process_gets_more_than_one():
    """Weight 3 against 1 and 1 on 2 cores: a's share 6/5 is capped at one core, b and c share the other."""
    cores = SharedCores(("a", "b", "c"), cores=2, weights={"a": 3.0})
    done = run(cores, [("a", 1.0), ("b", 1.0), ("c", 1.0)])
    assert done == {"a": [pytest.approx(1.0)], "b": [pytest.approx(1.5)], "c": [pytest.approx(1.5)]}
    assert cores.wait_seconds == pytest.approx({"a": 0.0, "b": 0.5, "c": 0.5})


def test_callbacks_run_at_completion_and_may_submit_more():
    cores = SharedCores(("a", "b"), cores=1)
    seen = []
    cores.submit("a", 1.0, lambda t: (seen.append(("a", t)), cores.submit("b", 0.5, lambda t: seen.append(("b", t)))))
    cores.submit("b", 1.0, lambda t: seen.append(("b first", t)))
    cores.advance(10.0)
    # a and b share one core until 2.0; then b's follow-up runs alone from 2.0 to 2.5
    assert seen == [("a", pytest.approx(2.0)), ("b first", pytest.approx(2.0)), ("b", pytest.approx(2.5))]
    assert cores.now == 10.0 and not cores.busy("a") and not cores.busy("b")


def test_zero_work_on_an_idle_lane_completes_at_once_and_time_only_goes_forward():
    cores = SharedCores(("a",), cores=1)
    seen = []
    cores.submit("a", 0.0, seen.append)
    assert seen == [0.0]
    cores.advance(1.0)
    with pytest.raises(ValueError):
        cores.advance(0.5)
    with pytest.raises(ValueError):
        SharedCores(("a",), cores=1, weights={"a": 0.0})


def test_a_slower_machine_slows_every_process_and_counts_time_on_a_core():
    """At half speed from 0.5 s: a's 1 CPU second (nominal) has 0.5 left, done at 0.5 + 0.5 / 0.5 = 1.5 s, and it
    was on its core 1.5 s; b, sharing nothing, alike."""
    cores = SharedCores(("a", "b"), cores=2)
    done = []
    cores.submit("a", 1.0, done.append)
    cores.submit("b", 1.0, done.append)
    cores.advance(0.5)
    cores.speed = 0.5
    assert cores.next_event() == pytest.approx(1.5)
    cores.advance(2.0)
    assert done == [pytest.approx(1.5), pytest.approx(1.5)]
    assert cores.cpu_seconds == pytest.approx({"a": 1.5, "b": 1.5})
    assert cores.wait_seconds == pytest.approx({"a": 0.0, "b": 0.0})
    with pytest.raises(ValueError):
        cores.speed = 0.0
