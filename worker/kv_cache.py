"""The paged KV cache tensors: per layer K [num_blocks + 1, block_size, num_kv_heads, head_dim] and V (its own
head dim). Block `num_blocks` is the null block: it pads block tables and is never handed out by the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shuttle.common.capacity import kv_blocks_for_memory
from shuttle.worker.kv_sizing import KVSizingError
from shuttle.worker.model_loader import LayerGeometry


@dataclass
class KVCache:
    """Allocated cache and its size.

    Attributes:
        layers: per layer (key, value) tensors, shapes as in the module docstring.
        num_blocks: blocks the scheduler may use (ids 0 .. num_blocks - 1).
        bytes_per_token: K + V bytes one token takes across all layers.
    """

    layers: list[tuple[torch.Tensor, torch.Tensor]]
    num_blocks: int
    bytes_per_token: int

    @property
    def null_block(self) -> int:
        return self.num_blocks

    @staticmethod
    def bytes_per_token_of(geometry: list[LayerGeometry], dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return sum(g.num_kv_heads * (g.head_dim + g.v_head_dim) for g in geometry) * element

    @staticmethod
    def allocate(geometry: list[LayerGeometry], block_size: int, dtype: torch.dtype, device: torch.device,
                 num_blocks: int | None, memory_bytes: int) -> "KVCache":
        """Allocate `num_blocks` blocks, or as many as fit in `memory_bytes` (bytes) when it is None.

        Raises:
            KVSizingError: the budget holds no block (the worker refuses to start with this one line).
        """
        bytes_per_token = KVCache.bytes_per_token_of(geometry, dtype)
        if num_blocks is None:
            num_blocks = kv_blocks_for_memory(memory_bytes, bytes_per_token, block_size)  # less the null block
        if num_blocks < 1:
            raise KVSizingError(f"--kv-cache-memory {memory_bytes} bytes holds no KV block of {block_size} tokens "
                                f"({bytes_per_token} bytes/token, and one null block); it takes bytes or a unit, "
                                f"e.g. 2GiB")
        layers = [(torch.zeros((num_blocks + 1, block_size, g.num_kv_heads, g.head_dim), dtype=dtype, device=device),
                   torch.zeros((num_blocks + 1, block_size, g.num_kv_heads, g.v_head_dim), dtype=dtype, device=device))
                  for g in geometry]
        return KVCache(layers, num_blocks, bytes_per_token)
