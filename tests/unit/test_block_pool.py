"""Block pool and KV cache manager: reference counts, LRU eviction of cached blocks, prefix hits."""

import random

import pytest

from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.block_pool import BlockPool
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.request import Request


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, b"c", tokens, SamplingParams(max_tokens=8), 0.0)


def test_allocate_release_and_lru_eviction():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache(a[0], 111, (1, 2))
    pool.release(a[::-1])
    pool.check_invariants()
    assert pool.num_free == 4 and pool.num_cached == 1
    assert pool.lookup(111, (1, 2)) == a[0]
    assert pool.lookup(111, (9, 9)) is None  # same hash, other tokens: no hit
    b = pool.allocate(3)  # the never-used blocks go first, then the released ones, tail first
    assert a[0] not in b and pool.num_cached == 1
    pool.allocate(1)
    assert pool.num_cached == 0  # the cached block was the last free one: evicted
    pool.check_invariants()
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    first = make_request("a", list(range(1, 13)))  # 12 tokens: 3 full blocks
    assert kv.find_cached_prefix(first) == []
    assert kv.allocate_slots(first, 12) is not None
    second = make_request("b", list(range(1, 13)))
    assert kv.find_cached_prefix(second) == []  # allocated is not written: no hit before the step returns
    kv.commit(first, 12)
    second = make_request("b", list(range(1, 13)))
    hits = kv.find_cached_prefix(second)
    assert hits == kv.block_tables["a"][:2]  # 2 blocks: the last token is always computed
    kv.allocate_slots(second, 12 - 8, hits)
    assert kv.pool.blocks[hits[0]].ref_cnt == 2
    kv.free(first)
    kv.free(second)
    kv.pool.check_invariants()
    assert kv.pool.num_free == 10


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert kv.allocate_slots(request, 12) is None
    assert "a" not in kv.block_tables and kv.pool.num_free == 2


def test_random_operations_never_leak():
    rng = random.Random(7)
    kv = KVCacheManager(num_blocks=32, block_size=4)
    live: dict[str, Request] = {}
    for step in range(2000):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.choice(sorted(live))))
        else:
            rid = f"r{step}"
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 30))]
            request = make_request(rid, tokens)
            hits = kv.find_cached_prefix(request)
            if kv.allocate_slots(request, len(tokens) - len(hits) * 4, hits) is not None:
                kv.commit(request, len(tokens))
                kv.record_prefix_lookup(len(tokens), len(hits) * 4)
                live[rid] = request
        kv.pool.check_invariants()
    for request in live.values():
        kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free == 32
    assert kv.prefix_hits > 0


def test_preempted_request_keeps_its_hashes_and_finds_its_own_blocks():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    request = make_request("a", list(range(1, 14)))  # 13 tokens: 3 full blocks
    kv.allocate_slots(request, 13)
    kv.commit(request, 13)
    table = list(kv.block_tables["a"])
    kv.free(request, finished=False)  # preempted: blocks return, still indexed
    assert kv.find_cached_prefix(request) == table[:3]
    kv.free(request)
    kv.pool.check_invariants()
    assert kv.pool.num_free == 6
