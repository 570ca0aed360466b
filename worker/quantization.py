"""`--quantization int8`: the decoder layers' linear layers swapped for int8 weight-only ones at load.

What is quantized: every `nn.Linear` of the model except its output projection (`lm_head`), so in a Llama the
attention's q/k/v/o and the MLP's gate/up/down of every decoder layer. The embeddings and the lm_head stay in the
checkpoint's dtype: small models tie the lm_head to the input embeddings (stories260K, the 110M Llama shape), and
the logits, which greedy decoding and logprobs read directly, keep their precision.

The scale (per output channel, symmetric, no zero point; llama.cpp's Q8_0 formula `d = amax / 127`, taken over a
whole row rather than blocks of 32, as gpt-fast's `WeightOnlyInt8Linear` does):

    s[n]    = max_k |W[n, k]| / 127            (rounded to bfloat16, the kernel's scale dtype)
    q[n, k] = clamp(round(W[n, k] / s[n]), -127, 127)            int8
    W[n, k] ~ q[n, k] * s[n]                   |W - q * s| <= s / 2 per element

computed once from the loaded float32 / bfloat16 weights. The matmul is torch's own CPU kernel
`torch.ops.aten._weight_int8pack_mm(x, q, s)`: x [M, K] 2-D and contiguous, q [N, K] int8, s [N] in x's dtype,
returning [M, N] in x's dtype (used below DEQUANTIZED_ROWS rows; from there on one matmul over the widened q,
scaled after, is faster: in bfloat16 on a CPU with bf16 matrix units, in float32 on one without, where torch widens
a bfloat16 matmul to float32 internally: with 2048 x 768 weights, 16-512 rows and 2 threads on an AVX2-only CPU,
the bfloat16 matmul took 2.9-8.6x as long as float32's own, the float32 one over widened int8 1.0-1.2x). K must be
a multiple of 16 (its vectorised loop has no tail: other widths read past the rows, returning garbage or
crashing), so a layer of another width (stories260K's down_proj, K = 172) keeps zero columns in q and gets its
input padded with zeros to match.
On this torch (2.13, CPU) only its bfloat16 path is vectorised: float32 inputs ran
10-20x slower than the float32 matmul it replaces at 16-64 rows, so activations enter the kernel as bfloat16 and its
output is cast back to the model's dtype. That rounding (2^-9 relative) is small next to the weights' own (about 1%
of an output's magnitude); the agreement figures are in docs/operations.md.

CPU only, without tensor parallel (rank shards would need their own scales): both are refused at start-up
(common/devices.py quantization_error) and again here for an in-process engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shuttle.common.devices import quantization_error
from shuttle.worker.module_swap import replace_module

if TYPE_CHECKING:  # for annotations only: importing transformers here would slow this module's import
    from transformers import PreTrainedModel

QMAX = 127
K_MULTIPLE = 16  # _weight_int8pack_mm's CPU kernel reads K in blocks of 16
# From this many rows on (prefill chunks, large decode batches) the int8 weights are widened to bfloat16 for one
# oneDNN bf16 matmul instead: at 2048 x 768 here, 64 rows took 0.6 ms that way against 1.2-2.8 ms in the int8 kernel
# (512 rows: 1.2 against 10-14 ms), while at 16 rows the int8 kernel was faster (0.30 against 0.50 ms)
DEQUANTIZED_ROWS = 32
KERNEL_DTYPE = torch.bfloat16  # activations and scales as _weight_int8pack_mm's vectorised CPU path takes them



def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of `weight` [N, K]; returns (q [N, K] int8, scales [N] bfloat16)."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / QMAX).clamp(min=1e-12).to(KERNEL_DTYPE)  # [N]; an all-zero row keeps q = 0
    q = torch.round(w / scales.float()[:, None]).clamp(-QMAX, QMAX).to(torch.int8)  # [N, K]
    return q, scales


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [N, K] int8 and scales [N] back to float32 weights [N, K]: q * s."""
    return q.float() * scales.float()[:, None]


class Int8Linear(torch.nn.Module):
    """nn.Linear with int8 weights: input [..., K] in the model's dtype, output [..., N] in the same dtype,
    y = bf16(x) @ (q * s).T (+ bias), accumulated by _weight_int8pack_mm below DEQUANTIZED_ROWS rows, else
    y = (x @ q.T) * s by one matmul in `wide_dtype` (bfloat16 where the CPU has bf16 matrix units, else float32)
    over q widened for the call (nothing of it kept: the resident weights stay int8).

    The int8 weights and scales are frozen Parameters, so `model.parameters()` (ModelRunner.weight_bytes) counts
    them at their real size: N x K bytes (K padded to a multiple of 16) plus 2N for the scales.
    """

    def __init__(self, linear: torch.nn.Linear, wide_dtype: torch.dtype):
        super().__init__()
        self.wide_dtype = wide_dtype
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scales = quantize_per_channel(linear.weight)
        self.pad = -self.in_features % K_MULTIPLE
        q = torch.nn.functional.pad(q, (0, self.pad))  # [N, K + pad]: zero columns
        self.qweight = torch.nn.Parameter(q, requires_grad=False)  # [N, K + pad] int8
        self.scales = torch.nn.Parameter(scales, requires_grad=False)  # [N] bfloat16
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = x.numel() < DEQUANTIZED_ROWS * self.in_features
        rows = x.reshape(-1, self.in_features).to(KERNEL_DTYPE if small else self.wide_dtype).contiguous()  # [M, K]
        if self.pad:
            rows = torch.nn.functional.pad(rows, (0, self.pad))  # [M, K + pad]
        if small:
            out = torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self.scales)  # [M, N] bfloat16
        else:  # q is exact in bfloat16 (7 bits); the scale is applied to the output, in float32
            out = (rows @ self.qweight.to(self.wide_dtype).T).float() * self.scales.float()  # [M, N]
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # [..., N]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"wide_dtype={self.wide_dtype}")


def quantize_model(model: PreTrainedModel, method: str, device: torch.device, tensor_parallel: bool,
                   has_bf16_units: bool) -> int:
    """Replace, in place, every nn.Linear of `model` but its output embeddings by an Int8Linear when `method` is
    "int8" ("none": nothing), whose wide matmul runs in bfloat16 when `has_bf16_units` (the CPU's flags, as
    common/devices.py reads them), else in float32. Returns how many were replaced.

    Raises:
        ValueError: an unknown method, a CUDA device or tensor parallel (quantization_error's refusals).
    """
    refusal = quantization_error(method, 2 if tensor_parallel else 1, device.type)
    if refusal:
        raise ValueError(refusal)
    if method == "none":
        return 0
    head = model.get_output_embeddings()
    targets = [(name, module) for name, module in model.named_modules()
               if type(module) is torch.nn.Linear and module is not head]
    wide_dtype = torch.bfloat16 if has_bf16_units else torch.float32
    for name, linear in targets:
        replace_module(model, name, Int8Linear(linear, wide_dtype))
    return len(targets)
