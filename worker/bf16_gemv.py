"""A few rows times bfloat16 weights on a CPU without bf16 matrix units, compiled with numba: each weight element is
widened to float32 in registers where it is read, so a decode step at low concurrency streams the weights' bf16 bytes
once and nothing else.

A decode step of a few sequences is bound by the bytes of weights it reads. output_projection.py's widening path
(bf16 rows widened WIDEN_CHUNK at a time into a float32 buffer, then torch's float32 matmul) reads each weight twice
and writes it once in between; this kernel reads it once, half the bytes of float32. Each output is the float32 sum
of the products of bf16 values (exact in float32), summed in a vectorised order, for the caller to round to
bfloat16 once: the same arithmetic as a bf16 matmul with float32 accumulation, up to summation order.

The widening is worker/numba_widen.py's (a bfloat16 is the top half of a float32: a 16-bit shift, exact). numba compiles
on first use and caches the machine code next to this file; `warm_up` compiles it at start-up.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange, set_num_threads

from shuttle.worker.numba_widen import widen

# Rows up to which ColumnChunkedLinear takes this kernel. Its cost grows with the rows (each row's dot products widen
# the weights again), the chunked float32 GEMM's barely: on a 2-core AVX2 CPU, 12 layers of 2304 x 768 bf16 weights
# took 0.31-0.41x the chunked path's time at 1-16 rows, 0.65x at 32, 0.94x at 64 and 1.34x at 128
# (scripts/dev/bench_bf16_gemv.py).
GEMV_MAX_ROWS = 16
_ROW_BLOCK = 64  # weight rows per parallel task


@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True, boundscheck=False)
def _bf16_rows(x, weight_bits, out):
    rows, width = x.shape
    outputs = weight_bits.shape[0]
    for block in prange((outputs + _ROW_BLOCK - 1) // _ROW_BLOCK):
        for j in range(block * _ROW_BLOCK, min(outputs, (block + 1) * _ROW_BLOCK)):
            for i in range(rows):  # the weight row stays in L1 across the rows of x
                total = np.float32(0.0)
                for k in range(width):
                    total += x[i, k] * widen(weight_bits[j, k])
                out[i, j] = total


def bf16_linear_rows(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` with float32 accumulation, reading the bfloat16 weight in place.

    Args:
        rows: [M, K], any float dtype (widened to float32; bf16 -> float32 is exact). Meant for small M.
        weight: bfloat16 [N, K], contiguous rows (an nn.Linear's weight).
    Returns:
        float32 [M, N], unrounded.
    Raises:
        ValueError: weight is not bfloat16 or its width is not K.
    """
    if weight.dtype != torch.bfloat16 or weight.shape[1] != rows.shape[-1]:
        raise ValueError(f"bf16_linear_rows: weight {tuple(weight.shape)} {weight.dtype} against rows "
                         f"{tuple(rows.shape)}")
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.float32)
    _bf16_rows(rows.detach().float().contiguous().numpy(), weight.detach().contiguous().view(torch.uint16).numpy(),
               out.numpy())
    return out


def warm_up(num_threads: int) -> None:
    """Compile (or load the cached compilation) now, not on the first decode step, with `num_threads` threads (the
    first parallel launch sets torch's too: decode_kernel.warm_up says why they are set again)."""
    set_num_threads(max(1, num_threads))
    bf16_linear_rows(torch.ones(1, 2), torch.ones(3, 2, dtype=torch.bfloat16))
    torch.set_num_threads(max(1, num_threads))
