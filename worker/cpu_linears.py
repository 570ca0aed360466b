"""How a loaded model's linear layers run on the CPU, for the target model and the draft model alike: float32
layers by oneDNN's matmul (onednn_linear.py), or where torch has no oneDNN the float32 output projection in column
chunks (output_projection.py); bfloat16 layers by oneDNN from reordered weights on an AVX-512 CPU with bf16 units
(onednn_linear.py), widened to float32 where the CPU has no bf16 matrix units (output_projection.py, bf16_gemv.py);
where weights are reordered, each layer's q/k/v and gate/up as one matmul (fused_projections.py). Nothing changes
on CUDA or under tensor parallel.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shuttle.worker.fused_projections import fuse_sibling_projections
from shuttle.worker.onednn_linear import route_linears_to_onednn
from shuttle.worker.output_projection import chunk_output_projection, widen_bf16_linears

if TYPE_CHECKING:  # for annotations only: importing transformers here would slow this module's import
    from transformers import PreTrainedModel

log = logging.getLogger("shuttle.worker")


@dataclass(frozen=True)
class CpuLinears:
    """What prepare_cpu_linears swapped: whether the lm_head is chunked, how many layers are widened / run by
    oneDNN alone / run by oneDNN in groups of siblings, and the bytes of reordered weight copies held beside the
    model's parameters (tied heads), which the model's parameters do not count."""

    chunked_head: bool
    widened: int
    onednn: int
    fused: int = 0
    copied_bytes: int = 0


def prepare_cpu_linears(model: PreTrainedModel, device: torch.device, tensor_parallel: bool,
                        has_bf16_units: bool, threads: int) -> CpuLinears:
    """Swap `model`'s linear layers in place for the CPU's ways of computing them (module docstring), warm up the
    bf16 rows kernel where it is used, and log what was done. `threads`: the worker's intra-op
    thread count."""
    fused = fuse_sibling_projections(model, device, tensor_parallel, has_bf16_units)  # before: it takes nn.Linear
    onednn = route_linears_to_onednn(model, device, tensor_parallel, has_bf16_units)
    if onednn.wrapped:
        log.info("%d linear layers computed by oneDNN's matmul", onednn.wrapped)
    chunked = chunk_output_projection(model, device, tensor_parallel)  # a head oneDNN took is no nn.Linear now
    widened = widen_bf16_linears(model, device, tensor_parallel, has_bf16_units)
    if widened:
        from shuttle.worker import bf16_gemv  # numba loads only where bf16 weights are widened
        log.info("%d bfloat16 linear layers computed in float32 (chunks widened in memory, or up to %d rows "
                 "widened in registers): this CPU has no bf16 matrix units", widened, bf16_gemv.GEMV_MAX_ROWS)
        bf16_gemv.warm_up(threads)
    return CpuLinears(chunked, widened, onednn.wrapped, fused, onednn.copied_bytes)
