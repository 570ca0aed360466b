"""llama.cpp as a peer of the benchmarks: a model converted to GGUF by llama.cpp's own converter, and its HTTP server
(llama-server, built by scripts/dev/build_llama_server.sh) run as a process of its own and stopped by PID.

Both come from the llama.cpp source tree that llama-cpp-python's source distribution ships (unpacked under
.venv/llama-cpp-src by build_llama_server.sh or install_llama_cpp.sh).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.process import die_with_parent  # noqa: E402

LLAMA_CPP_SRC = REPO / ".venv" / "llama-cpp-src"
LLAMA_SERVER = LLAMA_CPP_SRC / "build" / "bin" / "llama-server"
GGUF_CACHE = Path("/tmp/shuttle-gguf")


def convert_to_gguf(model_dir: str | Path, outtype: str = "f32") -> Path:
    """The model as a GGUF file of `outtype` (f32, bf16 or q8_0: the converter's own names), cached under
    /tmp/shuttle-gguf by the model directory's name.

    Raises:
        RuntimeError: the converter is not unpacked (run scripts/dev/build_llama_server.sh).
        subprocess.CalledProcessError: the converter failed (its output is on stderr).
    """
    converters = sorted(LLAMA_CPP_SRC.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not converters:
        raise RuntimeError("llama.cpp's converter is missing: run scripts/dev/build_llama_server.sh (or "
                           "install_llama_cpp.sh), which unpack it")
    out = GGUF_CACHE / f"{Path(model_dir).resolve().name}-{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial")
        subprocess.run([sys.executable, str(converters[-1]), str(model_dir), "--outfile", str(partial),
                        "--outtype", outtype], check=True, stdout=subprocess.DEVNULL)
        partial.rename(out)  # a conversion cut short leaves no file that looks finished
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (another process may take it before the server does)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """llama-server on one GGUF model with continuous batching: `slots` parallel sequences of at most
    `context_per_slot` tokens each, `threads` threads for both decode and prompt batches. A context manager that
    starts it in a session of its own, waits for /health, and stops it (SIGTERM, then SIGKILL) by PID.

    Attributes:
        url: http://127.0.0.1:PORT, the OpenAI-compatible API (/v1/completions, /v1/models).

    Raises:
        FileNotFoundError: no llama-server binary (run scripts/dev/build_llama_server.sh).
        RuntimeError: it exited or did not answer /health within `start_timeout` seconds.
    """

    def __init__(self, gguf: Path, slots: int, context_per_slot: int, threads: int,
                 binary: Path = LLAMA_SERVER, start_timeout: float = 300.0):
        if not binary.exists():
            raise FileNotFoundError(f"{binary}: run scripts/dev/build_llama_server.sh")
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                        "--parallel", str(slots), "--ctx-size", str(slots * context_per_slot),
                        "--threads", str(threads), "--threads-batch", str(threads), "--cont-batching",
                        "--no-webui"]
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        self.log = tempfile.TemporaryFile()  # its log: a pipe nobody reads would fill and stall the server
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=die_with_parent)
        deadline = time.monotonic() + self.start_timeout
        try:
            while not self._healthy():
                if self.process.poll() is not None:
                    self.log.seek(0)
                    raise RuntimeError(f"llama-server exited with {self.process.returncode}: "
                                       f"{self.log.read().decode(errors='replace')[-2000:]}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not answer {self.url}/health in {self.start_timeout} s")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
