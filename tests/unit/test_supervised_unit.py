"""launcher/supervised_unit.py's Unit without a server: how the launcher finds that an engine must go, for a process
of any role that died and for one that is stopped (SIGSTOP: alive, silent). The unit's processes here are `sleep`s;
tests/e2e/test_supervision.py runs the restart that follows on a real server."""

import signal
import subprocess
import time

import pytest

from shuttle.launcher.supervised_unit import Unit, engine_roles


@pytest.fixture
def unit():
    unit = Unit("engine", engine_roles(2))  # worker, worker1, scheduler
    unit.procs = {role: subprocess.Popen(["sleep", "60"]) for role in unit.roles}
    yield unit
    unit.kill()  # reaps every one, stopped or not


def beat_all(unit: Unit, age_s: float = 0.0) -> None:
    unit.heartbeats = {role: time.monotonic() - age_s for role in unit.roles}


@pytest.mark.parametrize("role", ["worker", "worker1", "scheduler"])
def test_a_dead_process_of_any_role_fails_the_unit_by_name(unit, role):
    beat_all(unit)
    assert unit.failure(4.0) is None
    victim = unit.procs[role]
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert unit.failure(4.0) == f"{role} (pid {victim.pid}) was killed by signal SIGKILL"
    assert unit.failure(0.0) == f"{role} (pid {victim.pid}) was killed by signal SIGKILL"  # also while starting
    unit.kill()
    assert [proc.returncode for proc in unit.procs.values()] == [-signal.SIGKILL] * 3


def test_a_stopped_process_is_found_by_its_missing_heartbeat_and_killed(unit):
    stopped = unit.procs["scheduler"]
    stopped.send_signal(signal.SIGSTOP)
    beat_all(unit)
    unit.heartbeats["scheduler"] -= 5.0
    assert unit.failure(0.0) is None  # no heartbeat limit (a unit still starting): a stopped process is alive
    assert unit.failure(6.0) is None  # 5 s of silence is within a 6 s limit
    assert unit.failure(4.0) == f"scheduler (pid {stopped.pid}) sent no heartbeat for 5 s"
    unit.paused(3.0)  # the launcher did not run for 3 of those seconds (the whole group was stopped): not silence
    assert unit.failure(4.0) is None and unit.failure(1.5) is not None
    unit.kill()  # SIGKILL ends a stopped process too, and the unit waits for each
    assert stopped.returncode == -signal.SIGKILL and unit.ready == unit.heartbeats == {}


def test_a_process_that_exits_is_named_with_its_status(unit):
    unit.procs["worker"].kill()
    unit.procs["worker"].wait()
    unit.procs["worker"] = subprocess.Popen(["sh", "-c", "exit 3"])  # as the scheduler's step watchdog exits
    unit.procs["worker"].wait()
    assert unit.failure(0.0) == f"worker (pid {unit.procs['worker'].pid}) exited with status 3"
