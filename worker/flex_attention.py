"""The `flex` attention backend: torch's FlexAttention reading shuttle's paged KV cache in place.

**The cache as flex sees it.** A layer's cache K [N+1, block_size, Hkv, D] (block N is the null block) is viewed,
without a copy, as [1, Hkv, (N+1)*block_size, D]: each cache slot is one key index kv = block * block_size +
offset, and the BlockMask's KV block size is the cache's block size, so flex's KV block i *is* cache block i.

**What is true and what is a shortcut.** Each call passes a `mask_mod` and a BlockMask:
- `mask_mod(b, h, q, kv)` is the whole truth: the key slot belongs to the query's sequence (through the step's
  physical-to-logical block map and the sequence's block-table row), and its position is visible from the query's
  (causal, and inside the sliding window if any).
- the BlockMask only lets the fused kernel skip work: it lists, per query block, the cache blocks that `mask_mod`
  admits anything from ("partial": `mask_mod` is evaluated there) and those it admits wholly ("full": it is not).

Eager flex (the CPU) ignores the lists and evaluates `mask_mod` on every (query, slot) pair; compiled flex (CUDA)
reads only the listed blocks. So the builders below must list every block `mask_mod` admits anything from and
call full only blocks it admits wholly; tests/test_flex_attention.py checks both, since eager runs alone cannot.

**Logical positions.** `mask_mod` needs the position of a slot, but a slot is physical. A physical block sits at
the same logical index in every block table of a step that holds it (the prefix cache shares only
position-aligned blocks), so one map `p2l` int32 [N+1] per step (-1 where no row of the step reads the block) gives
it: position = p2l[kv // bs] * bs + kv % bs. `check_logical_blocks` tests that invariant (a debugging aid; it
syncs with the device). No per-sequence inverse map, no [blocks x cache] table: the largest per-step tensor is the
packed form's candidate list, [query blocks, QUERY_BLOCK, table width].

**Two call forms per layer** (rows are ordered decodes first, see worker/attention.py):
- decode form: Q [B_dec, H, 1, D] over the broadcast KV batch of 1; row b's BlockMask lists row b's own blocks
  (its block-table row, from the first one its window reaches);
- packed form: the prefill chunks' tokens Q [1, H, T_pre, D]; each query block of QUERY_BLOCK tokens lists the
  de-duplicated union of the blocks its tokens read (a block spanning two sequences reads both sets; `mask_mod`
  keeps them apart).

**Features.** Sliding window in `mask_mod`; soft-cap as `score_mod` (flex applies `scale` first, as the reference
does); attention sinks through the log-sum-exp: with a sink logit s per head, softmax over keys plus the sink
scales the sink-free output by Z / (Z + e^s) = sigmoid(lse - s).

**Compiled or eager.** `flex_function(device)` is the seam: `torch.compile(flex_attention, fullgraph=True,
dynamic=False)` on CUDA (its Triton templates are the fast path; the int32-offset cap of `max_kv_blocks` applies),
plain eager flex elsewhere. Compiled shapes are static per bucket (`decode_bucket`, `token_bucket`,
`width_bucket`); the BlockMask of each step is built once per distinct sliding window and reused by every layer.
Nothing in the per-layer path reads the metadata's Python lists or calls `.item()`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from worker.attention import AttentionMetadata, LayerFeatures

QUERY_BLOCK = 16  # packed form's query block (tokens): small, since a block spanning sequences reads all their blocks
# The decode form's one query per row sits in a query block of this size: inductor skips every kernel config whose
# BLOCK_M does not divide it, and the decode template's BLOCK_M is the GQA group (up to 128) rounded to a power of 2
DECODE_QUERY_BLOCK = 128
MAX_VIEW_ELEMENTS = 2**31 - 1  # flex's Triton kernels compute K/V offsets in int32
RECOMPILE_LIMIT = 256  # dynamo's default (8) is far below buckets x windows x soft-caps; see configure_dynamo
_NO_BLOCK = torch.iinfo(torch.int32).max  # sorts after every real block id


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
    with warnings.catch_warnings():  # eager is chosen on purpose here; flex warns that it is unfused
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


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
# Per-step block maps and masks (tensor ops on the cache's device)


def logical_block_map(block_table: torch.Tensor, seq_lens: torch.Tensor, num_cache_blocks: int,
                      block_size: int) -> torch.Tensor:
    """p2l: int32 [num_cache_blocks], the logical index at which the step's rows hold each physical block, -1 for
    blocks no row reads (the null block included: it only pads tables).

    Args:
        block_table: int32 [B, W]; seq_lens: int32 [B] (tokens each row attends).
    """
    width = block_table.shape[1]
    logical = torch.arange(width, dtype=torch.int32, device=block_table.device).expand_as(block_table)
    used = logical < ((seq_lens + block_size - 1) // block_size).unsqueeze(1)
    # unused entries (padding) write into one dump slot past the end; equal duplicates make scatter's order moot
    target = torch.where(used, block_table.long(), num_cache_blocks)
    p2l = torch.full((num_cache_blocks + 1,), -1, dtype=torch.int32, device=block_table.device)
    return p2l.scatter_(0, target.flatten(), logical.flatten())[:num_cache_blocks]


def check_logical_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> None:
    """Raise ValueError when one physical block sits at two logical indices among the rows' used blocks (the
    invariant p2l rests on). Syncs with the device: a debugging aid, not part of the step path."""
    cpu_table, cpu_lens = block_table.cpu().long(), seq_lens.cpu().long()
    seen: dict[int, int] = {}
    for row, length in zip(cpu_table.tolist(), cpu_lens.tolist()):
        for logical, block in enumerate(row[:-(-length // block_size)]):
            if seen.setdefault(block, logical) != logical:
                raise ValueError(f"block {block} sits at logical index {seen[block]} in one row and {logical} in "
                                 f"another: the flex backend's physical-to-logical map cannot mask it")


def _compact(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept values moved to its front, in order.

    Args:
        values: int [R, C]; keep: bool [R, C].
    Returns:
        (counts int32 [R], indices int32 [R, C]), entries past a row's count set to block 0 (never read).
    """
    order = torch.argsort((~keep).to(torch.int32), dim=-1, stable=True)
    counts = keep.sum(-1, dtype=torch.int32)
    packed = values.gather(-1, order)
    columns = torch.arange(values.shape[-1], device=values.device)
    return counts, torch.where(columns < counts.unsqueeze(-1), packed, 0).to(torch.int32)


def _mask_mod(table: torch.Tensor, p2l: torch.Tensor, row_of: torch.Tensor, qpos_of: torch.Tensor, by_batch: bool,
              block_size: int, window: int | None):
    """mask_mod(b, h, q, kv) -> bool: slot kv is one of the query's row's blocks, at a position <= the query's and
    (with a window) greater than query - window.

    Args:
        table: int32 [rows, W] block-table rows; p2l: int32 [N+1].
        row_of: int32, the table row of each batch index (`by_batch`) or each query index; qpos_of: int32, the
            query's position, the same way indexed (-1 for padding: nothing is visible from it).
    """
    def mask_mod(b, h, q, kv):
        index = b if by_batch else q
        row, qpos = row_of[index], qpos_of[index]
        block = kv // block_size
        logical = p2l[block]
        known = logical >= 0
        logical = torch.clamp(logical, min=0)
        kpos = logical * block_size + kv % block_size
        ok = known & (table[row, logical] == block) & (kpos <= qpos)
        if window is not None:
            ok = ok & (kpos > qpos - window)
        return ok
    return mask_mod


@dataclass
class FormInputs:
    """One call form's per-step tensors, padded to its buckets (on the cache's device).

    Attributes:
        table: int32 [rows, W] the rows' block-table rows (padding rows and columns: the null block).
        seq_lens: int32 [rows] (padding rows: 0).
        query_start: int32 [rows + 1] the rows' query tokens in the form's packed order (packed form only).
        row_of, qpos_of: int32, per batch row (decode) or per query token (packed): table row and position.
        num_queries: queries the form computes (padded): decode rows or packed tokens.
    """

    table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor | None
    row_of: torch.Tensor
    qpos_of: torch.Tensor
    num_queries: int


def decode_inputs(block_table: torch.Tensor, seq_lens: torch.Tensor, rows: int, width: int) -> FormInputs:
    """The decode form's inputs for the first table rows (one query each), padded to `rows` x `width`."""
    real, table_width = block_table.shape
    device = block_table.device
    # padding holds block 0, not the null block's id: mask_mod rejects it (seq_len 0, or not the row's block)
    table = torch.nn.functional.pad(block_table, (0, width - table_width, 0, rows - real))
    lens = torch.nn.functional.pad(seq_lens, (0, rows - real))
    return FormInputs(table, lens, None, torch.arange(rows, dtype=torch.int32, device=device), lens - 1, rows)


def packed_inputs(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, num_tokens: int,
                  rows: int, width: int, tokens: int) -> FormInputs:
    """The packed form's inputs for prefill rows.

    Args:
        block_table: int32 [B, W], seq_lens int32 [B]: the prefill rows only.
        query_start: int32 [B + 1], their tokens' offsets within the packed prefill tokens (starting at 0).
        num_tokens: real prefill tokens (query_start[-1], known on the host from the query's shape).
        rows, width, tokens: the padded sizes.
    """
    real, table_width = block_table.shape
    device = block_table.device
    table = torch.nn.functional.pad(block_table, (0, width - table_width, 0, rows - real))
    lens = torch.nn.functional.pad(seq_lens, (0, rows - real))
    # padding rows start and end at the last real token, so they own no token
    starts = torch.cat([query_start, query_start[-1:].expand(rows - real)])
    token = torch.arange(tokens, dtype=torch.int32, device=device)
    row = torch.searchsorted(starts[1:real + 1], token, right=True).clamp(max=real - 1).to(torch.int32)
    qpos = lens[row] - (starts[row + 1] - token)
    qpos = torch.where(token < num_tokens, qpos, -1).to(torch.int32)
    return FormInputs(table, lens, starts, row, qpos, tokens)


def decode_block_lists(inputs: FormInputs, block_size: int, window: int | None):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of the decode form: per row, int32 [rows]
    and [rows, W]. Row b reads logical blocks first..last of its table row (first: where its window starts); a
    block is full when every slot is at or before the query and inside the window."""
    table, lens = inputs.table, inputs.seq_lens
    logical = torch.arange(table.shape[1], device=table.device).unsqueeze(0)  # [1, W]
    qpos = (lens - 1).unsqueeze(1)  # [rows, 1]; padding rows: -1, reading nothing
    first_key = torch.zeros_like(qpos) if window is None else torch.clamp(qpos - window + 1, min=0)
    in_range = (logical >= first_key // block_size) & (logical * block_size <= qpos)
    full = in_range & ((logical + 1) * block_size - 1 <= qpos) & (logical * block_size >= first_key)
    return (*_compact(table, in_range & ~full), *_compact(table, full))


def packed_block_lists(inputs: FormInputs, block_size: int, window: int | None):
    """The same four lists for the packed form, per query block: int32 [query blocks] and [query blocks, C].

    For each query block and each of the (at most QUERY_BLOCK) rows its tokens belong to, the candidates are that
    row's logical blocks from where its first token's window starts to its last token's block. A block is full
    only when the query block holds tokens of that one row alone and every slot is visible from all of them;
    the rest are partial, de-duplicated across rows (shared prefix blocks).
    """
    table, starts = inputs.table, inputs.query_start
    device = table.device
    rows, width = table.shape
    num_blocks_q = inputs.num_queries // QUERY_BLOCK
    block_start = torch.arange(num_blocks_q, device=device).unsqueeze(1) * QUERY_BLOCK  # [Qb, 1]
    block_end = block_start + QUERY_BLOCK
    first_row = inputs.row_of[block_start.squeeze(1)].unsqueeze(1)  # [Qb, 1]
    last_row = inputs.row_of[block_end.squeeze(1) - 1].unsqueeze(1)
    row = first_row + torch.arange(QUERY_BLOCK, device=device).unsqueeze(0)  # [Qb, R]
    present = row <= last_row
    row = torch.clamp(row, max=rows - 1)
    row_start, row_end, length = starts[row], starts[row + 1], inputs.seq_lens[row]
    first_token = torch.maximum(row_start, block_start)
    last_token = torch.minimum(row_end, block_end) - 1
    present = present & (first_token <= last_token)  # padding rows own no token
    first_q = length - (row_end - first_token)  # positions of the row's first and last token in the block
    last_q = length - (row_end - last_token)
    first_key = torch.zeros_like(first_q) if window is None else torch.clamp(first_q - window + 1, min=0)
    last_first_key = torch.zeros_like(last_q) if window is None else last_q - window + 1
    logical = torch.arange(width, device=device)  # [W]
    in_range = (present.unsqueeze(2) & (logical >= (first_key // block_size).unsqueeze(2))
                & (logical * block_size <= last_q.unsqueeze(2)))  # [Qb, R, W]
    alone = (row_start <= block_start) & (row_end >= block_end)  # every query of the block is this row's
    full = (in_range & alone.unsqueeze(2) & ((logical + 1) * block_size - 1 <= first_q.unsqueeze(2))
            & (logical * block_size >= last_first_key.unsqueeze(2)))
    blocks = table[row]  # [Qb, R, W]
    partial = torch.where(in_range & ~full, blocks, _NO_BLOCK).flatten(1)  # [Qb, R*W]
    partial, _ = partial.sort(dim=-1)
    repeated = torch.cat([torch.zeros_like(partial[:, :1], dtype=torch.bool), partial[:, 1:] == partial[:, :-1]], 1)
    keep = (partial != _NO_BLOCK) & ~repeated
    return (*_compact(partial, keep), *_compact(blocks.flatten(1), full.flatten(1)))


def block_mask(lists, mask_mod, decode: bool, num_queries: int, num_cache_blocks: int, block_size: int) -> BlockMask:
    """A BlockMask over the whole cache view from four block lists and the mask_mod.

    Args:
        lists: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), int32: per decode row ([rows],
            [rows, C]) or per packed query block ([Qb], [Qb, C]).
        decode: the decode form (one batch row per sequence, query length 1) or the packed one (one batch row of
            num_queries tokens).
    """
    def shaped(counts, indices):
        if decode:  # [B, H=1, one query block] and [B, 1, 1, C]
            return counts.view(-1, 1, 1), indices.view(indices.shape[0], 1, 1, -1)
        return counts.view(1, 1, -1), indices.view(1, 1, *indices.shape)  # [1, 1, Qb] and [1, 1, Qb, C]

    kv_num, kv_indices = shaped(*lists[:2])
    full_num, full_indices = shaped(*lists[2:])
    q_block = DECODE_QUERY_BLOCK if decode else QUERY_BLOCK
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=(q_block, block_size),
                                    mask_mod=mask_mod, seq_lengths=(1 if decode else num_queries,
                                                                    num_cache_blocks * block_size),
                                    compute_q_blocks=False)  # q-major lists are for the backward pass only


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
            compiles once; tests turn it on eagerly to check that padding changes nothing).
        check_invariants: check the one-logical-index-per-block invariant each step (syncs; for tests).
    """

    name = "flex"

    def __init__(self, block_size: int, device: torch.device = torch.device("cpu"),
                 compile_backend: str | None = None, pad_shapes: bool | None = None, check_invariants: bool = False):
        self.block_size = block_size
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
        padded_width = width_bucket(width) if pad else width
        p2l = logical_block_map(table, lens, key_cache.shape[0], bs)
        decode = None
        if d:
            decode = decode_inputs(table[:d], lens[:d], decode_bucket(d) if pad else d, padded_width)
        packed, prefill_tokens = None, num_tokens - d
        if num_rows > d:
            starts = meta.query_start_loc.to(device, torch.int32, non_blocking=True)[d:] - d
            prefill_rows = num_rows - d
            tokens = token_bucket(prefill_tokens) if pad else -(-prefill_tokens // QUERY_BLOCK) * QUERY_BLOCK
            packed = packed_inputs(table[d:], lens[d:], starts, prefill_tokens,
                                   decode_bucket(prefill_rows) if pad else prefill_rows, padded_width, tokens)
        return _StepMasks(d, prefill_tokens, decode, packed, p2l, {})

    def _masks(self, step: _StepMasks, window: int | None, num_cache_blocks: int):
        """(decode BlockMask, packed BlockMask) for this window, built once per step."""
        if window not in step.masks:
            bs = self.block_size
            decode = packed = None
            if step.decode is not None:
                form = step.decode
                mod = _mask_mod(form.table, step.p2l, form.row_of, form.qpos_of, True, bs, window)
                decode = block_mask(decode_block_lists(form, bs, window), mod, True, 1, num_cache_blocks, bs)
            if step.packed is not None:
                form = step.packed
                mod = _mask_mod(form.table, step.p2l, form.row_of, form.qpos_of, False, bs, window)
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
        decode_mask, packed_mask = self._masks(step, features.sliding_window, key_cache.shape[0])
        heads = key_cache.shape[2]
        # [N+1, bs, Hkv, D] -> [1, Hkv, (N+1)*bs, D], a strided view: no copy of the cache
        keys = key_cache.view(-1, heads, key_cache.shape[3]).permute(1, 0, 2).unsqueeze(0)
        values = value_cache.view(-1, heads, value_cache.shape[3]).permute(1, 0, 2).unsqueeze(0)
        d, t = step.num_decodes, query.shape[0]
        parts = []
        if decode_mask is not None:
            q = self._padded(query[:d], step.decode.num_queries, 0).unsqueeze(2)  # [B, H, 1, D]
            parts.append(self._attend(q, keys, values, decode_mask, features, "decode")[:d, :, 0])
        if packed_mask is not None:
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
