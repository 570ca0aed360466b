"""float32 linear layers on a CPU computed by oneDNN's matmul instead of torch's default CPU GEMM.

Why. torch 2.13's `F.linear` on a CPU calls MKL's sgemm, which packs the weight into its kernel's layout on every
call and, at a decode step's few rows, runs each layer on one thread whatever torch.get_num_threads() says: the
step re-streams its weights at one core's bandwidth and leaves the other cores idle. oneDNN (torch.ops.mkldnn, the
library torch's inductor uses for frozen CPU linears, and vLLM's CPU backend for its own) threads every row count.
With 2 or more threads each weight is reordered once at load into oneDNN's blocked layout (`_reorder_linear_weight`;
the row-major original is freed with the layer it replaces). Measured on a 2-core AVX2 CPU, a pass over the 110M
Llama shape's 85 linears (scripts/dev/bench_cpu_linears.py; the table is in docs/operations.md), as a fraction of
MKL's time: on 2 threads 0.46-0.66 at 2-64 rows, 0.77-0.90 at 256-2048 (prefill chunks) and 0.67 at one row from
reordered weights, as fast as row-major ones or faster from 2 rows up (0.57 at one row). On 1 thread the reordered
layout was 1.2x MKL at one row, so there the weights stay row-major (0.81-0.91x MKL at every row count).

A weight another module shares (a lm_head tied to the input embeddings) is never reordered, which would hold a
second copy: oneDNN reads it row-major, in place.

Exactness. Each output is the dot product of the same K float32 products, summed in oneDNN's order instead of
MKL's: equal to `F.linear` within float32 rounding, not bit for bit (a one-sequence step's logits are no longer
transformers' to the last bit; its greedy tokens are, which the engine tests hold). `onednn_is_close` checks that
bound at start-up on each weight shape with the layer's own weights; a shape where it fails keeps `F.linear` and
is logged.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from shuttle.worker.module_swap import replace_module

log = logging.getLogger(__name__)


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` by oneDNN's matmul.

    Args:
        rows: [..., K] float32, any strides.
        weight: [N, K] float32; bias: [N] float32 or None.
    Returns:
        float32 [..., N].
    """
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


# The row count oneDNN is told to expect when it lays out a reordered weight: a decode step of a few dozen sequences.
# Any row count computes from that layout.
ROWS_HINT = 32


class OneDnnLinear(torch.nn.Module):
    """A float32 linear layer computed by `onednn_linear`: input [..., K] float32, output [..., N] float32.

    `weight` [N, K] float32: the wrapped layer's own Parameter unless `reorder` (so tied embeddings stay tied), else
    a reordered copy (layout torch._mkldnn: it reports its shape, dtype and bytes, but only oneDNN reads its values;
    the original is freed with the replaced layer). `bias` [N] float32 or None, the wrapped layer's.
    """

    def __init__(self, linear: torch.nn.Linear, reorder: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight if not reorder else torch.nn.Parameter(
            torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT), requires_grad=False)
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return onednn_linear(hidden, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, " \
               f"reordered={self.weight.is_mkldnn}"


def onednn_is_close(linear: torch.nn.Linear, rows: int = 8, seed: int = 0) -> bool:
    """Whether `onednn_linear` gives `F.linear`'s product for `linear` on `rows` random rows within the bound two
    float32 sums of the same K products in any orders can differ by: 2 K u sum|products| (u = 2^-24; the classic
    bound of recursive summation, Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2)."""
    weight, bias = linear.weight, linear.bias
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        bound = 2 * weight.shape[1] * 2.0 ** -24 * (
            F.linear(x.abs(), weight.abs()) + (0 if bias is None else bias.abs()))
        return bool(((onednn_linear(x, weight, bias) - F.linear(x, weight, bias)).abs() <= bound).all())


def route_float32_linears(model: torch.nn.Module, device: torch.device, tensor_parallel: bool, threads: int) -> int:
    """On the CPU where torch has oneDNN (not under tensor parallel, whose plan hooks the original modules), replace
    every float32 nn.Linear of `model` (its lm_head included) by a OneDnnLinear, shape by shape where
    onednn_is_close holds (the first layer of each shape is checked; a failing shape is logged and left as it is).
    Weights are reordered at `threads` >= 2, except one another module also holds (module docstring). Returns how
    many layers were replaced.
    """
    if tensor_parallel or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return 0
    holders: dict[int, int] = {}  # id of a Parameter -> how many modules hold it
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32]
    close: dict[tuple[int, int, bool], bool] = {}
    replaced = 0
    for name, layer in targets:
        shape = (layer.out_features, layer.in_features, layer.bias is not None)
        if shape not in close:
            close[shape] = onednn_is_close(layer)
            if not close[shape]:
                log.info("float32 linears of %d x %d stay on torch's GEMM: oneDNN's product was outside float32 "
                         "rounding of it", shape[0], shape[1])
        if close[shape]:
            reorder = threads >= 2 and holders[id(layer.weight)] == 1
            replace_module(model, name, OneDnnLinear(layer, reorder))
            replaced += 1
    return replaced
