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

Weight layout. On an AVX2 CPU the weights stay the layers' own row-major tensors (tied embeddings stay tied, and
weights that transformers maps from the checkpoint stay mapped): reordering them into oneDNN's blocked layout
(`_reorder_linear_weight`, as inductor's freezing and vLLM's CPU backend do) measured 2-6% faster from 2 rows up on
2 threads there, but 1.2x slower at one row. On an AVX-512 CPU (`packs_weights`) the reordered layout measured
10-30% faster at every row count (Zen 5, 2 threads: 14.4 against 16.0 ms at one row, 16.4 against 23.2 at 16; one
thread 14.4 against 20.5 at one row), so there each untied layer computes from a reordered copy and gives its
row-major weight back (`release_weight`): the layer's `weight` becomes a meta tensor of the same shape and dtype,
so counting the model's bytes and reading its shapes still work and reading its values fails loudly. Tied weights
(an lm_head that is the embedding) stay row-major, shared.

Exactness. Each output is the dot product of the same K float32 products, summed in oneDNN's order instead of
MKL's: equal to `F.linear` within float32 rounding, not bit for bit (a one-sequence step's logits are no longer
transformers' to the last bit; its greedy tokens are, which the engine tests hold). `onednn_is_close` checks that
bound at start-up on each weight shape with the layer's own weights; a shape where it fails keeps `F.linear` and
is logged.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections import Counter
from typing import cast

import torch
import torch.nn.functional as F

from shuttle.worker.module_swap import replace_module
from shuttle.worker.output_projection import LinearWrapper

log = logging.getLogger(__name__)

MIN_WEIGHT_BYTES = 2 << 20  # smaller stay on F.linear (module docstring); the 110M shape's 768 x 768: 2.25 MiB
# The row count oneDNN is told to expect when it lays out a reordered weight; every row count computes from it.
PACK_ROWS_HINT = 32
_MADV_DONTNEED = 4  # Linux's madvise(2) advice: drop the pages (a private mapping reads zeros or the file after)


def packs_weights() -> bool:
    """Whether float32 linears on this CPU compute from oneDNN's reordered weight layout: where torch's CPU kernels
    run AVX-512 (module docstring, weight layout)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def reordered_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of the float32 [N, K] `weight` in oneDNN's blocked layout (an opaque tensor `onednn_linear` takes in
    the weight's place), laid out for PACK_ROWS_HINT rows."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


def release_weight(linear: torch.nn.Module) -> None:
    """Give back the memory of `linear`'s weight, which nothing may read again: the weight becomes a meta Parameter
    of the same shape and dtype, and the whole pages of its bytes are dropped first (madvise MADV_DONTNEED, Linux).
    Freeing the tensor alone is not enough: its bytes may lie in a buffer other tensors keep alive (transformers
    loads a checkpoint's tensors out of one), and a freed allocation stays in the allocator's heap. Other tensors'
    bytes sharing the first and last page are left alone."""
    weight = cast(torch.Tensor, linear.weight)
    nbytes = weight.numel() * weight.element_size()
    if sys.platform == "linux":
        first = -(-weight.data_ptr() // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (weight.data_ptr() + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED)
    linear.weight = torch.nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)


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
    """Wraps a float32 nn.Linear and computes it by `onednn_linear`: input [..., K] float32, output [..., N] float32.

    packed=False: from the layer's own weight and bias, shared (so tied embeddings stay tied). packed=True: from a
    copy of the weight reordered into oneDNN's layout; the layer's weight is released (`release_weight`).
    """

    def __init__(self, linear: torch.nn.Module, packed: bool = False):
        super().__init__(linear)
        self.packed_weight: torch.Tensor | None = None
        if packed:
            self.packed_weight = reordered_weight(cast(torch.Tensor, linear.weight))
            release_weight(linear)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.packed_weight if self.packed_weight is not None else self.weight
        return onednn_linear(hidden, weight, self.bias)


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


def onednn_is_close(linear: torch.nn.Linear, rows: int = 8, seed: int = 0, packed: bool = False) -> bool:
    """Whether `onednn_linear` gives `F.linear`'s product for `linear` on `rows` random rows within `rounding_bound`
    (from the weight reordered as OneDnnLinear(packed=True) holds it, with `packed`)."""
    weight, bias = linear.weight, linear.bias
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        operand = reordered_weight(weight) if packed else weight
        difference = (onednn_linear(x, operand, bias) - F.linear(x, weight, bias)).abs()
        return bool((difference <= rounding_bound(x, weight, bias)).all())


def route_float32_linears(model: torch.nn.Module, device: torch.device, tensor_parallel: bool,
                          min_weight_bytes: int | None = None, pack: bool | None = None) -> int:
    """On the CPU where torch has oneDNN (not under tensor parallel, whose plan hooks the original modules), wrap
    every float32 nn.Linear of `model` (its lm_head included) whose weight holds at least `min_weight_bytes` (None:
    MIN_WEIGHT_BYTES) in a OneDnnLinear, shape by shape where onednn_is_close holds (the first layer of each shape
    is checked; a failing shape is logged and left as it is). With `pack` (None: packs_weights()), layers whose
    weight no other module shares compute from a reordered copy and release their own. Returns how many layers
    were wrapped.
    """
    if tensor_parallel or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return 0
    least = MIN_WEIGHT_BYTES if min_weight_bytes is None else min_weight_bytes
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
               and module.weight.numel() * module.weight.element_size() >= least]
    pack = packs_weights() if pack is None else pack
    uses = Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))
    close: dict[tuple[int, int, bool, bool], bool] = {}
    wrapped = packed = 0
    for name, layer in targets:
        packs = pack and uses[id(layer.weight)] == 1
        shape = (layer.out_features, layer.in_features, layer.bias is not None, packs)
        if shape not in close:
            close[shape] = onednn_is_close(layer, packed=packs)
            if not close[shape]:
                log.info("float32 linears of %d x %d stay on torch's GEMM: oneDNN's product was outside float32 "
                         "rounding of it", shape[0], shape[1])
        if close[shape]:
            replace_module(model, name, OneDnnLinear(layer, packed=packs))
            wrapped += 1
            packed += packs
    if packed:
        log.info("%d float32 linear layers compute from weights reordered into oneDNN's layout (an AVX-512 CPU), "
                 "their row-major copies released", packed)
    return wrapped
