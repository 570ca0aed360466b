"""Stable prefix-cache block hashes, the same in every process and on every host.

A full block is named by a digest of (its parent block's digest, its token ids), so one digest names the whole
prefix up to and including that block (the chained scheme of nano-vllm's block manager and vLLM's prefix
caching). The digest is BLAKE2b-128, not Python's hash(): that one is salted per process for some types and is
easy to collide on purpose, and replicas behind one router must agree on names. A cache hit still compares the
block's token ids, so even a collision could never make two different blocks share KV.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = hashlib.blake2b(b"shuttle prefix cache v1", digest_size=16).digest()


def root_hash(lora_key: str = "") -> bytes:
    """The digest a request's first block chains from: ROOT_HASH for the base model, one of its own for each LoRA
    adapter (`lora_key` names the adapter and its weights), so that no KV is shared between an adapter and the base
    model or another adapter."""
    if not lora_key:
        return ROOT_HASH
    return hashlib.blake2b(ROOT_HASH + b"lora\0" + lora_key.encode(), digest_size=16).digest()


def block_hash(parent: bytes, token_ids: tuple[int, ...] | list[int]) -> bytes:
    """16-byte digest of a full block given its parent's digest (ROOT_HASH for the first block)."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()
