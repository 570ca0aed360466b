"""The core and thread rule (common/cpu_threads.py) on fabricated affinity sets, and what the launcher gives each
process (launcher/supervised_unit.py): no server is started."""

import argparse

import pytest

from shuttle.common.cpu_threads import (
    WAIT_SPINS,
    WORKER_THREADS_ENV,
    CoreError,
    cpu_list,
    format_cpu_list,
    other_env,
    parse_cpu_list,
    plan_cores,
    split_cores,
    worker_env,
)
from shuttle.launcher.supervised_unit import Unit, engine_roles


@pytest.mark.parametrize("text, cores", [
    ("0", (0,)), ("0-3,6", (0, 1, 2, 3, 6)), ("6,0-3", (0, 1, 2, 3, 6)), (" 1 , 3-4 ", (1, 3, 4)),
    ("2-2", (2,)), ("0-1,1-2", (0, 1, 2)), ("", ()),
])
def test_cpu_lists_parse_like_taskset(text, cores):
    assert parse_cpu_list(text) == cores


@pytest.mark.parametrize("text", ["a", "3-1", "-1", "0,,1", "1-", "0-3;6", "1.5"])
def test_malformed_cpu_lists_are_refused_by_name(text):
    with pytest.raises(ValueError, match="CPU"):
        parse_cpu_list(text)
    with pytest.raises(argparse.ArgumentTypeError):
        cpu_list(text)


def test_cpu_lists_are_normalised_for_the_config():
    assert format_cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    assert cpu_list("3,0-2,8,9") == "0-3,8-9"


@pytest.mark.parametrize("allowed, workers, threads, others", [
    ({0}, ((0,),), (1,), (0,)),
    ({0, 1}, ((0, 1),), (2,), (0, 1)),  # two cores: nothing set aside, the worker takes both
    ({0, 1, 2, 3}, ((0, 1, 2),), (3,), (3,)),  # more than two: one for the frontend and the scheduler
    ({4, 5, 9, 10, 11}, ((4, 5, 9, 10),), (4,), (11,)),  # from the affinity (taskset, cgroups), not the core count
])
def test_one_worker_takes_the_allowed_cores_less_one_above_two(allowed, workers, threads, others):
    plan = plan_cores(allowed, 1)
    assert (plan.workers, plan.threads, plan.others, plan.pinned) == (workers, threads, others, False)


def test_worker_threads_wins_over_the_core_count():
    assert plan_cores({0, 1, 2, 3}, 1, worker_threads=1).threads == (1,)
    assert plan_cores({0, 1}, 1, worker_threads=2).threads == plan_cores({0, 1}, 1).threads  # default == explicit


@pytest.mark.parametrize("allowed, tp, dp, workers", [
    (range(9), 2, 2, ((0, 1), (2, 3), (4, 5), (6, 7))),  # 8 for the workers, 2 each
    (range(8), 2, 1, ((0, 1, 2, 3), (4, 5, 6))),  # uneven: the first slices one longer
    (range(4), 2, 2, ((0,), (1,), (2,), (0,))),  # fewer cores than workers: one each, round-robin
    ((0, 1), 1, 3, ((0,), (1,), (0,))),
])
def test_tensor_and_data_parallel_workers_split_the_cores(allowed, tp, dp, workers):
    plan = plan_cores(allowed, tp * dp)
    assert plan.workers == workers
    assert plan.threads == tuple(len(share) for share in workers)
    assert sum(plan.threads) <= max(len(allowed) - (len(allowed) > 2), len(workers))  # never oversubscribed


def test_worker_cores_pin_the_workers_and_send_the_rest_elsewhere():
    plan = plan_cores(range(8), 2, worker_cores="0-3,6")
    assert plan.pinned
    assert plan.workers == ((0, 1, 2), (3, 6))
    assert plan.threads == (3, 2)
    assert plan.others == (4, 5, 7)
    assert "pinned" in plan.describe()
    assert plan.describe({}) == ("2 worker(s): 2 threads on cores 3,6, bound one per core; 3 threads on cores 0-2, "
                                 "bound one per core (pinned; frontend and scheduler on 4-5,7)")
    assert "bound" not in plan.describe({"OMP_PROC_BIND": "false"})
    assert plan_cores({0, 1}, 1, worker_cores="1").describe() == \
        "worker: 1 thread on core 1 (pinned; frontend and scheduler on 0)"
    every = plan_cores({0, 1}, 1, worker_cores="0-1")  # no core left: the frontend and scheduler stay unpinned
    assert every.others == (0, 1)
    assert every.describe() == ("worker: 2 threads on cores 0-1 (pinned; frontend and scheduler unpinned: "
                                "--worker-cores leaves no other core)")


def test_worker_cores_outside_the_affinity_are_refused():
    with pytest.raises(CoreError, match="2-3"):
        plan_cores({0, 1}, 1, worker_cores="0-3")


def test_split_cores_of_no_workers():
    assert split_cores((0, 1), 0) == ()  # --data-parallel-size 0: only remote groups


def test_the_worker_environment_sizes_every_pool_and_spins_briefly_when_idle():
    env = worker_env({"PATH": "/bin", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "ACTIVE"}, 3)
    assert env["PATH"] == "/bin"
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["NUMBA_NUM_THREADS"] == "3"
    assert env[WORKER_THREADS_ENV] == "3"  # a stale OMP_NUM_THREADS from the shell does not survive
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and env["KMP_BLOCKTIME"] == "0"
    assert env["GOMP_SPINCOUNT"] == str(WAIT_SPINS) and "GOMP_SPINCOUNT" not in other_env({})
    assert worker_env({"GOMP_SPINCOUNT": "0"}, 2)["GOMP_SPINCOUNT"] == "0"  # the operator's own count
    assert other_env({})["OMP_NUM_THREADS"] == "1" and other_env({})["OMP_WAIT_POLICY"] == "PASSIVE"


def test_a_worker_with_a_core_per_thread_of_its_own_is_bound_to_them():
    alone = Unit("engine", engine_roles(1), group=0, cores=plan_cores({0, 1}, 1))
    env, cores = alone._placement("worker", 0, 1, {})
    assert env["OMP_PROC_BIND"] == "close" and "OMP_PLACES" not in env and cores == (0, 1)  # unpinned, still bound
    split = Unit("engine", engine_roles(2), group=0, cores=plan_cores(range(5), 2))  # 4 for the workers, 2 each
    assert [split._placement(f"worker{r}", r, 2, {})[1] for r in (0, 1)] == [(0, 1), (2, 3)]
    assert split._placement("scheduler", None, 2, {}) == (other_env({}), ())  # the others stay unpinned
    assert "OMP_PROC_BIND" not in other_env({}) and "OMP_PROC_BIND" not in worker_env({}, 2)


def test_a_worker_sharing_cores_or_threads_is_left_to_the_kernel():
    shared = plan_cores({0, 1}, 3)  # fewer cores than workers: core 0 serves two of them
    assert not shared.exclusive and plan_cores(range(5), 2).exclusive
    assert not shared.binds(0, {})
    assert not plan_cores({0, 1}, 1, on_cpu=False).binds(0, {})  # a GPU worker's threads stay free
    for threads in (1, 4):  # --worker-threads other than the slice's size
        assert not plan_cores({0, 1}, 1, worker_threads=threads).binds(0, {})
    for own in ({"OMP_PROC_BIND": "false"}, {"OMP_PLACES": "cores"}):  # the operator's own setting wins
        env, cores = Unit("engine", engine_roles(1), group=0, cores=plan_cores({0, 1}, 1))._placement(
            "worker", 0, 1, own)
        assert cores == () and env.get("OMP_PROC_BIND") == own.get("OMP_PROC_BIND")


def test_each_process_of_a_unit_gets_its_own_threads_and_cores():
    plan = plan_cores(range(6), 4, worker_cores="0-3")  # 2 groups x 2 ranks, a core each
    unit = Unit("engine of group 1", engine_roles(2), group=1, cores=plan)
    env, cores = unit._placement("worker1", 1, 2, {"OMP_NUM_THREADS": "8"})
    assert cores == (3,) and env["OMP_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    env, cores = unit._placement("scheduler", None, 2, {})
    assert cores == (4, 5) and env["OMP_NUM_THREADS"] == "1"
    unpinned = Unit("engine", engine_roles(1), group=0, cores=plan_cores({0, 1}, 1))
    env, cores = unpinned._placement("worker", 0, 1, {})
    assert cores == (0, 1) and env["OMP_NUM_THREADS"] == "2"  # its slice is every core: bound there (rule 5)
    assert Unit("frontend", ("frontend",))._placement("frontend", None, 1, {"X": "1"}) == ({"X": "1"}, ())
