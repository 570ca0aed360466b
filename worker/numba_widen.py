"""Reading a bfloat16 as float32 inside numba kernels, which have no bfloat16 type.

A kernel gets a bfloat16 tensor viewed as uint16 and calls `widen` on each element where it reads it: a bfloat16 is
the top half of a float32, so the widening is a 16-bit shift and a bit cast, exact. On a float32 element `widen` is
the identity, so one kernel source compiles once per element type and the float32 machine code carries no widening.
Used by worker/decode_kernel.py (a bfloat16 KV cache) and worker/bf16_gemv.py (bfloat16 weights).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


@intrinsic
def float32_of_bits(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits` (an LLVM bitcast)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


def widen(x):
    """float32 of one element inside a numba kernel: itself for a float32, the shifted bits of a bfloat16 stored as
    uint16 (pure Python has no implementation: numba compiles the overload below in its place)."""


@overload(widen, inline="always")
def _widen_overload(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if x == types.uint16:
        return lambda x: float32_of_bits(np.uint32(x) << np.uint32(16))
    return None
