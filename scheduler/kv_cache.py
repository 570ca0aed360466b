"""Block tables per request on top of the block pool: prefix-cache lookup, slot allocation, release.

A full block is identified by hash((parent block's hash, its token ids)), so one hash names the whole
prefix up to and including that block (the chained-hash scheme of nano-vllm's block manager and vLLM's
prefix caching). A hit is confirmed by comparing token ids, so a hash collision cannot corrupt output.
"""

from __future__ import annotations

from scheduler.block_pool import BlockPool
from scheduler.request import Request


class KVCacheManager:
    """The scheduler's view of the KV cache; the only writer of block tables.

    Args:
        num_blocks: blocks in the worker's cache.
        block_size: tokens per block.
        enable_caching: share full prompt blocks between requests by content.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0  # prompt tokens looked up, summed over lookups
        self.prefix_hits = 0  # of which found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens.

        At least one token is always left to compute, because the step that computes it samples the next.
        """
        self.prefix_queries += request.num_tokens
        if not self.pool.enable_caching:
            return []
        hits: list[int] = []
        parent: int | None = None
        tokens = request.all_token_ids
        for start in range(0, (len(tokens) - 1) // self.block_size * self.block_size, self.block_size):
            chunk = tuple(tokens[start:start + self.block_size])
            block_hash = hash((parent, chunk))
            block_id = self.pool.lookup(block_hash, chunk)
            if block_id is None:
                break
            hits.append(block_id)
            parent = block_hash
        self.prefix_hits += len(hits) * self.block_size
        return hits

    def allocate_slots(self, request: Request, num_new_tokens: int, cached_blocks: list[int] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed (and `cached_blocks`) ones.

        Returns the block ids appended to the request's block table (cache hits first), or None, leaving
        everything unchanged, when the free queue cannot supply them.
        """
        table = self.block_tables.setdefault(request.request_id, [])
        covered = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = self.blocks_needed(covered) - len(table) - len(cached_blocks)
        if num_new_blocks + self.pool.count_unreferenced(cached_blocks) > self.pool.num_free:
            if not table:
                del self.block_tables[request.request_id]
            return None
        self.pool.take(cached_blocks)
        added = list(cached_blocks) + self.pool.allocate(max(num_new_blocks, 0))
        table.extend(added)
        self._cache_full_blocks(request, table, covered)
        return added

    def _cache_full_blocks(self, request: Request, table: list[int], num_covered_tokens: int) -> None:
        if not self.pool.enable_caching:
            return
        hashes = self._block_hashes.setdefault(request.request_id, [])
        tokens = None
        for index in range(len(hashes), num_covered_tokens // self.block_size):
            if tokens is None:
                tokens = request.all_token_ids
            chunk = tuple(tokens[index * self.block_size:(index + 1) * self.block_size])
            block_hash = hash((hashes[-1] if hashes else None, chunk))
            self.pool.cache(table[index], block_hash, chunk)
            hashes.append(block_hash)

    def free(self, request: Request) -> None:
        """Release the request's blocks (tail first); full ones stay findable in the prefix cache."""
        table = self.block_tables.pop(request.request_id, [])
        self._block_hashes.pop(request.request_id, None)
        self.pool.release(table[::-1])
