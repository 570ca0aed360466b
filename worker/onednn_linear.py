"""float32 linear layers on a CPU computed by oneDNN's matmul instead of torch's default CPU GEMM.

Why. torch 2.13's `F.linear` on a CPU calls MKL's sgemm, which packs the weight into its kernel's layout on every
call and, at a decode step's few rows, runs each layer on one thread whatever torch.get_num_threads() says: the
step re-streams its weights at one core's bandwidth and leaves the other cores idle. oneDNN (torch.ops.mkldnn, the
library torch's inductor uses for frozen CPU linears, and vLLM's CPU backend for its own) threads every row count
and reads the row-major [N, K] weight in place. Measured on a 2-core AVX2 CPU, a pass over the 110M Llama shape's
85 linears (scripts/dev/bench_cpu_linears.py; the table is in docs/operations.md) took, as a fraction of MKL's
time: on 2 threads 0.57 at one row, 0.48-0.68 at 2-64 rows and 0.82-0.91 at 256-2048 (prefill chunks); on 1
thread 0.81-0.91.

Small layers stay on `F.linear`: oneDNN costs about 25 us more a call (2 threads, weights in cache: a 64 x 64
layer 31 against 4 us at one row, 256 x 256 33 against 9 us, 512 x 512 42 against 25 us, 1024 x 512 55 against
46 us, 2048 x 768 80 against 134 us), so a pass over stories260K's 36 tiny linears took 2-5x MKL's time. Only
weights of at least MIN_WEIGHT_BYTES go to oneDNN.

The weights stay the layers' own tensors (tied embeddings stay tied, and weights that transformers maps from the
checkpoint stay mapped). Reordering them at load into oneDNN's blocked layout (`_reorder_linear_weight`, as
inductor's freezing does) measured 2-6% faster from 2 rows up on 2 threads, but 1.2x slower at one row and 1.2x
MKL's time at one row on 1 thread, and it holds a second, anonymous copy of every weight beside the mapped one:
not worth it there. On an AVX-512 CPU (Zen 5) the reordered layout was 10-30% faster at every row count (one
thread: 0.70x row-major's time at one row), so it is the next step once the originals can be released.

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
from shuttle.worker.output_projection import LinearWrapper

log = logging.getLogger(__name__)

MIN_WEIGHT_BYTES = 2 << 20  # smaller stay on F.linear (module docstring); the 110M shape's 768 x 768: 2.25 MiB


def onednn_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` by oneDNN's matmul.

    Args:
        rows: [..., K] float32, any strides.
        weight: [N, K] float32; bias: [N] float32 or None.
    Returns:
        float32 [..., N].
    """
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


class OneDnnLinear(LinearWrapper):
    """Wraps a float32 nn.Linear, sharing its weight and bias (so tied embeddings stay tied), and computes it by
    `onednn_linear`: input [..., K] float32, output [..., N] float32."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return onednn_linear(hidden, self.weight, self.bias)


def rounding_bound(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """How far two float32 sums of the same K products `rows @ weight.T (+ bias)` in any orders can differ, output by
    output: 2 K u sum|products| (u = 2^-24; the classic bound of recursive summation, Higham, Accuracy and Stability
    of Numerical Algorithms, 2nd ed., section 4.2).

    Args:
        rows: [M, K] float32; weight: [N, K] float32; bias: [N] float32 or None.
    Returns:
        float32 [M, N].
    """
    return 2 * weight.shape[1] * 2.0 ** -24 * (F.linear(rows.abs(), weight.abs()) + (0 if bias is None else bias.abs()))


def onednn_is_close(linear: torch.nn.Linear, rows: int = 8, seed: int = 0) -> bool:
    """Whether `onednn_linear` gives `F.linear`'s product for `linear` on `rows` random rows within `rounding_bound`."""
    weight, bias = linear.weight, linear.bias
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        difference = (onednn_linear(x, weight, bias) - F.linear(x, weight, bias)).abs()
        return bool((difference <= rounding_bound(x, weight, bias)).all())


def route_float32_linears(model: torch.nn.Module, device: torch.device, tensor_parallel: bool,
                          min_weight_bytes: int | None = None) -> int:
    """On the CPU where torch has oneDNN (not under tensor parallel, whose plan hooks the original modules), wrap
    every float32 nn.Linear of `model` (its lm_head included) whose weight holds at least `min_weight_bytes` (None:
    MIN_WEIGHT_BYTES) in a OneDnnLinear, shape by shape where onednn_is_close holds (the first layer of each shape
    is checked; a failing shape is logged and left as it is). Returns how many layers were wrapped.
    """
    if tensor_parallel or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return 0
    least = MIN_WEIGHT_BYTES if min_weight_bytes is None else min_weight_bytes
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
               and module.weight.numel() * module.weight.element_size() >= least]
    close: dict[tuple[int, int, bool], bool] = {}
    wrapped = 0
    for name, layer in targets:
        shape = (layer.out_features, layer.in_features, layer.bias is not None)
        if shape not in close:
            close[shape] = onednn_is_close(layer)
            if not close[shape]:
                log.info("float32 linears of %d x %d stay on torch's GEMM: oneDNN's product was outside float32 "
                         "rounding of it", shape[0], shape[1])
        if close[shape]:
            replace_module(model, name, OneDnnLinear(layer))
            wrapped += 1
    return wrapped
