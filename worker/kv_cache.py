"""The paged KV cache tensors: per layer K and V of shape [num_blocks, block_size, num_kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVCache:
    """Allocated cache and its size.

    Attributes:
        layers: per layer (key, value), each [num_blocks, block_size, num_kv_heads, head_dim].
        bytes_per_token: K + V bytes one token takes across all layers.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    bytes_per_token: int

    @staticmethod
    def allocate(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int | None, memory_bytes: int) -> "KVCache":
        """Allocate `num_blocks` blocks, or as many as fit in `memory_bytes` (bytes) when it is None.

        Raises:
            ValueError: the budget holds no block.
        """
        bytes_per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        if num_blocks is None:
            num_blocks = memory_bytes // (bytes_per_token * block_size)
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {memory_bytes} bytes holds no block of {block_size} tokens")
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        layers = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                  for _ in range(num_layers)]
        return KVCache(layers, num_blocks, bytes_per_token)
