"""A bound CPU worker's environment (common/cpu_threads.py, rule 5) as GNU OpenMP and numba take it: a process
started the way the launcher starts a worker (its environment from worker_env, its affinity its slice) runs its
first torch and numba parallel regions with one OpenMP thread on each core of the slice, both pools at full size,
and no runtime complains on stderr (an explicit OMP_PLACES made numba's second copy of GNU OpenMP print a warning)."""

import json
import os
import subprocess
import sys

import pytest

from shuttle.common.cpu_threads import allowed_cores, pin, worker_env

PROBE = """
import json, os
import numba, numpy as np, torch
from numba import njit, prange

@njit(parallel=True)
def total(a):
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s

torch.ones(256, 256) @ torch.ones(256, 256)  # torch's pool starts
total(np.ones(4096))  # numba's
threads = {}
for tid in os.listdir("/proc/self/task"):
    with open(f"/proc/self/task/{tid}/status") as status:
        line = next(l for l in status if l.startswith("Cpus_allowed_list"))
    threads[tid] = line.split()[1]
print(json.dumps({"main": threads[str(os.getpid())], "all": sorted(threads.values()),
                  "torch": torch.get_num_threads(), "numba": numba.get_num_threads()}))
"""


@pytest.mark.skipif(len(allowed_cores()) < 2 or not hasattr(os, "sched_setaffinity"),
                    reason="needs two cores this process may use")
def test_a_bound_worker_runs_one_openmp_thread_per_core_of_its_slice():
    slice_ = allowed_cores()[:2]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_", "KMP_"))}
    env = worker_env(base, 2, bind=True)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, preexec_fn=lambda: pin(slice_),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "libgomp" not in result.stderr, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["torch"] == seen["numba"] == 2
    assert seen["main"] == str(slice_[0])  # the main thread is OpenMP's first, on the slice's first core
    assert str(slice_[1]) in seen["all"]  # a pool thread bound to the other core
