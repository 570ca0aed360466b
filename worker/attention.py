"""Paged attention plugged into transformers' attention interface.

transformers calls the registered function once per layer with the new tokens' query/key/value (after RoPE)
and passes through any extra keyword given to the model's forward, so the step's `StepAttention` (metadata,
caches and backend) travels as the keyword `paged_attention`. The function writes every new key/value into the
paged cache first (so a sequence can read blocks that another sequence of the same step fills), then hands the
layer to the step's attention backend (worker/attention_backends.py). No dense mask across requests is built,
and the cache is never copied whole.

The model's own per-layer attention features arrive as keywords and are honoured by every backend: `scaling`,
`sliding_window` (a query at position i sees keys j with i - window < j <= i, transformers' convention),
`softcap` (Gemma 2's tanh soft-capping of attention logits) and `s_aux` (gpt-oss's learned attention sinks: one
extra logit per head in the softmax's denominator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

ATTENTION_NAME = "shuttle_paged"


@dataclass
class AttentionMetadata:
    """The step contract between input preparation and attention backends: a handful of tensors.

    Rows (sequences) are ordered decodes first: the first `num_decodes` rows have exactly one query token.

    Attributes:
        query_start_loc: int32 [B+1], row b's tokens are packed rows [query_start_loc[b], query_start_loc[b+1]).
        seq_lens: int32 [B], tokens attended by row b after this step (computed before + new).
        block_table: int32 [B, W], each row's block ids padded with the null block; W covers max(seq_lens).
        slot_mapping: int64 [T], cache slot (block * block_size + offset) of each packed token.
        num_decodes: leading rows with a single query token.
        max_query_len, max_seq_len: maxima of the two, in tokens.
        query_start_list, seq_lens_list: the same as Python ints, for backends that loop on the host.
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    query_start_list: list[int]
    seq_lens_list: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)


@dataclass
class LayerFeatures:
    """Per-layer attention options a model passes (None / 0 when the layer does not use them).

    Attributes:
        scaling: multiplier of q.k (1/sqrt(head_dim) unless the model says otherwise).
        sliding_window: keys further back than this many positions are not attended.
        softcap: logits become softcap * tanh(logits / softcap) before masking.
        sinks: float [num_heads], a learned extra logit per head in the softmax denominator.
    """

    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None


class AttentionBackend(Protocol):
    """What a layer's attention call uses of a backend (worker/attention_backends.py, worker/flex_attention.py)."""

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor, meta: AttentionMetadata, features: LayerFeatures) -> torch.Tensor: ...


@dataclass
class StepAttention:
    """What every layer's attention call needs for one step, built once per step.

    Attributes:
        metadata: the step's AttentionMetadata.
        kv_caches: per layer (key, value), key [num_blocks + 1, block_size, num_kv_heads, head_dim] and value
            [num_blocks + 1, block_size, num_kv_heads, v_head_dim]; the last block is the null block.
        backend: an AttentionBackend (worker/attention_backends.py) prepared for this step.
    """

    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    backend: AttentionBackend


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            paged_attention: StepAttention | None = None, sliding_window: int | None = None,
                            softcap: float | None = None, s_aux: torch.Tensor | None = None, **kwargs):
    """Attention over the paged cache for one layer.

    Args:
        query: [1, num_heads, T, head_dim]; key: [1, num_kv_heads, T, head_dim]; value: [1, num_kv_heads, T,
            v_head_dim] (the packed tokens of the step).
        paged_attention: the step's StepAttention (required).
    Returns:
        ([1, T, num_heads, v_head_dim], None), the layout transformers' attention functions return.
    Raises:
        ValueError: called without the metadata keyword (the model was run outside the worker, or its
            attention layer does not pass keywords through).
    """
    if paged_attention is None:
        raise ValueError("shuttle_paged attention needs the `paged_attention` metadata keyword")
    step = paged_attention
    # transformers' attention layers hold their int layer_idx; torch types a module's attributes Tensor | Module
    key_cache, value_cache = step.kv_caches[module.layer_idx]  # type: ignore[index]
    slots = step.metadata.slot_mapping
    # a cache of another dtype than the model's (--kv-cache-dtype) gets the step's K and V rounded to it here
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key[0].transpose(0, 1).to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value[0].transpose(0, 1).to(value_cache.dtype))
    features = LayerFeatures(scaling if scaling is not None else query.shape[-1] ** -0.5,
                             sliding_window if sliding_window and sliding_window > 0 else None,
                             softcap if softcap else None, s_aux)
    out = step.backend.forward(query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), key_cache,
                               value_cache, step.metadata, features)
    return out.unsqueeze(0), None  # [1, T, heads, v_head_dim]


def _no_mask(*args, **kwargs):
    """transformers must not build a mask for packed batches: paged attention masks per sequence."""
    return None


def register() -> str:
    """Register the backend with transformers; returns the `attn_implementation` name to load models with."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
