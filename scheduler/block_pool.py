"""The pool of KV cache blocks: reference counts, a free queue in LRU order, and the prefix-cache index.

A block is in exactly one of three states: in use (ref_cnt > 0), cached (ref_cnt == 0 but its hash still
indexes it, so a later request can take it back), or plain free. Cached and free blocks both sit in the
free queue; allocation takes from the front, so the least recently released cached block is evicted first
(the idea of vLLM's `vllm/v1/core/block_pool.py` free-block queue).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of `block_size` token slots. `block_hash`/`token_ids` are set once it is full and cached."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Owns every block id in [0, num_blocks).

    Args:
        num_blocks: blocks the worker's KV cache holds.
        enable_caching: keep full blocks findable by hash after their last user frees them.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (plain free + cached unreferenced)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks indexed by the prefix cache (in use or not)."""
        return len(self._by_hash)

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the front of the free queue, evicting their cache entries.

        Raises:
            RuntimeError: fewer than `n` blocks are free (callers check `num_free` first).
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self._by_hash[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block holding exactly `token_ids` under `block_hash`, if any."""
        block_id = self._by_hash.get(block_hash)
        if block_id is None or self.blocks[block_id].token_ids != token_ids:
            return None
        return block_id

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block (prefix-cache hits); cached blocks leave the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail first, so that its last blocks,
        the least likely to be shared, are evicted before its first."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._forget(block)
                self._free[block_id] = None

    def cache(self, block_id: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Index a full, in-use block under its chained hash (first writer wins for duplicate contents)."""
        if not self.enable_caching or block_hash in self._by_hash:
            return
        block = self.blocks[block_id]
        block.block_hash, block.token_ids = block_hash, token_ids
        self._by_hash[block_hash] = block_id

    def _forget(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._by_hash[block.block_hash]
            block.block_hash, block.token_ids = None, ()

    def count_unreferenced(self, block_ids: Sequence[int]) -> int:
        """How many of these blocks sit in the free queue (taking them would shrink `num_free`)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)

    def check_invariants(self) -> None:
        """Raise AssertionError if the pool's bookkeeping is inconsistent (used by tests every step)."""
        free = set(self._free)
        assert len(free) == len(self._free)
        for block in self.blocks:
            assert block.ref_cnt >= 0, block
            assert (block.ref_cnt == 0) == (block.block_id in free), block
            if block.block_hash is not None:
                assert self._by_hash.get(block.block_hash) == block.block_id, block
        assert all(self.blocks[b].block_hash == h for h, b in self._by_hash.items())
