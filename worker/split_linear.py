"""float32 linear layers at decode-sized row counts on a CPU, their output columns split into groups that the
worker's threads compute side by side: at one row bit for bit what `F.linear` gives, in a bit over half its time
on two cores.

Why. At a few rows torch's CPU matmul (MKL's sgemm in torch 2.13) runs a linear on one thread whatever
torch.get_num_threads() says, so a one-sequence decode step streams its weights at one core's memory bandwidth: on
a 2-core AVX2 CPU the 110M Llama shape's 85 linears (438 MB of fp32) took 33 ms a pass at 1 and at 2 threads, while
reading the same bytes took 17 ms on 2 threads (scripts/dev/bench_split_linear.py measures both). `torch.bmm` over
the weight viewed as `groups` groups of output rows ([groups, N / groups, K], no copy) runs its batch on all
threads, each group one GEMM of the same input rows.

Exactness. Every output is the dot product of the same K values either way; whether the BLAS sums them in the same
order depends on its kernel for each shape. At one row (a one-sequence decode step, where the engine's logits
match transformers' own bit for bit) `split_is_exact` checks it at start-up on each weight shape with the layer's
own weights, and a shape where it fails keeps `F.linear` (on the CPU above, at 2 threads: 96-wide layers, and groups
of 86 columns). At a few other row counts (5-7 and 9-11 on that CPU) MKL's small-GEMM kernels sum in another order
for a narrower GEMM, so those products can differ from one wide GEMM in the last bit, as the same row already does
between batch sizes (row 0 of a 4-row product is not the 1-row product's bits). tests/engine/test_split_linear.py
holds both facts, and that an engine on two threads gives transformers' greedy tokens.

Groups hold at most MAX_GROUP_COLUMNS output columns (the lm_head's 32000 columns: 32 groups of 1000), the chunk
width that output_projection.py measured faster than one wide GEMM, in a number of groups the threads share evenly.
Above SPLIT_MAX_ROWS rows (prefill chunks) the BLAS threads its own GEMM and the layer computes as before.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from shuttle.worker.output_projection import CHUNK_COLUMNS, ColumnChunkedLinear, LinearWrapper

log = logging.getLogger(__name__)

# Rows up to which the columns are split. On a 2-core AVX2 CPU (12 layers of the 110M shape plus its lm_head, 2
# threads) the split took 0.55-0.72x the plain linears' time at 1-16 rows, 0.8x at 32-128, 0.89x at 256 and 0.99x
# at 512 and 1024, where MKL's own threading has caught up (scripts/dev/bench_split_linear.py).
SPLIT_MAX_ROWS = 256
MAX_GROUP_COLUMNS = CHUNK_COLUMNS


def column_groups(out_features: int, threads: int) -> int:
    """How many column groups a layer of `out_features` outputs splits into on `threads` threads: the fewest that
    divide out_features, are a multiple of `threads` and hold at most MAX_GROUP_COLUMNS columns each; else the
    most that divide out_features and are at most `threads` (1: not split)."""
    if threads < 2:
        return 1
    for groups in range(threads, out_features + 1, threads):
        if out_features % groups == 0 and out_features // groups <= MAX_GROUP_COLUMNS:
            return groups
    return max(g for g in range(1, threads + 1) if out_features % g == 0)


def split_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, groups: int) -> torch.Tensor:
    """`F.linear(rows, weight, bias)` as one batched GEMM over `groups` groups of the weight's output rows.

    Args:
        rows: [M, K] float32.
        weight: [N, K] float32, contiguous; N a multiple of `groups`.
        bias: [N] float32 or None.
        groups: the number of groups (column_groups).
    Returns:
        float32 [M, N].
    """
    (m, k), n = rows.shape, weight.shape[0]
    stacked = rows.unsqueeze(0).expand(groups, m, k)  # [G, M, K], no copy
    grouped = weight.view(groups, n // groups, k).transpose(1, 2)  # [G, K, N/G], no copy
    if bias is None:
        out = torch.bmm(stacked, grouped)  # [G, M, N/G]
    else:
        out = torch.baddbmm(bias.view(groups, 1, n // groups), stacked, grouped)
    return out.transpose(0, 1).reshape(m, n)


class SplitColumnsLinear(LinearWrapper):
    """Wraps a float32 nn.Linear (or the float32 ColumnChunkedLinear of the lm_head), sharing its weight and bias
    so tied embeddings stay tied: input [..., K] float32, output [..., N] float32, the wrapped layer's product (bit
    for bit at one row, which split_is_exact checked for this shape). Up to SPLIT_MAX_ROWS rows it computes
    `split_linear` over `groups` groups; above, the wrapped layer computes.
    """

    def __init__(self, linear: torch.nn.Linear | ColumnChunkedLinear, groups: int):
        super().__init__(linear)
        self.groups = groups

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if hidden.numel() > SPLIT_MAX_ROWS * weight.shape[1]:
            return self.linear(hidden)
        out = split_linear(hidden.reshape(-1, weight.shape[1]), weight, self.bias, self.groups)
        return out.reshape(*hidden.shape[:-1], weight.shape[0])

    def extra_repr(self) -> str:
        return f"groups={self.groups}"


def split_is_exact(linear: torch.nn.Linear | ColumnChunkedLinear, groups: int, seed: int = 0) -> bool:
    """Whether `split_linear` over `groups` gives exactly `F.linear` for one random row with this layer's weight and
    bias, on this process's threads (the module docstring says why one row)."""
    weight, bias = linear.weight, linear.bias
    row = torch.randn(1, weight.shape[1], generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        return torch.equal(split_linear(row, weight, bias, groups), F.linear(row, weight, bias))


def _splittable(module: torch.nn.Module) -> bool:
    if type(module) is torch.nn.Linear:
        return module.weight.dtype == torch.float32
    return type(module) is ColumnChunkedLinear and not module.widen and module.weight.dtype == torch.float32


def split_float32_linears(model: torch.nn.Module, device: torch.device, tensor_parallel: bool, threads: int) -> int:
    """On the CPU with 2 or more threads (not under tensor parallel, whose plan hooks the original modules), wrap
    every float32 nn.Linear of `model`, and the float32 ColumnChunkedLinear of its lm_head, in a SplitColumnsLinear,
    shape by shape where split_is_exact holds (the first layer of each shape is checked; a failing shape is logged
    and left as it is). Returns how many were wrapped.
    """
    if tensor_parallel or device.type != "cpu" or threads < 2:
        return 0
    targets = [(name, module) for name, module in model.named_modules() if name and _splittable(module)]
    names = {name for name, _ in targets}
    targets = [(name, module) for name, module in targets  # not the nn.Linear inside the lm_head's chunked one
               if name.rpartition(".")[0] not in names]
    exact: dict[tuple, int] = {}  # (N, K, has bias) -> groups, 0 where not exact
    wrapped = 0
    for name, layer in targets:
        shape = (layer.weight.shape[0], layer.weight.shape[1], layer.bias is not None)
        if shape not in exact:
            groups = column_groups(shape[0], threads)
            exact[shape] = groups if groups > 1 and split_is_exact(layer, groups) else 0
            if groups > 1 and not exact[shape]:
                log.info("float32 linears of %d x %d stay one GEMM: split over the threads, this BLAS rounds one row "
                     "differently", shape[0], shape[1])
        if exact[shape]:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, SplitColumnsLinear(layer, exact[shape]))
            wrapped += 1
    return wrapped
