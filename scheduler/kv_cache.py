"""Block tables per request on top of the block pool: prefix-cache lookup, slot allocation, commit, release.

Blocks are allocated when a step is planned, but a full block joins the prefix cache only when a step that
wrote its KV has returned (`commit`): a step that fails or is aborted never leaves never-computed blocks
findable. Blocks are named by the stable chained digest of common/block_hash.py; a hit is confirmed by comparing
token ids.
"""

from __future__ import annotations

from typing import Sequence

from shuttle.common.block_hash import block_hash, root_hash
from shuttle.scheduler.block_pool import BlockPool
from shuttle.scheduler.request import Request


class KVCacheManager:
    """The scheduler's view of the KV cache; the only writer of block tables.

    Args:
        num_blocks: blocks in the worker's cache.
        block_size: tokens per block.
        enable_caching: share full blocks between requests by content.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_tables: dict[str, list[int]] = {}
        self._block_hashes: dict[str, list[tuple[bytes, tuple[int, ...]]]] = {}
        self._num_committed: dict[str, int] = {}  # leading table blocks already indexed in the pool
        self.prefix_queries = 0  # prompt tokens looked up, summed over admitted requests
        self.prefix_hits = 0  # of which found cached

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids of the longest cached prefix of the request's known tokens.

        At least one token is always left to compute, because the step that computes it samples the next.
        """
        if not self.pool.enable_caching:
            return []
        hits: list[int] = []
        for digest, chunk in self._full_blocks(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(digest, chunk)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def record_prefix_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one admitted request's lookup (failed admissions retry and are not counted twice)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_cached_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached_blocks: Sequence[int] = ()) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed (and `cached_blocks`) ones.

        Returns the block ids appended to the request's block table (cache hits first), or None, leaving
        everything unchanged, when the free queue cannot supply them.
        """
        table = self.block_tables.get(request.request_id)
        if table is None:
            table = self.block_tables[request.request_id] = []
        covered = request.num_computed_tokens + len(cached_blocks) * self.block_size + num_new_tokens
        num_new_blocks = -(-covered // self.block_size) - len(table) - len(cached_blocks)
        if num_new_blocks <= 0 and not cached_blocks:
            return []  # the decode fast path: the last block still has room
        if num_new_blocks + self.pool.count_unreferenced(cached_blocks) > self.pool.num_free:
            if not table:
                del self.block_tables[request.request_id]
            return None
        self.pool.take(cached_blocks)
        added = list(cached_blocks) + self.pool.allocate(max(num_new_blocks, 0))
        table.extend(added)
        return added

    def commit(self, request: Request, num_computed_tokens: int) -> None:
        """The KV of the request's first `num_computed_tokens` tokens is written (a step that computed them has
        returned): index its full blocks in the prefix cache so later requests can share them."""
        if not self.pool.enable_caching:
            return
        full = min(num_computed_tokens, request.num_tokens) // self.block_size
        committed = self._num_committed.get(request.request_id, 0)
        if full <= committed:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        for index, (digest, chunk) in enumerate(self._full_blocks(request, full)[committed:], committed):
            self.pool.cache(table[index], digest, chunk)
        self._num_committed[request.request_id] = full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the request's blocks past its first `num_tokens` tokens (rejected drafts' slots; the worker
        trims its table by the same rule). None of them is committed: commits stop at the computed tokens."""
        table = self.block_tables.get(request.request_id)
        keep = self.blocks_needed(num_tokens)
        if table is not None and len(table) > keep:
            self.pool.release(table[keep:][::-1])
            del table[keep:]

    def _full_blocks(self, request: Request, num_blocks: int) -> list[tuple[bytes, tuple[int, ...]]]:
        """(chained digest, token ids) of the request's first `num_blocks` full blocks, each computed once per
        request (tokens are only ever appended, so they stay valid across preemption)."""
        blocks = self._block_hashes.get(request.request_id)
        if blocks is None:
            blocks = self._block_hashes[request.request_id] = []
        if len(blocks) < num_blocks:
            tokens = request.all_token_ids
            bs = self.block_size
            for index in range(len(blocks), num_blocks):
                chunk = tuple(tokens[index * bs:(index + 1) * bs])
                blocks.append((block_hash(blocks[-1][0] if blocks else root_hash(request.lora_key), chunk), chunk))
        return blocks[:num_blocks]

    def free(self, request: Request, finished: bool = True) -> None:
        """Release the request's blocks (tail first); committed full ones stay findable in the prefix cache. A
        preempted request (finished=False) keeps its block digests for when it resumes."""
        table = self.block_tables.pop(request.request_id, [])
        self._num_committed.pop(request.request_id, None)
        if finished:
            self._block_hashes.pop(request.request_id, None)
        self.pool.release(table[::-1])
