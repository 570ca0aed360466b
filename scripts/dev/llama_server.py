"""llama.cpp as a peer of the benchmarks: a model converted to GGUF by llama.cpp's own converter, and its HTTP server
(llama-server, built by scripts/dev/build_llama_server.sh) run as a process of its own and stopped by PID.

Both come from the llama.cpp source tree that llama-cpp-python's source distribution ships (unpacked under
.venv/llama-cpp-src by build_llama_server.sh or install_llama_cpp.sh).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from peer_server import PeerServer, free_port  # scripts/dev, this script's own directory

REPO = Path(__file__).resolve().parents[2]

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


class LlamaServer(PeerServer):
    """llama-server on one GGUF model with continuous batching: `slots` parallel sequences of at most
    `context_per_slot` tokens each, `threads` threads for both decode and prompt batches. A context manager that
    starts it in a session of its own, waits for /health, and stops it (SIGTERM, then SIGKILL) by PID.

    Attributes:
        url: http://127.0.0.1:PORT, the OpenAI-compatible API (/v1/completions, /v1/models).

    Raises:
        FileNotFoundError: no llama-server binary (run scripts/dev/build_llama_server.sh).
        RuntimeError: it exited or did not answer /health within `start_timeout` seconds.
    """

    name = "llama-server"

    def __init__(self, gguf: Path, slots: int, context_per_slot: int, threads: int,
                 binary: Path = LLAMA_SERVER, start_timeout: float = 300.0):
        if not binary.exists():
            raise FileNotFoundError(f"{binary}: run scripts/dev/build_llama_server.sh")
        port = free_port()
        super().__init__([str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                          "--parallel", str(slots), "--ctx-size", str(slots * context_per_slot),
                          "--threads", str(threads), "--threads-batch", str(threads), "--cont-batching",
                          "--no-webui"], port, start_timeout)
