"""Attention backends: how one layer attends the step's packed queries over the paged KV cache.

A backend gets the step's AttentionMetadata (worker/attention.py) and the layer's features and returns the
attention output; how it loops (or doesn't) is its own business.

- `reference`: one sequence at a time; each sequence's context blocks are gathered and attended with torch's
  SDPA (or explicit math when the layer soft-caps or has sinks). Simple, every feature, any device and dtype.
- `cpu` (the CPU default): decode rows all at once through the numba kernel of worker/decode_kernel.py, which
  reads a float32 or bfloat16 cache in place and accumulates in float32 (queries of either dtype); prefill chunks
  one sequence at a time as in `reference` (torch's CPU SDPA, which accumulates bfloat16 in float32 too). On a CPU the
  kernel beats the per-sequence loop for tiny models (the loop's Python overhead dominates) and for a
  110M Llama (no gather copy of the context), and a padded batched SDPA with a mask loses to both (torch falls
  back to its math path); scripts/dev/bench_overhead.py measures the three.
- `flex`: torch's FlexAttention over the cache in place, decodes and prefill chunks each in one call per layer
  (worker/flex_attention.py): compiled on CUDA, eager (unfused, for tests) on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shuttle.common.devices import AUTO_ATTENTION_BACKEND
from shuttle.worker.attention import AttentionMetadata, LayerFeatures
from shuttle.worker.flex_attention import FlexBackend


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, query_start: int, key_start: int,
           features: LayerFeatures, mask_cache: dict | None = None) -> torch.Tensor:
    """Causal attention of one sequence's consecutive queries over its consecutive keys.

    Args:
        query: [n, num_heads, head_dim] at positions query_start .. query_start + n - 1.
        key: [L, num_kv_heads, head_dim], value: [L, num_kv_heads, v_head_dim] at positions key_start ..
            key_start + L - 1 (L covers the last query's position).
        mask_cache: optional dict to reuse masks across the layers of a step.
    Returns:
        [n, num_heads, v_head_dim].
    """
    n, length = query.shape[0], key.shape[0]
    mask = _mask(query_start, n, key_start, length, features.sliding_window, mask_cache, device=query.device)
    q, k, v = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)  # heads first
    if features.softcap is None and features.sinks is None:
        causal = mask is None and n > 1
        out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                             is_causal=causal, scale=features.scaling, enable_gqa=True)[0]
        return out.transpose(0, 1)
    num_heads, num_kv_heads = q.shape[0], k.shape[0]
    group = num_heads // num_kv_heads
    # [kv_heads, group, n, d] @ [kv_heads, 1, d, L] -> [kv_heads, group, n, L]
    scores = q.reshape(num_kv_heads, group, n, -1) @ k.unsqueeze(1).transpose(-1, -2) * features.scaling
    if features.softcap is not None:
        scores = torch.tanh(scores / features.softcap) * features.softcap
    if mask is None and n > 1:
        mask = _mask(query_start, n, key_start, length, None, None, force=True, device=query.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if features.sinks is not None:
        sinks = features.sinks.to(scores.dtype).reshape(num_kv_heads, group, 1, 1).expand(-1, -1, n, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = scores.softmax(dim=-1)
    out = probs.to(v.dtype) @ v.unsqueeze(1)  # [kv_heads, group, n, dv]
    return out.reshape(num_heads, n, -1).transpose(0, 1)


def _mask(query_start: int, n: int, key_start: int, length: int, window: int | None, cache: dict | None,
          force: bool = False, device: torch.device | None = None) -> torch.Tensor | None:
    """bool [n, L] on `device` (default: the CPU), True where query i may attend key j: j <= i and (no window or
    j > i - window). None when the plain causal alignment says it all (one query over all keys, or n == L from
    position key_start)."""
    if not force and window is None and (n == 1 or (query_start == key_start and n == length)):
        return None
    span = query_start + 1 - key_start
    if window is not None and n == 1 and span <= window and span == length:
        return None  # one query whose whole gathered context lies inside its window
    cache_key = (query_start, n, key_start, length, window, device)
    if cache is not None and cache_key in cache:
        return cache[cache_key]
    query_pos = torch.arange(query_start, query_start + n, device=device).unsqueeze(1)
    key_pos = torch.arange(key_start, key_start + length, device=device).unsqueeze(0)
    mask = key_pos <= query_pos
    if window is not None:
        mask &= key_pos > query_pos - window
    if cache is not None:
        cache[cache_key] = mask
    return mask


class ReferenceBackend:
    """One sequence at a time over its gathered context blocks (the reference every other backend must match)."""

    name = "reference"
    compiled = False  # runs eagerly: no shapes to compile at start-up (FlexBackend's is per device)

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._masks: dict = {}

    def begin_step(self) -> None:
        """Forget the previous step's masks (each step has its own shapes)."""
        self._masks = {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, features: LayerFeatures) -> torch.Tensor:
        """query [T, num_heads, head_dim], the step's new key/value [T, num_kv_heads, *] (already in the cache)
        -> [T, num_heads, v_head_dim]."""
        out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[3])
        self.attend_rows(range(meta.num_seqs), query, key, value, key_cache, value_cache, meta, features, out)
        return out

    def attend_rows(self, rows, query, key, value, key_cache, value_cache, meta: AttentionMetadata,
                    features: LayerFeatures, out: torch.Tensor) -> None:
        """Fill `out` for the given sequence rows, one sequence at a time."""
        bs = self.block_size
        starts, lens = meta.query_start_list, meta.seq_lens_list
        for b in rows:
            q0, q1, context = starts[b], starts[b + 1], lens[b]
            first_query = context - (q1 - q0)
            if first_query == 0:  # a prompt's first chunk: its keys are this step's own, no cache read needed
                out[q0:q1] = attend(query[q0:q1], key[q0:q1], value[q0:q1], 0, 0, features, self._masks)
                continue
            key_start = 0 if features.sliding_window is None else max(0, first_query - features.sliding_window + 1)
            first_block = key_start // bs
            blocks = meta.block_table[b, first_block:-(-context // bs)]
            key_start = first_block * bs
            # a --kv-cache-dtype other than the model's is widened (or rounded) to the queries' dtype here
            keys = key_cache[blocks].flatten(0, 1)[:context - key_start].to(query.dtype)
            values = value_cache[blocks].flatten(0, 1)[:context - key_start].to(query.dtype)
            out[q0:q1] = attend(query[q0:q1], keys, values, first_query, key_start, features, self._masks)


# Query dtypes whose decode rows go through the numba kernel (float16 ones take the per-sequence loop).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CpuBackend(ReferenceBackend):
    """Decode rows through the numba paged kernel (in place, all at once); prefill chunks as `reference`."""

    name = "cpu"

    def __init__(self, block_size: int):
        super().__init__(block_size)
        from shuttle.worker import decode_kernel  # numba loads only where this backend is used
        self._kernel = decode_kernel

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, features: LayerFeatures) -> torch.Tensor:
        d = meta.num_decodes
        kernel = query.dtype in KERNEL_DTYPES and key_cache.dtype in self._kernel.CACHE_VIEWS
        if d == meta.seq_lens.shape[0] and kernel:  # the rows' count from a tensor: a compiled forward has no lists
            return self._decode(query, key_cache, value_cache, meta, features).to(query.dtype)
        out = query.new_empty(query.shape[0], query.shape[1], value_cache.shape[3])
        first = 0
        if d and kernel:
            out[:d] = self._decode(query[:d], key_cache, value_cache, meta, features, d)  # rounded to out's dtype
            first = d
        self.attend_rows(range(first, meta.num_seqs), query, key, value, key_cache, value_cache, meta, features, out)
        return out

    def _decode(self, query, key_cache, value_cache, meta: AttentionMetadata, features: LayerFeatures,
                rows: int | None = None) -> torch.Tensor:
        block_table, seq_lens = meta.block_table, meta.seq_lens
        if rows is not None:
            block_table, seq_lens = block_table[:rows], seq_lens[:rows]
        if torch.compiler.is_compiling():  # traced by worker/cpu_compiled_decode.py: the kernel as one operator
            return self._kernel.paged_decode_op(query, key_cache, value_cache, block_table, seq_lens, features.scaling,
                                                features.sliding_window or 0, features.softcap or 0.0, features.sinks)
        return self._kernel.paged_decode(query, key_cache, value_cache, block_table, seq_lens, features.scaling,
                                         features.sliding_window, features.softcap, features.sinks)


BACKENDS = {backend.name: backend for backend in (ReferenceBackend, CpuBackend, FlexBackend)}


def make_backend(name: str, block_size: int, device: torch.device, max_blocks_per_seq: int | None = None):
    """The attention backend `name` ("auto": `cpu` on a CPU, `flex` on CUDA, else `reference`; common/devices.py
    resolves it the same way for the launcher). `max_blocks_per_seq` (KV blocks of one max_model_len sequence)
    fixes the compiled flex backend's table width (see FlexBackend).

    Raises:
        ValueError: an unknown name, or a CPU-only backend on another device.
    """
    if name == "auto":
        name = AUTO_ATTENTION_BACKEND.get(device.type, "reference")
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    if name == "cpu" and device.type != "cpu":
        raise ValueError("the cpu attention backend runs on the CPU only")
    if name == "flex":
        return FlexBackend(block_size, device, max_blocks_per_seq=max_blocks_per_seq)
    return BACKENDS[name](block_size)
