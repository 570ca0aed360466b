"""A CPU paged-attention kernel for decode rows, compiled with numba: it reads K and V in place through the block
table, so no per-sequence gather copy and no Python loop over sequences.

Each sequence's context is cut into partitions of PARTITION_TOKENS positions, and the partitions of all sequences
are the parallel work items (split-K over the context, as in FlashDecoding and vLLM's paged attention v2), so one
long sequence keeps every core busy instead of one. An item computes the scores of all heads four positions at a time
(each position's keys of every head are one contiguous row of the cache), exponentiates them against its own maximum
(exp_of_nonpositive: vectorized, where math.exp is a libm call per element) and sums the weighted V rows position by
position; a second pass rescales each sequence's partitions to their common maximum
(with attention sinks in the denominator when the layer has them) and adds them up. Soft-capping applies per score.
Accumulation is float32, the same as torch's CPU attention; results match it within ~1e-6.

A bfloat16 cache is read in place too: numba has no bfloat16, so the kernel gets the cache viewed as uint16 and widens
each element to float32 where it reads it (worker/numba_widen.py: a 16-bit shift, exact). The
same source compiles once per cache type; for a float32 cache the widening is the identity, so that machine code is
the one it always was. Queries come in as float32 (the caller widens them, bfloat16 -> float32 being exact) and the
output is float32, for the caller to round to the model's dtype.

numba compiles on first use (a few seconds) and caches the machine code next to this file, so a worker warms it up
at start-up (`warm_up`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from numba import njit, prange, set_num_threads

from shuttle.worker.numba_widen import float32_of_bits, widen

_LOG2E = np.float32(1.4426950408889634)
_LN2_HIGH = np.float32(0.693359375)  # ln 2 in two parts (Cody and Waite): the high one has few enough bits that
_LN2_LOW = np.float32(-2.12194440e-4)  # k * _LN2_HIGH is exact for every k this range reduction meets
_EXP_UNDERFLOW = np.float32(-87.0)  # exp of anything below is under float32's smallest normal: taken as 0


@njit(fastmath={"reassoc", "contract", "nsz"}, inline="always")
def exp_of_nonpositive(x):
    """exp(x) in float32 for x <= 0 (-inf included), within 1.5e-7 relative of the exact value (1.25 units in the
    last place), in straight-line float32 code that LLVM vectorizes (numba's math.exp is a scalar libm call per
    element: 15x slower over a partition's scores).

    exp(x) = 2^k exp(r) with k = round(x / ln 2) and |r| <= ln 2 / 2; exp(r) by its Taylor series to r^7 (the
    remainder, under 0.35^8 / 8!, is below float32's rounding), 2^k by writing k into the exponent bits. Below
    _EXP_UNDERFLOW the result is 0.
    """
    clamped = max(x, _EXP_UNDERFLOW)
    k = np.floor(clamped * _LOG2E + np.float32(0.5))  # float32 (math.floor gives an int64, and float64 after)
    r = (clamped - k * _LN2_HIGH) - k * _LN2_LOW
    p = np.float32(1.0 / 5040.0)
    p = p * r + np.float32(1.0 / 720.0)
    p = p * r + np.float32(1.0 / 120.0)
    p = p * r + np.float32(1.0 / 24.0)
    p = p * r + np.float32(1.0 / 6.0)
    p = p * r + np.float32(0.5)
    p = p * r + np.float32(1.0)
    p = p * r + np.float32(1.0)
    power = float32_of_bits(np.uint32(np.int32(k) + 127) << np.uint32(23))
    return p * power if x >= _EXP_UNDERFLOW else np.float32(0.0)


# Reassociation lets LLVM vectorize the dot products; infinities and NaNs keep their IEEE meaning (masking uses -inf).
@njit(parallel=True, fastmath={"reassoc", "contract", "nsz"}, cache=True, boundscheck=False)
def _paged_decode(q, key_rows, value_rows, block_table, seq_lens, block_size, scale, window, softcap, sinks,
                  has_sinks, partition, out):
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_rows.shape[1]
    v_head_dim = value_rows.shape[2]
    group = num_heads // num_kv_heads
    # Work items: each sequence's attended span cut into partitions of `partition` positions, numbered sequence
    # after sequence (sequence b owns items offsets[b] .. offsets[b + 1] - 1).
    firsts = np.empty(num_seqs, dtype=np.int64)
    offsets = np.empty(num_seqs + 1, dtype=np.int64)
    offsets[0] = 0
    for b in range(num_seqs):
        context = seq_lens[b]
        first = 0
        if window > 0 and context - window > 0:
            first = context - window
        firsts[b] = first
        offsets[b + 1] = offsets[b] + (context - first + partition - 1) // partition
    num_items = offsets[num_seqs]
    owner = np.empty(num_items, dtype=np.int64)
    for b in range(num_seqs):
        for item in range(offsets[b], offsets[b + 1]):
            owner[item] = b
    # Per item and head: the largest score, the sum of exp(score - largest) and the V rows weighted by those exps.
    part_max = np.empty((num_items, num_heads), dtype=np.float32)
    part_sum = np.empty((num_items, num_heads), dtype=np.float32)
    part_acc = np.empty((num_items, num_heads, v_head_dim), dtype=np.float32)
    for item in prange(num_items):
        b = owner[item]
        start = firsts[b] + (item - offsets[b]) * partition
        end = min(start + partition, seq_lens[b])
        span = end - start
        # The cache row (block * block_size + offset) of each attended position, walked block by block so that no
        # integer division is left in the loops below (it dominated small heads: 2x on head_dim 8).
        rows = np.empty(span, dtype=np.int64)
        for blk in range(start // block_size, (end - 1) // block_size + 1):
            base = blk * block_size
            for j in range(max(start, base), min(end, base + block_size)):
                rows[j - start] = block_table[b, blk] * block_size + j - base
        # Four positions at a time, all heads: each position's keys of every head are one contiguous row of the cache
        # (3x faster than a pass per KV head, which strides over the rows, on a 110M Llama), and each query element
        # read serves four positions.
        scores = np.empty((num_heads, span), dtype=np.float32)
        quads = span - span % 4
        for col in range(0, quads, 4):
            r0, r1, r2, r3 = rows[col], rows[col + 1], rows[col + 2], rows[col + 3]
            for kv_head in range(num_kv_heads):
                for h in range(kv_head * group, (kv_head + 1) * group):
                    s0 = np.float32(0.0)
                    s1 = np.float32(0.0)
                    s2 = np.float32(0.0)
                    s3 = np.float32(0.0)
                    for d in range(head_dim):
                        qd = q[b, h, d]
                        s0 += qd * widen(key_rows[r0, kv_head, d])
                        s1 += qd * widen(key_rows[r1, kv_head, d])
                        s2 += qd * widen(key_rows[r2, kv_head, d])
                        s3 += qd * widen(key_rows[r3, kv_head, d])
                    scores[h, col] = s0
                    scores[h, col + 1] = s1
                    scores[h, col + 2] = s2
                    scores[h, col + 3] = s3
        for col in range(quads, span):
            row = rows[col]
            for kv_head in range(num_kv_heads):
                for h in range(kv_head * group, (kv_head + 1) * group):
                    s = np.float32(0.0)
                    for d in range(head_dim):
                        s += q[b, h, d] * widen(key_rows[row, kv_head, d])
                    scores[h, col] = s
        for h in range(num_heads):
            top = np.float32(-np.inf)
            for i in range(span):
                s = scores[h, i] * scale
                if softcap > 0.0:
                    s = softcap * math.tanh(s / softcap)
                scores[h, i] = s
                top = max(top, s)
            total = np.float32(0.0)
            for i in range(span):
                e = exp_of_nonpositive(scores[h, i] - top)
                scores[h, i] = e
                total += e
            part_max[item, h] = top
            part_sum[item, h] = total
        # Position by position: summing four positions' weighted rows before they meet the accumulator was 2x faster
        # with the rows in cache but 30% slower streaming them from memory, as at 64 sequences.
        acc = part_acc[item]
        acc[:] = 0.0
        for col in range(span):
            row = rows[col]
            for kv_head in range(num_kv_heads):
                for h in range(kv_head * group, (kv_head + 1) * group):
                    p = scores[h, col]
                    for d in range(v_head_dim):
                        acc[h, d] += p * widen(value_rows[row, kv_head, d])
    # Each sequence's partitions rescaled to their common maximum (the sink logit included) and summed.
    for b in prange(num_seqs):
        for h in range(num_heads):
            top = np.float32(-np.inf)
            if has_sinks:
                top = sinks[h]
            for item in range(offsets[b], offsets[b + 1]):
                top = max(top, part_max[item, h])
            total = np.float32(0.0)
            if has_sinks:
                total = np.float32(math.exp(sinks[h] - top))
            for d in range(v_head_dim):
                out[b, h, d] = 0.0
            for item in range(offsets[b], offsets[b + 1]):
                weight = np.float32(math.exp(part_max[item, h] - top))
                total += part_sum[item, h] * weight
                for d in range(v_head_dim):
                    out[b, h, d] += weight * part_acc[item, h, d]
            inverse = np.float32(1.0) / total
            for d in range(v_head_dim):
                out[b, h, d] *= inverse


_NO_SINKS = np.zeros(1, dtype=np.float32)

# Positions per work item. A fixed length, not one fitted to the batch or the thread count, so that a sequence's
# attention sums in the same order whichever sequences share its step. 128 keeps every thread busy at one sequence
# of a few hundred tokens on a few cores and at one of a few thousand on many; from 16 sequences up the step time
# is the same for partitions of 64 to 512 positions (scripts/dev/bench_decode_kernel.py).
PARTITION_TOKENS = 128

# Cache dtypes the kernel reads, and the numpy view it reads each through.
CACHE_VIEWS = {torch.float32: torch.float32, torch.bfloat16: torch.uint16}


def paged_decode(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None, partition: int = PARTITION_TOKENS) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context, accumulated in float32.

    Args:
        query: [B, num_heads, head_dim], float32 or bfloat16 (widened to float32 here).
        key_cache: float32 or bfloat16 [num_blocks, block_size, num_kv_heads, head_dim]; value_cache: the same dtype
            with v_head_dim.
        block_table: int32 [B, W]; seq_lens: int32 [B] (context length, the query's own token included).
        scale: multiplier of q.k; window: attend only the last `window` positions (None: all);
        softcap: cap of tanh soft-capping (None: off); sinks: float [num_heads] sink logits (None: off).
        partition: positions per parallel work item (PARTITION_TOKENS; tests pass small ones).
    Returns:
        float32 [B, num_heads, v_head_dim].
    """
    view = CACHE_VIEWS[key_cache.dtype]
    out = torch.empty(query.shape[0], query.shape[1], value_cache.shape[3], dtype=torch.float32)
    sink_array = sinks.detach().float().contiguous().numpy() if sinks is not None else _NO_SINKS
    # [blocks * block_size, kv_heads, head_dim]
    key_rows = key_cache.view(-1, *key_cache.shape[2:]).view(view).numpy()
    value_rows = value_cache.view(-1, *value_cache.shape[2:]).view(view).numpy()
    _paged_decode(query.float().contiguous().numpy(), key_rows, value_rows, block_table.contiguous().numpy(),
                  seq_lens.contiguous().numpy(), key_cache.shape[1], np.float32(scale), int(window or 0),
                  np.float32(softcap or 0.0), sink_array, sinks is not None, partition, out.numpy())
    return out


@torch.library.custom_op("shuttle::paged_decode", mutates_args=(),
                         schema="(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
                                "Tensor seq_lens, float scale, int window, float softcap, Tensor? sinks) -> Tensor")
def paged_decode_op(query, key_cache, value_cache, block_table, seq_lens, scale, window, softcap, sinks):
    """`paged_decode` as a torch operator, for a compiled forward (worker/cpu_compiled_decode.py): torch.compile
    calls it as one opaque kernel instead of tracing into numba. The same arguments, except that `window` 0 and
    `softcap` 0.0 mean off (an operator schema has no optional int or float here). Returns float32 [B, num_heads,
    v_head_dim]."""
    return paged_decode(query, key_cache, value_cache, block_table, seq_lens, scale, window or None, softcap or None,
                        sinks)


@paged_decode_op.register_fake
def _paged_decode_shape(query, key_cache, value_cache, block_table, seq_lens, scale, window, softcap, sinks):
    """The operator's output as torch.compile traces it: shape and dtype only."""
    return query.new_empty((query.shape[0], query.shape[1], value_cache.shape[3]), dtype=torch.float32)


def warm_up(num_threads: int, cache_dtypes=(torch.float32,)) -> None:
    """Compile (or load the cached compilation) for each cache dtype now, not on the first request, and match
    torch's threads."""
    set_num_threads(max(1, num_threads))
    for dtype in cache_dtypes:
        cache = torch.zeros(2, 4, 1, 2, dtype=dtype)
        paged_decode(torch.zeros(1, 1, 2), cache, cache, torch.zeros(1, 1, dtype=torch.int32),
                     torch.ones(1, dtype=torch.int32), 1.0, None, None, None)
    # The first parallel launch starts numba's OpenMP pool, which sets the process's OpenMP thread count to
    # NUMBA_NUM_THREADS (the core count unless the launcher set it, common/cpu_threads.py) and with it torch's
    # intra-op threads: an in-process engine asked for 1 would get a second torch thread. Later launches keep it.
    torch.set_num_threads(max(1, num_threads))
