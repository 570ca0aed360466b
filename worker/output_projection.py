"""Linear layers computed in column chunks on the CPU: the float32 output projection (lm_head) where torch has no
oneDNN (where it has, worker/onednn_linear.py computes every float32 linear), and every linear layer of a bfloat16
model on a CPU without bf16 matrix units, each chunk of its weights widened to float32.

A decode step multiplies a few dozen rows by the vocabulary projection (768 x 32000 fp32 for a 110M Llama, 98 MB).
On a 2-core AVX2 CPU (torch 2.13, MKL), one `linear` over all 32000 columns ran at 8-64 rows
1.4-1.7x slower than the same product taken 1024 columns at a time (64 rows: 51 vs 32 ms), while at one row both
were equal. Each output column is the same dot product either way, so the logits are bit-identical (a unit test
checks torch.equal); only float32 on the CPU is chunked, where that identity was verified.

bfloat16 on a CPU without amx_bf16 / avx512_bf16 (common/devices.py's flags): torch's bf16 matmul there widens to
float32 internally and ran 3-6x slower than float32's own (12 layers of 2048 x 768 weights, 16-256 rows, 2 threads
on an AVX2-only CPU: 2.5-39.8 against 0.85-6.8 ms a layer); widening the whole weight for each call cost 1.2-3.6x.
Widening WIDEN_CHUNK output rows at a time (768 KB of float32 for a 768-wide layer, which stays in cache for its
matmul) ran at 1.0-1.1x float32 (0.96, 1.87, 6.91 ms), and 0.65-0.83x for a 32000 x 768 lm_head, while the
weights stay resident in bfloat16. Each output is the dot product of bf16 values accumulated in float32, rounded
to bfloat16 once, as a bf16 matmul with float32 accumulation gives it. Up to GEMV_MAX_ROWS rows (a decode step of
a few sequences, bound by the bytes of weights it reads) go to worker/bf16_gemv.py instead, which reads each bf16
weight once and widens it in registers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, cast

import torch
import torch.nn.functional as F

from shuttle.worker.module_swap import replace_module

if TYPE_CHECKING:  # for annotations only: importing transformers here would slow this module's import
    from transformers import PreTrainedModel

CHUNK_COLUMNS = 1024
MIN_COLUMNS = 8 * CHUNK_COLUMNS  # smaller heads gain nothing measurable
WIDEN_CHUNK = 256  # output rows of bf16 weights widened at a time (measured above: 256 and 1024 alike)


class LinearWrapper(torch.nn.Module):
    """A module computing a wrapped linear layer `linear` its own way, exposing its weight and bias (shared, so tied
    embeddings stay tied) as nn.Linear does."""

    def __init__(self, linear: torch.nn.Module):
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:
        return cast(torch.Tensor, self.linear.weight)

    @property
    def bias(self) -> torch.Tensor | None:
        return cast("torch.Tensor | None", self.linear.bias)


class ColumnChunkedLinear(LinearWrapper):
    """Wraps an nn.Linear (sharing its weight and bias, so tied embeddings stay tied) and computes it in chunks of
    `chunk` output features.

    Input [..., in_features] float32; output [..., out_features], equal to `linear(input)` bit for bit. With
    `widen`, input and weights are bfloat16 (or any dtype): each chunk is computed in float32 from the widened input
    and weight rows, and the output [..., out_features] is in the input's dtype.
    """

    def __init__(self, linear: torch.nn.Linear, chunk: int = CHUNK_COLUMNS, widen: bool = False):
        super().__init__(linear)
        self.chunk = chunk
        self.widen = widen
        self.rows_kernel: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
        self.max_kernel_rows = 0  # rows up to which rows_kernel (worker/bf16_gemv.py) computes it
        if widen and linear.weight.dtype == torch.bfloat16:
            from shuttle.worker import bf16_gemv  # numba loads only where bf16 weights are widened
            self.rows_kernel, self.max_kernel_rows = bf16_gemv.bf16_linear_rows, bf16_gemv.GEMV_MAX_ROWS

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if self.rows_kernel is not None and hidden.numel() <= self.max_kernel_rows * weight.shape[1]:
            # a few rows: the weights' bf16 bytes read once, widened in registers (worker/bf16_gemv.py)
            out32 = self.rows_kernel(hidden.reshape(-1, weight.shape[1]), weight)
            if bias is not None:
                out32 += bias.float()
            return out32.to(hidden.dtype).reshape(*hidden.shape[:-1], weight.shape[0])
        out = hidden.new_empty(*hidden.shape[:-1], weight.shape[0])
        rows = hidden.float() if self.widen else hidden  # [..., K]
        for first in range(0, weight.shape[0], self.chunk):
            last = first + self.chunk
            w, b = weight[first:last], None if bias is None else bias[first:last]
            if self.widen:
                w, b = w.float(), None if b is None else b.float()
            out[..., first:last] = F.linear(rows, w, b)  # rounded to out's dtype on the copy
        return out


def widen_bf16_linears(model: torch.nn.Module, device: torch.device, tensor_parallel: bool,
                       has_bf16_units: bool) -> int:
    """On a CPU without bf16 matrix units (`has_bf16_units` False), swap every plain bfloat16 nn.Linear of `model`
    (the output projection included; int8 ones are not nn.Linear) for a widening ColumnChunkedLinear of WIDEN_CHUNK
    rows. Not under tensor parallel (its plan hooks the original modules) nor elsewhere. Returns how many.
    """
    if tensor_parallel or device.type != "cpu" or has_bf16_units:
        return 0
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype == torch.bfloat16]
    for name, linear in targets:
        replace_module(model, name, ColumnChunkedLinear(linear, WIDEN_CHUNK, widen=True))
    return len(targets)


def chunk_output_projection(model: PreTrainedModel, device: torch.device, tensor_parallel: bool) -> bool:
    """Swap the model's lm_head for a ColumnChunkedLinear when it is a plain float32 nn.Linear of at least
    MIN_COLUMNS outputs on the CPU (not under tensor parallel, whose plan hooks the original module).

    Returns whether it was swapped.
    """
    head = model.get_output_embeddings()
    if (tensor_parallel or device.type != "cpu" or type(head) is not torch.nn.Linear
            or head.weight.dtype != torch.float32 or head.out_features < MIN_COLUMNS):
        return False
    wrapper = ColumnChunkedLinear(head)
    try:
        model.set_output_embeddings(wrapper)
    except (AttributeError, NotImplementedError):
        return False
    if model.get_output_embeddings() is not wrapper:  # an architecture that stores its head elsewhere: leave it
        model.set_output_embeddings(head)
        return False
    return True
