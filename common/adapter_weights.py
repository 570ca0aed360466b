"""A LoRA adapter's weights checked before they serve: the safetensors file whole (not cut short) and every value
finite, also once scaled, so that an adapter can never put NaN or infinity into a step it shares with other requests
(or into KV blocks the prefix cache hands on). Read with numpy from the file's own layout (no torch: the frontend
checks adapters loaded at run time, the launcher those of --lora-modules; numpy is imported when a check runs, so
that the launcher's start-up refusals stay free of it).
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

from shuttle.common.errors import ModelDirError
from shuttle.common.model_dir import check_safetensors, safetensors_header

# The delta scale * B @ A must stay finite in float32 (the widest dtype it is computed in), and so in bfloat16,
# which shares float32's exponent range.
FLOAT32_MAX = 3.4028234663852886e38  # numpy.finfo(numpy.float32).max
_FLOAT_TYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}  # safetensors dtype -> numpy's, little-endian
_BF16_EXPONENT = 0x7F80  # a bfloat16 whose exponent bits are all ones is infinite or NaN


def check_adapter_weights(directory: str | Path, rank: int, scale: float) -> None:
    """Check `directory`'s adapter_model.safetensors: its tensors tile the file exactly, every floating-point value
    is finite, and |scale| * rank * max|A| * max|B| (a bound on any entry of the delta scale * B @ A) is below
    float32's largest value.

    Args:
        rank: the adapter's r; scale: lora_alpha / r (or / sqrt(r), rsLoRA), as common/lora.py read_adapter gives.
    Raises:
        ModelDirError: one line naming the adapter and the first fault found.
    """
    path = Path(directory) / "adapter_model.safetensors"
    check_safetensors(path)
    header, length, size = safetensors_header(path, lambda why: ModelDirError(f"{path}: {why}"))
    magnitudes: dict[str, float] = {}
    if size > 8 + length:  # else no tensor data
        with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            for name, info in header.items():
                if name != "__metadata__":
                    begin, end = info["data_offsets"]
                    magnitude = _largest_magnitude(data, 8 + length + begin, end - begin, info["dtype"])
                    if magnitude is not None:
                        magnitudes[name] = magnitude
    largest = {"A": 0.0, "B": 0.0}
    for name, magnitude in magnitudes.items():
        if not math.isfinite(magnitude):
            raise ModelDirError(f"LoRA adapter {directory}: tensor {name!r} holds NaN or infinite values")
        part = "A" if ".lora_A." in name else "B" if ".lora_B." in name else None
        if part is not None:
            largest[part] = max(largest[part], magnitude)
    bound = abs(scale) * rank * largest["A"] * largest["B"]
    if not bound < FLOAT32_MAX:
        raise ModelDirError(f"LoRA adapter {directory}: scale {scale:g} x its weights overflows float32 (a bound "
                            f"of {bound:.3g} on the delta's entries)")


def _largest_magnitude(data: mmap.mmap, offset: int, count: int, dtype: str) -> float | None:
    """max |value| of the tensor of `count` bytes at `offset` (little-endian, as safetensors stores it): NaN when
    any value is NaN or infinite, None when the tensor is empty or not floating point (integers are finite). Its
    views of the mapping end with the call, so the mapping can close."""
    import numpy as np

    raw = np.frombuffer(data, np.uint8, count, offset)
    if dtype == "BF16":
        bits = raw.view("<u2")
        if bool(((bits & _BF16_EXPONENT) == _BF16_EXPONENT).any()):
            return float("nan")
        values = (bits.astype(np.uint32) << 16).view(np.float32)
    elif dtype in _FLOAT_TYPES:
        values = raw.view(_FLOAT_TYPES[dtype])
    else:
        return None
    return float(np.abs(values).max()) if values.size else None
