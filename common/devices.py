"""Which device each worker process owns, and the dtype and attention backend that `auto` means there.

`--device auto|cpu|cuda|cuda:N` names the first device of the serving groups the launcher starts; the launcher
resolves it once (resolve_config), so that every process reads a concrete device, dtype and backend:
- auto: cuda:0 when torch sees a CUDA device, else cpu;
- one worker process owns one device: rank r of local serving group g (tensor parallel size tp) runs on
  cuda:(N + g * tp + r) (rank_device); on the CPU every rank shares the host;
- too few CUDA devices for groups x ranks is refused before any process starts (check_device_count).

`--dtype auto` is bfloat16 on CUDA; on the CPU bfloat16 when the CPU has bf16 matrix instructions (the flags
amx_bf16 or avx512_bf16 in /proc/cpuinfo, which oneDNN's bf16 matmuls run on; without them torch widens bf16 to fp32
and is slower than fp32), else float32 (auto_dtype_reason says which rule decided; $SHUTTLE_AUTO_CPU_DTYPE, which
the test suite sets to float32 for its fp32 exactness checks, overrides the flags). `--attention-backend auto` is
flex on CUDA and cpu on the CPU (the numba decode kernel).

Nothing here imports torch at module level: the launcher imports this module, and counting CUDA devices imports
torch only on a machine with an NVIDIA driver (cuda_device_count).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

_DEVICE = re.compile(r"^(auto|cpu|cuda)(?::(\d+))?$")

# What `auto` means per device type (on the CPU: without bf16 matrix instructions, cpu_auto_dtype).
AUTO_DTYPE = {"cuda": "bfloat16", "cpu": "float32"}
# CPU flags of instructions that multiply bf16 matrices natively (AMX tiles, AVX-512 BF16 dot products).
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
AUTO_CPU_DTYPE_ENV = "SHUTTLE_AUTO_CPU_DTYPE"  # what --dtype auto means on a CPU, set by hand (the test suite)
AUTO_ATTENTION_BACKEND = {"cuda": "flex", "cpu": "cpu"}


class DeviceError(ValueError):
    """The devices asked for are not there (the message names the flag, what it needs and what was found)."""


def parse_device(text: str) -> str:
    """`--device` value: 'auto', 'cpu', 'cuda' or 'cuda:N' (N >= 0), returned normalised ('cuda' -> 'cuda:0').

    Raises:
        argparse.ArgumentTypeError: anything else (argparse turns it into a one-line usage error).
    """
    match = _DEVICE.match(text.strip().lower())
    if not match or (match.group(2) is not None and match.group(1) != "cuda"):
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (auto, cpu, cuda or cuda:N)")
    kind, index = match.groups()
    return f"cuda:{int(index or 0)}" if kind == "cuda" else kind


def device_type(device: str) -> str:
    """'cpu' or 'cuda' of a resolved device string ('cpu', 'cuda:3')."""
    return device.split(":", 1)[0]


def cuda_device_count() -> int:
    """CUDA devices this process can use. Without an NVIDIA driver on the machine (no /proc/driver/nvidia and no
    /dev/nvidiactl) this is 0 without importing torch, so a CPU machine's launcher stays light."""
    if not (os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl")):
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_device(spec: str, cuda_devices: int) -> str:
    """A concrete first device for `--device spec`: 'auto' is 'cuda:0' when `cuda_devices` > 0, else 'cpu'."""
    spec = parse_device(spec)
    if spec == "auto":
        return "cuda:0" if cuda_devices > 0 else "cpu"
    return spec


def rank_device(first: str, group: int, rank: int, tensor_parallel_size: int) -> str:
    """The device of tensor-parallel rank `rank` of local serving group `group`: cuda:(N + group * tp + rank) from
    first device cuda:N; 'cpu' stays 'cpu' (the ranks share the host)."""
    if device_type(first) == "cpu":
        return "cpu"
    return f"cuda:{int(first.split(':')[1]) + group * tensor_parallel_size + rank}"


def check_device_count(first: str, groups: int, tensor_parallel_size: int, cuda_devices: int) -> None:
    """Refuse when the ranks of `groups` local serving groups do not each get a CUDA device of their own.

    Raises:
        DeviceError: one line naming the devices needed and the number present.
    """
    if device_type(first) == "cpu":
        return
    start = int(first.split(":")[1])
    needed = groups * tensor_parallel_size
    last = start + needed - 1
    if last < cuda_devices:
        return
    ranks = f"{groups} serving group(s) x {tensor_parallel_size} tensor-parallel rank(s)"
    span = f"cuda:{start}" if needed == 1 else f"cuda:{start}..cuda:{last}"
    raise DeviceError(f"--device {first}: {ranks} need one CUDA device each ({span}), but this machine has "
                      f"{cuda_devices} (lower --data-parallel-size / --tensor-parallel-size, or choose --device)")


def cpu_bf16_flags(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, ...]:
    """Which of BF16_CPU_FLAGS this CPU has (none where /proc/cpuinfo cannot be read)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    present = set(line.split(":", 1)[1].split())
                    return tuple(flag for flag in BF16_CPU_FLAGS if flag in present)
    except OSError:
        pass
    return ()


def cpu_auto_dtype(flags: tuple[str, ...] | None = None) -> tuple[str, str]:
    """(dtype, why) of `--dtype auto` on the CPU: $SHUTTLE_AUTO_CPU_DTYPE when set, else bfloat16 when the CPU has
    a bf16 matrix flag (`flags`: cpu_bf16_flags() unless given), else float32."""
    forced = os.environ.get(AUTO_CPU_DTYPE_ENV)
    if forced:
        if forced not in ("float32", "bfloat16", "float16"):
            raise DeviceError(f"${AUTO_CPU_DTYPE_ENV}={forced!r} is not float32, bfloat16 or float16")
        return forced, f"${AUTO_CPU_DTYPE_ENV}={forced}"
    flags = cpu_bf16_flags() if flags is None else flags
    if flags:
        return "bfloat16", f"this CPU has {', '.join(flags)} (bf16 matrix instructions)"
    return "float32", f"this CPU has none of {', '.join(BF16_CPU_FLAGS)} (bf16 would be widened to fp32)"


def resolve_dtype(dtype: str, device: str) -> str:
    """`--dtype auto` on `device`: bfloat16 on CUDA, cpu_auto_dtype() on the CPU; an explicit dtype is kept."""
    if dtype != "auto":
        return dtype
    return cpu_auto_dtype()[0] if device_type(device) == "cpu" else AUTO_DTYPE[device_type(device)]


def auto_dtype_reason(device: str) -> str:
    """The start-up line's account of `--dtype auto` on `device` ("bfloat16 (auto: this CPU has amx_bf16, ...)")."""
    if device_type(device) != "cpu":
        return f"{AUTO_DTYPE[device_type(device)]} (auto on {device_type(device)})"
    dtype, why = cpu_auto_dtype()
    return f"{dtype} (auto: {why}; --dtype float32 or bfloat16 to choose)"


def resolve_attention_backend(name: str, device: str) -> str:
    """`--attention-backend auto` on `device`: flex on CUDA, cpu on the CPU; an explicit name is kept."""
    return AUTO_ATTENTION_BACKEND[device_type(device)] if name == "auto" else name


def resolve_config(config, local_groups: int, cuda_devices: int):
    """`config` (a common.config.ShuttleConfig) with a concrete first device, dtype and attention backend.

    Args:
        local_groups: serving groups this launcher starts (their ranks each need a device).
        cuda_devices: CUDA devices present (cuda_device_count(); tests pass fabricated counts).
    Raises:
        DeviceError: too few CUDA devices, or a CUDA device asked for on a machine without one; --quantization
            that cannot be served (quantization_error below); --speculative-config under tensor parallel.
    """
    first = resolve_device(config.worker.device, cuda_devices)
    check_device_count(first, max(local_groups, 1), config.parallel.tensor_parallel_size, cuda_devices)
    refusal = quantization_error(config.worker.quantization, config.parallel.tensor_parallel_size, device_type(first))
    if refusal:
        raise DeviceError(refusal)
    if config.scheduler.speculative_config is not None and config.parallel.tensor_parallel_size > 1:
        # rank 0 verifies the drafts; the other ranks would need each request's gained tokens shared
        raise DeviceError("--speculative-config runs without tensor parallel only (-tp 1), not "
                          f"-tp {config.parallel.tensor_parallel_size}")
    worker = dataclasses.replace(config.worker, device=first,
                                 attention_backend=resolve_attention_backend(config.worker.attention_backend, first))
    model = dataclasses.replace(config.model, dtype=resolve_dtype(config.model.dtype, first))
    kv_dtype = config.cache.kv_cache_dtype
    cache_dtype = model.dtype if kv_dtype == "auto" else kv_dtype
    if worker.attention_backend == "cpu" and cache_dtype not in CPU_KERNEL_CACHE_DTYPES:
        raise DeviceError(f"--dtype {config.model.dtype} on the CPU: the cpu attention backend's paged kernel reads "
                          f"a {' or '.join(CPU_KERNEL_CACHE_DTYPES)} KV cache; use --dtype bfloat16 (the same size) "
                          f"or float32, or keep it with --kv-cache-dtype bfloat16")
    if kv_dtype not in ("auto", model.dtype) and worker.attention_backend == "flex":
        raise DeviceError(f"--kv-cache-dtype {kv_dtype} with a {model.dtype} model needs the cpu or reference "
                          f"attention backend (flex attends in the model's dtype); drop it or use --dtype {kv_dtype}")
    return dataclasses.replace(config, worker=worker, model=model)


CPU_KERNEL_CACHE_DTYPES = ("float32", "bfloat16")  # the caches worker/decode_kernel.py reads (its CACHE_VIEWS)
QUANTIZATIONS = ("none", "int8")  # --quantization's values (worker/quantization.py)


def quantization_error(method: str, tensor_parallel_size: int = 1, device_type: str = "cpu") -> str | None:
    """Why --quantization `method` cannot be served (None when it can): an unknown method, or int8 under tensor
    parallel or on a device other than the CPU (neither verified)."""
    if method not in QUANTIZATIONS:
        return f"--quantization {method!r} is not supported; choose one of {', '.join(QUANTIZATIONS)}"
    if method == "none":
        return None
    if tensor_parallel_size > 1:
        return f"--quantization {method} runs without tensor parallel only (-tp 1), not -tp {tensor_parallel_size}"
    if device_type != "cpu":
        return f"--quantization {method} runs on the CPU only (--device cpu), not on {device_type}"
    return None
