"""The end-to-end tests' server: launcher/local_server.py's ShuttleServer on the test model, run from the repository
root (tests pass paths relative to it). See that module on the parent-death signal and on OpenMP threads."""

from __future__ import annotations

import os
from pathlib import Path

from shuttle.common.devices import AUTO_CPU_DTYPE_ENV
from shuttle.launcher import local_server
from shuttle.launcher.local_server import pid_alive

__all__ = ["MODEL_DIR", "REPO", "ShuttleServer", "pid_alive"]

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = Path(os.environ.get("SHUTTLE_TEST_MODEL", REPO.parent / "shared" / "models" / "stories260K"))

# The suite's exactness references are fp32 transformers, so `--dtype auto` means float32 in every engine it builds and
# every server it starts (they inherit this environment), also on a CPU whose bf16 units make auto pick bfloat16.
os.environ[AUTO_CPU_DTYPE_ENV] = "float32"


KV_SIZING_FLAGS = ("--kv-cache-memory", "--num-kv-blocks", "--gpu-memory-utilization")
TEST_KV_CACHE_MEMORY = "64MiB"  # 3,275 blocks of stories260K, far more than any test fills


class ShuttleServer(local_server.ShuttleServer):
    """local_server.ShuttleServer with the test model and the repository as defaults, and a 64 MiB KV cache where
    the test does not size it: the CPU default (1 GiB) costs each worker start half a second of zero-filling and the
    suite's live servers a GiB of memory each, for blocks no test uses. `ShuttleServer.launches` is the count its
    base keeps (the suite's budget is about 20: conftest reports it)."""

    def __init__(self, *args: str, model_dir: Path = MODEL_DIR, cwd: Path = REPO, **kwargs):
        if kwargs.get("command", "serve") in ("serve", "engine") and \
                not any(a.split("=")[0] in KV_SIZING_FLAGS for a in args):
            args = (*args, "--kv-cache-memory", TEST_KV_CACHE_MEMORY)
        super().__init__(*args, model_dir=model_dir, cwd=cwd, **kwargs)
