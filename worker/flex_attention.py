"""The `flex` attention backend: torch's FlexAttention reading shuttle's paged KV cache in place.

**The cache as flex sees it.** A layer's cache K [N+1, block_size, Hkv, D] (block N is the null block) is viewed,
without a copy, as [1, Hkv, (N+1)*block_size, D]: each cache slot is one key index kv = block * block_size +
offset, and the BlockMask's KV block size is the cache's block size, so flex's KV block i *is* cache block i.

**Block maps and masks** (what `mask_mod` decides and what the BlockMask only lets the kernel skip, the
physical-to-logical map, the two call forms) are worker/flex_masks.py's.

**Features.** Sliding window in `mask_mod`; soft-cap as `score_mod` (flex applies `scale` first, as the reference
does); attention sinks through the log-sum-exp: with a sink logit s per head, softmax over keys plus the sink
scales the sink-free output by Z / (Z + e^s) = sigmoid(lse - s).

**Compiled or eager.** `flex_function(device)` is the seam: `torch.compile(flex_attention, fullgraph=True,
dynamic=False)` on CUDA (its Triton templates are the fast path; the int32-offset cap of `max_kv_blocks` applies),
plain eager flex elsewhere. Compiled shapes are static per bucket (`decode_bucket`, `token_bucket`, and
`width_bucket` of the widest table a sequence can have), so every shape is compiled at start-up, none while a
request waits (each costs inductor seconds); the BlockMask of each step is built once per distinct sliding window
and reused by every layer.
Nothing in the per-layer path reads the metadata's Python lists or calls `.item()`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from shuttle.worker.attention import AttentionMetadata, LayerFeatures
from shuttle.worker.flex_masks import (
    QUERY_BLOCK,
    FormInputs,
    block_mask,
    check_logical_blocks,
    decode_block_lists,
    decode_inputs,
    logical_block_map,
    packed_block_lists,
    packed_inputs,
    step_mask_mod,
)

MAX_VIEW_ELEMENTS = 2**31 - 1  # flex's Triton kernels compute K/V offsets in int32
# inductor's flex lowering refuses smaller heads (torch 2.11 on an H200: "NYI: embedding dimension of the query, key,
# and value must be at least 16")
MIN_COMPILED_HEAD_DIM = 16
RECOMPILE_LIMIT = 256  # dynamo's default (8) is far below buckets x windows x soft-caps; see configure_dynamo


def max_kv_blocks(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Most usable KV blocks N (the null block not counted) for which one layer's K or V view
    [(N+1) * block_size, num_kv_heads, head_dim] has at most MAX_VIEW_ELEMENTS elements.

    Past that, flex's 32-bit offsets wrap and its kernels read the wrong slots without any error.
    """
    return MAX_VIEW_ELEMENTS // (block_size * num_kv_heads * head_dim) - 1


def max_kv_blocks_for(geometry, block_size: int) -> int:
    """max_kv_blocks over a model's layers; `geometry` is a list of worker.model_loader.LayerGeometry (or anything
    with num_kv_heads, head_dim and v_head_dim). KV sizing caps its block count with this under `flex`."""
    return min(max_kv_blocks(block_size, g.num_kv_heads, max(g.head_dim, g.v_head_dim)) for g in geometry)


def compiled_head_dim_problem(geometry) -> str | None:
    """Why compiled flex cannot run a model whose layers have `geometry` (worker.model_loader.LayerGeometry list),
    or None when it can."""
    smallest = min(min(g.head_dim, g.v_head_dim) for g in geometry)
    if smallest < MIN_COMPILED_HEAD_DIM:
        return (f"its head_dim {smallest} is below the {MIN_COMPILED_HEAD_DIM} that compiled flex kernels take; "
                f"serve it with --attention-backend reference or --device cpu")
    return None


def check_cache_fits(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    """Raise ValueError when a layer's cache is too large for flex's 32-bit offsets (shapes only; no device sync)."""
    for cache in (key_cache, value_cache):
        if cache.numel() > MAX_VIEW_ELEMENTS:
            blocks, block_size, heads, dim = cache.shape
            raise ValueError(
                f"the flex attention backend addresses a layer's KV cache with 32-bit offsets, but this cache holds "
                f"{cache.numel()} elements per layer ({blocks} blocks x {block_size} x {heads} heads x {dim}); at most "
                f"{max_kv_blocks(block_size, heads, dim)} blocks fit: lower --num-kv-blocks / the KV memory budget")


# ---------------------------------------------------------------------------------------------------------------
# Compiled or eager: the seam


def configure_dynamo(recompile_limit: int = RECOMPILE_LIMIT) -> None:
    """Raise dynamo's recompile limit and make hitting it an error: past the limit dynamo would quietly run flex
    uncompiled, which materialises the whole [queries x cache] score matrix (slow, and out of memory on a big cache)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, recompile_limit)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * recompile_limit)
    config.fail_on_recompile_limit_hit = True


@functools.cache
def _compiled(backend: str) -> Callable:
    configure_dynamo()
    # fullgraph: a graph break inside would leave a partly eager flex, so it must be an error, not a fallback
    return torch.compile(flex_attention, fullgraph=True, dynamic=False, backend=backend)


def _eager(*args, **kwargs):
    """flex_attention run as plain torch ops, without dynamo.

    Called outside torch.compile, flex_attention (torch 2.13) still traces its operator with dynamo's eager backend,
    once per new shape: seconds of tracing per bucket on a CPU, for the same dense math. Its module flag
    `_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG` (private, checked against torch 2.13.0) calls the operator directly instead;
    tests/engine/test_flex_attention.py fails if the flag disappears. The worker is one thread, so setting the flag
    around the call does not leak into another caller's flex."""
    previous = torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    try:
        return flex_attention(*args, **kwargs)
    finally:
        torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = previous


def flex_function(device: torch.device, compile_backend: str | None = None) -> Callable:
    """flex_attention as it runs on `device`: compiled with inductor on CUDA, eager elsewhere.

    Args:
        compile_backend: compile with this dynamo backend whatever the device ("eager" traces with dynamo but runs
            the unfused math, which is how CPU tests check for graph breaks and recompiles without inductor).
    Returns:
        a callable with flex_attention's signature.
    """
    if compile_backend is not None:
        return _compiled(compile_backend)
    return _compiled("inductor") if device.type == "cuda" else _eager


@contextlib.contextmanager
def no_recompiles():
    """Inside, any recompile of a compiled function raises instead of compiling (tests and the GPU check run the
    steady state under it after warm-up). Do not wrap eager flex in it: eager flex traces internally."""
    with torch.compiler.set_stance("fail_on_recompile"):
        yield


def decode_bucket(rows: int) -> int:
    """Decode rows padded to 1, 2, 4, 8, then multiples of 16 (the CUDA-graph batch sizes)."""
    if rows <= 8:
        return 1 << max(rows - 1, 0).bit_length()
    return -(-rows // 16) * 16


def token_bucket(tokens: int) -> int:
    """Packed prefill tokens padded to a power of two, at least one query block."""
    return max(QUERY_BLOCK, 1 << max(tokens - 1, 0).bit_length())


def token_buckets(max_tokens: int) -> list[int]:
    """Every token_bucket a packed prefill of 2 to `max_tokens` tokens can fall in, smallest first."""
    buckets = [QUERY_BLOCK]
    while buckets[-1] < token_bucket(max_tokens):
        buckets.append(2 * buckets[-1])
    return buckets


def width_bucket(width: int) -> int:
    """Block-table columns padded to a power of two (at least 8)."""
    return max(8, 1 << max(width - 1, 0).bit_length())


def kernel_options(form: str, block_size: int) -> dict:
    """Triton tile options for the compiled kernels (not yet measured on a GPU).

    A KV tile must not span cache blocks: BLOCK_N divides the block size (inductor skips configs that do not, and
    fails when none is left). The packed form's query tile is its query block, and it is kept off the decode
    template (chosen for short queries), which would treat its few query blocks as one.
    """
    block_n = min(block_size & -block_size, 64)  # the largest power of two dividing the block size
    if form == "decode":
        return {"BLOCK_N": block_n}
    return {"BLOCK_M": QUERY_BLOCK, "BLOCK_N": block_n, "FORCE_USE_FLEX_ATTENTION": True}


# ---------------------------------------------------------------------------------------------------------------
# The backend


@dataclass
class _StepMasks:
    """One step's inputs and, per sliding window seen, its two BlockMasks (None where the step has no such rows)."""

    num_decodes: int
    num_prefill_tokens: int
    decode: FormInputs | None
    packed: FormInputs | None
    p2l: torch.Tensor
    masks: dict


class FlexBackend:
    """Attention through FlexAttention over the cache in place (the module docstring explains the forms).

    Args:
        block_size: tokens per KV block.
        device: the cache's device; CUDA compiles flex, other devices run it eagerly.
        compile_backend: force compilation with this dynamo backend (see flex_function).
        pad_shapes: pad rows, tokens and table width to their buckets (default: when compiled, so each bucket
            compiles once; tests turn it on eagerly to check that padding changes nothing). The packed form's rows
            are padded to its token bucket (a step never has more prefill rows than tokens), so they add no
            compile dimension of their own.
        max_blocks_per_seq: with padding, every step's table is padded to width_bucket(this), the widest table a
            max_model_len sequence needs, so the width adds no compile dimension either: compiled shapes are then
            the token buckets and the decode buckets alone, all compiled at start-up (ModelRunner's warm-up and
            graph capture) rather than while a request waits. None: each step's width to its own bucket.
        check_invariants: check the one-logical-index-per-block invariant each step (syncs; for tests).
    """

    name = "flex"

    def __init__(self, block_size: int, device: torch.device = torch.device("cpu"),
                 compile_backend: str | None = None, pad_shapes: bool | None = None,
                 max_blocks_per_seq: int | None = None, check_invariants: bool = False):
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.device = device
        self.compiled = compile_backend is not None or device.type == "cuda"
        self.flex = flex_function(device, compile_backend)
        self.pad_shapes = self.compiled if pad_shapes is None else pad_shapes
        self.check_invariants = check_invariants
        self._meta: AttentionMetadata | None = None
        self._step: _StepMasks | None = None

    def begin_step(self) -> None:
        """Forget the previous step's masks."""
        self._meta, self._step = None, None

    def _prepare(self, meta: AttentionMetadata, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 num_tokens: int) -> _StepMasks:
        """The step's form inputs and p2l, built on the first layer's call (shapes come from the host-side
        metadata fields num_decodes and tensor shapes, never from reading device values)."""
        check_cache_fits(key_cache, value_cache)
        device, bs = key_cache.device, self.block_size
        table = meta.block_table.to(device, torch.int32, non_blocking=True)
        lens = meta.seq_lens.to(device, torch.int32, non_blocking=True)
        if self.check_invariants:
            check_logical_blocks(table, lens, bs)
        num_rows, width = table.shape
        d = meta.num_decodes
        pad = self.pad_shapes
        padded_width = width_bucket(max(width, self.max_blocks_per_seq or 0)) if pad else width
        p2l = logical_block_map(table, lens, key_cache.shape[0], bs)
        decode = None
        if d:
            decode = decode_inputs(table[:d], lens[:d], decode_bucket(d) if pad else d, padded_width)
        packed, prefill_tokens = None, num_tokens - d
        if num_rows > d:
            starts = meta.query_start_loc.to(device, torch.int32, non_blocking=True)[d:] - d
            prefill_rows = num_rows - d
            tokens = token_bucket(prefill_tokens) if pad else -(-prefill_tokens // QUERY_BLOCK) * QUERY_BLOCK
            packed = packed_inputs(table[d:], lens[d:], starts, prefill_tokens, tokens if pad else prefill_rows,
                                   padded_width, tokens)
        return _StepMasks(d, prefill_tokens, decode, packed, p2l, {})

    def _masks(self, step: _StepMasks, window: int | None, num_cache_blocks: int):
        """(decode BlockMask, packed BlockMask) for this window, built once per step."""
        if window not in step.masks:
            bs = self.block_size
            decode = packed = None
            if step.decode is not None:
                form = step.decode
                mod = step_mask_mod(form.table, step.p2l, form.row_of, form.qpos_of, True, bs, window)
                decode = block_mask(decode_block_lists(form, bs, window), mod, True, 1, num_cache_blocks, bs)
            if step.packed is not None:
                form = step.packed
                mod = step_mask_mod(form.table, step.p2l, form.row_of, form.qpos_of, False, bs, window)
                packed = block_mask(packed_block_lists(form, bs, window), mod, False, form.num_queries,
                                    num_cache_blocks, bs)
            step.masks[window] = (decode, packed)
        return step.masks[window]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, features: LayerFeatures) -> torch.Tensor:
        """Attention of the step's packed queries over the cache.

        Args:
            query: [T, num_heads, head_dim], decode rows' tokens first; key/value: the step's new keys and values
                (already written into the cache, which is all that is read).
            key_cache: [N+1, block_size, num_kv_heads, head_dim]; value_cache: [N+1, block_size, num_kv_heads,
                v_head_dim].
        Returns:
            [T, num_heads, v_head_dim], query's dtype.
        """
        if self._meta is not meta:
            self._meta, self._step = meta, self._prepare(meta, key_cache, value_cache, query.shape[0])
        step = self._step
        assert step is not None  # prepared above for this step's metadata
        decode_mask, packed_mask = self._masks(step, features.sliding_window, key_cache.shape[0])
        heads = key_cache.shape[2]
        # [N+1, bs, Hkv, D] -> [1, Hkv, (N+1)*bs, D], a strided view: no copy of the cache
        keys = key_cache.view(-1, heads, key_cache.shape[3]).permute(1, 0, 2).unsqueeze(0)
        values = value_cache.view(-1, heads, value_cache.shape[3]).permute(1, 0, 2).unsqueeze(0)
        d, t = step.num_decodes, query.shape[0]
        parts = []
        if decode_mask is not None:
            assert step.decode is not None  # each mask is built from its form's inputs
            q = self._padded(query[:d], step.decode.num_queries, 0).unsqueeze(2)  # [B, H, 1, D]
            parts.append(self._attend(q, keys, values, decode_mask, features, "decode")[:d, :, 0])
        if packed_mask is not None:
            assert step.packed is not None
            q = self._padded(query[d:].transpose(0, 1), step.packed.num_queries, 1).unsqueeze(0)  # [1, H, T', D]
            parts.append(self._attend(q, keys, values, packed_mask, features, "packed")[0, :, :t - d].transpose(0, 1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _padded(queries: torch.Tensor, count: int, dim: int) -> torch.Tensor:
        """A contiguous copy of `queries`, padded with zeros to `count` along `dim` (padded queries attend nothing
        and are dropped). Always a copy: the query transformers hands over has strides that depend on the step's
        token count, and compiled flex guards on strides, so passing it through would recompile every step."""
        shape = list(queries.shape)
        shape[dim] = count
        out = queries.new_zeros(shape)
        out.narrow(dim, 0, queries.shape[dim]).copy_(queries)
        return out

    def _attend(self, query, keys, values, mask: BlockMask, features: LayerFeatures, form: str) -> torch.Tensor:
        """One flex call. query [Z, H, L, D] -> [Z, H, L, Dv] in query's dtype."""
        score_mod = None
        if features.softcap is not None:
            cap = float(features.softcap)

            def score_mod(score, b, h, q, kv):
                return torch.tanh(score / cap) * cap
        options = kernel_options(form, self.block_size) if self.compiled else None
        if features.sinks is None:
            return self.flex(query, keys, values, score_mod=score_mod, block_mask=mask, scale=features.scaling,
                             enable_gqa=True, kernel_options=options)
        out, aux = self.flex(query, keys, values, score_mod=score_mod, block_mask=mask, scale=features.scaling,
                             enable_gqa=True, kernel_options=options, return_aux=AuxRequest(lse=True))
        # the sink adds e^s to the denominator Z: out * Z / (Z + e^s) = out * sigmoid(lse - s)
        work = torch.promote_types(out.dtype, torch.float32)  # bf16 outputs are corrected in fp32, fp64 in fp64
        sinks = features.sinks.to(device=aux.lse.device, dtype=work).view(1, -1, 1)
        return (out.to(work) * torch.sigmoid(aux.lse.to(work) - sinks).unsqueeze(-1)).to(out.dtype)
