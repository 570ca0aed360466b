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
        self._block_hashes: dict[str, list[tuple[int, tuple[int, ...]]]] = {}
        self._num_registered: dict[str, int] = {}  # leading table blocks already indexed in the pool
        self.prefix_queries = 0  # prompt tokens looked up, summed over admitted requests
        self.prefix_hits = 0  # of which found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's tokens.

        At least one token is always left to compute, because the step that computes it samples the next.
        """
        if not self.pool.enable_caching:
            return []
        hits: list[int] = []
        for block_hash, chunk in self._full_blocks(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(block_hash, chunk)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted request's lookup (failed admissions retry and are not counted twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached_tokens

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

    def _full_blocks(self, request: Request, num_blocks: int) -> list[tuple[int, tuple[int, ...]]]:
        """(chained hash, token ids) of the request's first `num_blocks` full blocks, each computed once per request
        (tokens are only ever appended, so they stay valid across preemption)."""
        blocks = self._block_hashes.setdefault(request.request_id, [])
        if len(blocks) < num_blocks:
            tokens = request.all_token_ids
            for index in range(len(blocks), num_blocks):
                chunk = tuple(tokens[index * self.block_size:(index + 1) * self.block_size])
                blocks.append((hash((blocks[-1][0] if blocks else None, chunk)), chunk))
        return blocks[:num_blocks]

    def _cache_full_blocks(self, request: Request, table: list[int], num_covered_tokens: int) -> None:
        """Index the table's newly full blocks in the pool, so later requests can share them."""
        if not self.pool.enable_caching:
            return
        registered = self._num_registered.get(request.request_id, 0)
        full = num_covered_tokens // self.block_size
        if full > registered:
            for index, (block_hash, chunk) in enumerate(self._full_blocks(request, full)[registered:], registered):
                self.pool.cache(table[index], block_hash, chunk)
            self._num_registered[request.request_id] = full

    def free(self, request: Request, finished: bool = True) -> None:
        """Release the request's blocks (tail first); full ones stay findable in the prefix cache. A preempted
        request (finished=False) keeps its block hashes for when it resumes."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_registered.pop(request.request_id, None)
        if finished:
            self._block_hashes.pop(request.request_id, None)
        self.pool.release(table[::-1])
