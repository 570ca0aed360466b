"""The device side of the step-cost roofline (scheduler/step_cost.py): peak FLOP/s and memory bandwidth, measured by a
short microbenchmark on the serving machine or taken from a datasheet for a device that is not present, and the
model side: its dimensions from a Hugging Face config.json."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from shuttle.scheduler.step_cost import Roofline

GB = 1e9
TB = 1e12

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Device:
    """A device's peaks: dense FLOP/s in the serving dtype, memory bandwidth (bytes/s) and memory (bytes)."""

    name: str
    peak_flops: float
    bandwidth: float
    memory_bytes: float
    source: str


# Published dense (no sparsity) BF16 tensor-core FLOP/s and HBM/GDDR bandwidth of the SXM (or only) form factor:
# NVIDIA H100 Tensor Core GPU datasheet (H100 SXM: 989 TFLOPS BF16, 3.35 TB/s, 80 GB; the datasheet's 1,979 is
# with sparsity); NVIDIA H200 Tensor Core GPU datasheet (989 TFLOPS, 4.8 TB/s, 141 GB); NVIDIA A100 Tensor Core
# GPU datasheet (A100 80GB SXM: 312 TFLOPS BF16, 2,039 GB/s); NVIDIA L4 Tensor Core GPU datasheet (121 TFLOPS
# BF16 dense, the 242 quoted with sparsity; 300 GB/s, 24 GB); NVIDIA L40S datasheet (362 TFLOPS BF16 dense, 733
# with sparsity; 864 GB/s, 48 GB); NVIDIA A10 datasheet (125 TFLOPS BF16 dense; 600 GB/s, 24 GB).
SPECS = {
    "h100": Device("h100", 989 * TB, 3.35 * TB, 80 * GB, "NVIDIA H100 SXM datasheet"),
    "h200": Device("h200", 989 * TB, 4.8 * TB, 141 * GB, "NVIDIA H200 SXM datasheet"),
    "a100": Device("a100", 312 * TB, 2.039 * TB, 80 * GB, "NVIDIA A100 80GB SXM datasheet"),
    "l40s": Device("l40s", 362 * TB, 864 * GB, 48 * GB, "NVIDIA L40S datasheet"),
    "l4": Device("l4", 121 * TB, 300 * GB, 24 * GB, "NVIDIA L4 datasheet"),
    "a10": Device("a10", 125 * TB, 600 * GB, 24 * GB, "NVIDIA A10 datasheet"),
}


def spec(name: str) -> Device:
    """The datasheet device called `name` (case-insensitive). Raises ValueError naming the known ones."""
    try:
        return SPECS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown device {name!r}; known: {', '.join(sorted(SPECS))}") from None


def measure(dtype: str = "float32", device: str = "cpu", matmul_size: int = 1024, copy_bytes: int = 256 * 2 ** 20,
            repeats: int = 5) -> Device:
    """The peaks of the device the worker runs on ("cpu", with torch's current thread count: the worker's; or
    "cuda"), measured: the best of `repeats` square matmuls of `matmul_size` in `dtype` (2 n^3 FLOPs) and of
    copies of a `copy_bytes` buffer (each byte read once and written once). Best, not median: a peak is what the
    device can do, a loaded host's slow runs are not. Takes about a second on a CPU."""
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    torch_dtype = getattr(torch, dtype)
    a = torch.randn(matmul_size, matmul_size, dtype=torch_dtype, device=device)
    b = torch.randn(matmul_size, matmul_size, dtype=torch_dtype, device=device)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)

    def best(fn) -> float:
        fn()  # warm-up
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - start)
        return min(times)

    matmul_s = best(lambda: torch.mm(a, b))
    copy_s = best(lambda: dst.copy_(src))
    name = torch.cuda.get_device_name(0) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else 0
    return Device(name, 2 * matmul_size ** 3 / matmul_s, 2 * copy_bytes / copy_s, memory,
                  f"measured: {matmul_size}^2 {dtype} matmul, {copy_bytes >> 20} MiB copy")


def roofline_for(model_dir: str | Path, dtype: str, device: Device) -> Roofline:
    """The model's shape (its config.json) on `device`.

    Raises:
        ValueError: no readable config.json, or one that lacks a dimension the roofline needs.
    """
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
        config = config.get("text_config", config)  # a multimodal wrapper keeps the language model's here
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        return Roofline(hidden=hidden, layers=int(config["num_hidden_layers"]), heads=heads,
                        kv_heads=int(config.get("num_key_value_heads") or heads),
                        head_dim=int(config.get("head_dim") or hidden // heads),
                        intermediate=int(config["intermediate_size"]), vocab=int(config["vocab_size"]),
                        dtype_bytes=DTYPE_BYTES[dtype], peak_flops=device.peak_flops, bandwidth=device.bandwidth,
                        device=device.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: cannot read the model's dimensions ({exc!r})") from None
