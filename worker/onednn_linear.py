"""Linear layers on a CPU computed by oneDNN's matmul instead of torch's default CPU GEMM: float32 everywhere,
bfloat16 on AVX-512 CPUs with bf16 units.

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
thread 14.4 against 20.5 at one row), so there each layer computes from a reordered copy and gives its row-major
weight back (`release_weight`): the layer's `weight` becomes a meta tensor of the same shape and dtype, so counting
the model's bytes and reading its shapes still work and reading its values fails loudly. A weight another module
shares (an lm_head tied to the embedding) keeps its row-major tensor for the embedding's lookups and the head
computes from a reordered copy beside it, as vLLM's CPU backend does with tied heads: the copy's bytes are counted
(`OneDnnRouting.copied_bytes`). The 110M shape's 32000 x 768 head, 2 threads, one row: 1.89 ms row-major, 1.30
reordered (float32); 1.71 and 0.56 ms (bfloat16).

bfloat16 on an AVX-512 CPU with bf16 units (common/devices.py's flags). torch's `F.linear` in bfloat16 already
runs oneDNN's matmul on the row-major weight; the reordered weight runs its bf16 dot-product instructions from a
layout they stream: a pass over the 110M shape's 85 linears (`scripts/dev/bench_cpu_linears.py --dtype bfloat16`)
took 11.8 against 4.9 ms at one row, 15.1 against 8.1 at 16, 27.3 against 19.6 at 64 on 2 threads (Zen 5), with
outputs equal to `F.linear`'s. The reordered layer wins from 256 x 256 up (23 against 13 us at one row; 64 x 64:
4 against 11 us), so bf16 layers of at least MIN_BF16_WEIGHT_BYTES are reordered. Elsewhere bf16 layers are left
to worker/output_projection.py (widened where the CPU has no bf16 units) or to `F.linear`.

Exactness. Each output is the dot product of the same K float32 products, summed in oneDNN's order instead of
MKL's: equal to `F.linear` within float32 rounding, not bit for bit (a one-sequence step's logits are no longer
transformers' to the last bit; its greedy tokens are, which the engine tests hold); in bfloat16, within that and
one rounding to bfloat16 of each side. `onednn_is_close` checks that bound at start-up on each weight shape with
the layer's own weights; a shape where it fails keeps `F.linear` and is logged.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import sys
from collections import Counter
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from shuttle.worker.module_swap import replace_module
from shuttle.worker.output_projection import LinearWrapper

log = logging.getLogger(__name__)

MIN_WEIGHT_BYTES = 2 << 20  # smaller stay on F.linear (module docstring); the 110M shape's 768 x 768: 2.25 MiB
MIN_BF16_WEIGHT_BYTES = 128 << 10  # smaller bf16 weights stay on F.linear (module docstring): 256 x 256
# The row count oneDNN is told to expect when it lays out a reordered weight; every row count computes from it.
PACK_ROWS_HINT = 32
_MADV_DONTNEED = 4  # Linux's madvise(2) advice: drop the pages (a private mapping reads zeros or the file after)


def packs_weights() -> bool:
    """Whether linears on this CPU compute from oneDNN's reordered weight layout: where torch's CPU kernels run
    AVX-512 (module docstring, weight layout)."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def reordered_weight(weight: torch.Tensor) -> torch.Tensor:
    """A copy of the float32 or bfloat16 [N, K] `weight` in oneDNN's blocked layout (an opaque tensor
    `onednn_linear` takes in the weight's place), laid out for PACK_ROWS_HINT rows."""
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
        rows: [..., K] float32 or bfloat16, any strides.
        weight: [N, K] of rows' dtype, row-major or `reordered_weight`'s; bias: [N] of that dtype or None.
    Returns:
        [..., N] of rows' dtype.
    """
    if torch.compiler.is_compiling():  # worker/cpu_compiled_decode.py: one opaque call in the graph
        return onednn_linear_op(rows, weight, bias, weight.shape[0])
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


@torch.library.custom_op("shuttle::onednn_linear", mutates_args=(),
                         schema="(Tensor rows, Tensor weight, Tensor? bias, SymInt out_features) -> Tensor")
def onednn_linear_op(rows, weight, bias, out_features):
    """`onednn_linear` as an operator torch.compile does not look into: inductor's own lowering of oneDNN's linear
    takes weights it froze itself, not the reordered weights the layers hold. Returns [..., out_features]."""
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


@onednn_linear_op.register_fake
def _onednn_linear_shape(rows, weight, bias, out_features):
    """The operator's output as torch.compile traces it: shape and dtype only."""
    return rows.new_empty((*rows.shape[:-1], out_features))


class OneDnnLinear(LinearWrapper):
    """Wraps a float32 or bfloat16 nn.Linear and computes it by `onednn_linear`: input [..., K], output [..., N], in
    the weight's dtype.

    packed=False: from the layer's own weight and bias, shared (so tied embeddings stay tied). packed=True: from a
    copy of the weight reordered into oneDNN's layout; with `release`, the layer's weight is released
    (`release_weight`), without it (a weight another module reads) it stays beside the copy.
    """

    def __init__(self, linear: torch.nn.Module, packed: bool = False, release: bool = True):
        super().__init__(linear)
        self.packed_weight: torch.Tensor | None = None
        if packed:
            self.packed_weight = reordered_weight(cast(torch.Tensor, linear.weight))
            if release:
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


def agreement_bound(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, ours: torch.Tensor,
                    theirs: torch.Tensor) -> torch.Tensor:
    """How far two products `ours` and `theirs` of `rows @ weight.T (+ bias)` may differ, output by output:
    `rounding_bound` of the operands widened to float32 and, for bfloat16 operands, one rounding of each product to
    bfloat16 (unit roundoff 2^-8, relative to its magnitude).

    Args:
        rows: [M, K]; weight: [N, K]; bias: [N] or None; ours, theirs: [M, N]; float32 or bfloat16, all alike.
    Returns:
        float32 [M, N].
    """
    bound = rounding_bound(rows.float(), weight.float(), None if bias is None else bias.float())
    if weight.dtype != torch.float32:
        bound += torch.finfo(weight.dtype).eps / 2 * (ours.float().abs() + theirs.float().abs())
    return bound


def onednn_is_close(weight: torch.Tensor, bias: torch.Tensor | None, rows: int = 8, seed: int = 0,
                    packed: bool = False) -> bool:
    """Whether `onednn_linear` gives `F.linear`'s product for a float32 or bfloat16 `weight` [N, K] and `bias` [N]
    (or None) on `rows` random rows within `agreement_bound`; from the weight reordered as OneDnnLinear(packed=True)
    holds it, with `packed`."""
    x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(seed)).to(weight.dtype)
    with torch.inference_mode():
        operand = reordered_weight(weight) if packed else weight
        ours, theirs = onednn_linear(x, operand, bias), F.linear(x, weight, bias)
        difference = (ours.float() - theirs.float()).abs()
        return bool((difference <= agreement_bound(x, weight, bias, ours, theirs)).all())


@dataclass(frozen=True)
class OneDnnRouting:
    """What route_linears_to_onednn did: how many layers it wrapped, how many of them compute from reordered
    weights, and the bytes of reordered copies held beside weights other modules still read (tied heads)."""

    wrapped: int
    packed: int
    copied_bytes: int


def onednn_targets(model: torch.nn.Module, device: torch.device, tensor_parallel: bool, has_bf16_units: bool,
                   pack: bool, min_weight_bytes: int | None = None) -> list[tuple[str, torch.nn.Linear]]:
    """The plain nn.Linear layers of `model` that oneDNN computes (route_linears_to_onednn's rule), by name, leaving
    out those another module already wraps (a LinearWrapper's `linear`): none under tensor parallel, off the CPU or
    where torch has no oneDNN."""
    if tensor_parallel or device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return []
    least = {torch.float32: MIN_WEIGHT_BYTES if min_weight_bytes is None else min_weight_bytes}
    if pack and has_bf16_units:
        least[torch.bfloat16] = MIN_BF16_WEIGHT_BYTES if min_weight_bytes is None else min_weight_bytes
    wrappers = {name for name, module in model.named_modules() if isinstance(module, LinearWrapper)}
    return [(name, module) for name, module in model.named_modules()
            if type(module) is torch.nn.Linear and name.rpartition(".")[0] not in wrappers  # not one already wrapped
            and module.weight.dtype in least
            and module.weight.numel() * module.weight.element_size() >= least[module.weight.dtype]]


def parameter_uses(model: torch.nn.Module) -> Counter[int]:
    """How many places of `model` hold each parameter, by id (a tied weight: 2)."""
    return Counter(id(parameter) for _, parameter in model.named_parameters(remove_duplicate=False))


def route_linears_to_onednn(model: torch.nn.Module, device: torch.device, tensor_parallel: bool,
                            has_bf16_units: bool, min_weight_bytes: int | None = None,
                            pack: bool | None = None) -> OneDnnRouting:
    """On the CPU where torch has oneDNN (not under tensor parallel, whose plan hooks the original modules), wrap
    linears of `model` (its lm_head included) in OneDnnLinear, shape by shape where onednn_is_close holds (the first
    layer of each shape is checked; a failing shape is logged and left as it is): every float32 nn.Linear whose
    weight holds at least `min_weight_bytes` (None: MIN_WEIGHT_BYTES); and, where weights are reordered and the CPU
    has bf16 units (`has_bf16_units`), every bfloat16 nn.Linear of at least MIN_BF16_WEIGHT_BYTES (`min_weight_bytes`
    when given). With `pack` (None: packs_weights()), the layers compute from reordered copies, releasing their own
    weights where no other module shares them.
    """
    pack = packs_weights() if pack is None else pack
    targets = onednn_targets(model, device, tensor_parallel, has_bf16_units, pack, min_weight_bytes)
    uses = parameter_uses(model)
    close: dict[tuple[int, int, bool, bool, torch.dtype], bool] = {}
    wrapped = packed = copied_bytes = 0
    for name, layer in targets:
        weight = layer.weight
        shape = (layer.out_features, layer.in_features, layer.bias is not None, pack, weight.dtype)
        if shape not in close:
            close[shape] = onednn_is_close(weight, layer.bias, packed=pack)
            if not close[shape]:
                log.info("%s linears of %d x %d stay on torch's GEMM: oneDNN's product was outside rounding of it",
                         str(weight.dtype).removeprefix("torch."), shape[0], shape[1])
        if close[shape]:
            shared = uses[id(weight)] > 1
            replace_module(model, name, OneDnnLinear(layer, packed=pack, release=not shared))
            wrapped += 1
            packed += pack
            copied_bytes += weight.numel() * weight.element_size() if pack and shared else 0
    if packed:
        log.info("%d linear layers compute from weights reordered into oneDNN's layout (an AVX-512 CPU), their "
                 "row-major copies released where no other module reads them (%.0f MiB held twice)", packed,
                 copied_bytes / 2**20)
    return OneDnnRouting(wrapped, packed, copied_bytes)
