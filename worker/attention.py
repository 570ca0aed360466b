"""Paged attention plugged into transformers' attention interface.

transformers calls the registered function once per layer with the new tokens' query/key/value (after
RoPE) and passes through any extra keyword given to the model's forward, so the step's `PagedAttentionMetadata`
travels as the keyword `paged_attention`. The function first writes every new key/value into the paged
cache (so a sequence can read blocks that another sequence of the same step fills), then attends each
sequence over its own blocks: prefills one by one, decodes together in one padded batch. No dense mask
across requests is ever built, and the cache is never copied.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "shuttle_paged"


@dataclass
class PrefillSeq:
    """A sequence computing several tokens this step.

    Attributes:
        query_start, query_end: its rows in the packed batch.
        context_slots: int64 [context_len], cache slots of all its tokens so far (new ones included).
        mask: bool [num_query, context_len], True where attention is allowed; None when plain causal.
    """

    query_start: int
    query_end: int
    context_slots: torch.Tensor
    mask: torch.Tensor | None


@dataclass
class DecodeBatch:
    """Sequences computing exactly one token this step, attended together.

    Attributes:
        query_rows: int64 [B], their rows in the packed batch.
        context_slots: int64 [B, max_context], cache slots, padded with slot 0.
        mask: bool [B, 1, 1, max_context], False on padding.
    """

    query_rows: torch.Tensor
    context_slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class PagedAttentionMetadata:
    """Everything attention needs for one step, built once and shared by all layers.

    Attributes:
        kv_caches: per layer (key, value), each [num_blocks * block_size, num_kv_heads, head_dim].
        slot_mapping: int64 [T], cache slot of each packed token.
    """

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    slot_mapping: torch.Tensor
    prefills: list[PrefillSeq]
    decodes: DecodeBatch | None


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            paged_attention: PagedAttentionMetadata | None = None, **kwargs):
    """Attention over the paged cache for one layer.

    Args:
        query: [1, num_heads, T, head_dim]; key, value: [1, num_kv_heads, T, head_dim] (packed tokens).
        paged_attention: the step's metadata (required).
    Returns:
        ([1, T, num_heads, head_dim], None), the layout transformers' attention functions return.
    Raises:
        ValueError: called without metadata (the model was run outside the worker).
    """
    if paged_attention is None:
        raise ValueError("shuttle_paged attention needs the `paged_attention` metadata keyword")
    meta = paged_attention
    key_cache, value_cache = meta.kv_caches[module.layer_idx]
    key_cache.index_copy_(0, meta.slot_mapping, key[0].transpose(0, 1))  # [T, kv_heads, head_dim]
    value_cache.index_copy_(0, meta.slot_mapping, value[0].transpose(0, 1))

    q = query[0]  # [heads, T, head_dim]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, heads, head_dim]
    for seq in meta.prefills:
        keys = key_cache[seq.context_slots].transpose(0, 1)  # [kv_heads, context, head_dim]
        values = value_cache[seq.context_slots].transpose(0, 1)
        attended = F.scaled_dot_product_attention(
            q[:, seq.query_start:seq.query_end].unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0),
            attn_mask=seq.mask, is_causal=seq.mask is None, scale=scaling, enable_gqa=True)  # [1, heads, n, hd]
        out[seq.query_start:seq.query_end] = attended[0].transpose(0, 1)
    if meta.decodes is not None:
        batch = meta.decodes
        queries = q[:, batch.query_rows].transpose(0, 1).unsqueeze(2)  # [B, heads, 1, head_dim]
        keys = key_cache[batch.context_slots].permute(0, 2, 1, 3)  # [B, kv_heads, context, head_dim]
        values = value_cache[batch.context_slots].permute(0, 2, 1, 3)
        attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=batch.mask, scale=scaling,
                                                  enable_gqa=True)  # [B, heads, 1, head_dim]
        out[batch.query_rows] = attended[:, :, 0]
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    """transformers must not build a mask for packed batches: paged attention masks per sequence."""
    return None


def register() -> str:
    """Register the backend with transformers; returns the `attn_implementation` name to load models with."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
