"""KV capacity arithmetic shared by the worker (sizing its cache), the launcher and scheduler (the start-up
line) and `shuttle plan`, so that the plan and a running server can never disagree."""

from __future__ import annotations


def kv_blocks_for_memory(memory_bytes: int, bytes_per_token: int, block_size: int) -> int:
    """KV blocks the scheduler may use within `memory_bytes` (bytes) of K and V: one more block is allocated
    as the null block that pads block tables. Can be < 1 when the budget is too small."""
    return memory_bytes // (bytes_per_token * block_size) - 1


def kv_cache_bytes(num_blocks: int, block_size: int, bytes_per_token: int) -> int:
    """Bytes the K and V tensors take for `num_blocks` usable blocks plus the null block."""
    return (num_blocks + 1) * block_size * bytes_per_token


def blocks_per_request(context_len: int, block_size: int) -> int:
    """KV blocks one request of `context_len` tokens (prompt + output) holds at its end."""
    return -(-context_len // block_size)


def requests_that_fit(num_blocks: int, block_size: int, context_len: int) -> int:
    """How many requests of `context_len` tokens the KV cache holds at once (KV blocks alone; the step budget
    max_num_seqs caps how many run)."""
    return num_blocks // blocks_per_request(context_len, block_size)
