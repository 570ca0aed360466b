"""The numba paged decode kernel against the reference per-sequence attention, feature by feature.

The context of each sequence is scattered over shuffled blocks so that a kernel reading the wrong block, offset or
head would disagree with the gathered reference.
"""

import pytest
import torch

from shuttle.worker.attention import LayerFeatures
from shuttle.worker.attention_backends import attend
from shuttle.worker.decode_kernel import PARTITION_TOKENS, paged_decode

BLOCK = 4


def _case(seq_lens, num_heads=8, num_kv_heads=4, head_dim=16, v_head_dim=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 1
    key_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(num_blocks, BLOCK, num_kv_heads, v_head_dim, generator=gen)
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    width = max(blocks_per_seq)
    table = torch.full((len(seq_lens), width), num_blocks - 1, dtype=torch.int32)
    for i, count in enumerate(blocks_per_seq):
        table[i, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen)
    return query, key_cache, value_cache, table, torch.tensor(seq_lens, dtype=torch.int32)


def _reference(query, key_cache, value_cache, table, seq_lens, features):
    rows = []
    for b, n in enumerate(seq_lens.tolist()):
        blocks = table[b, :-(-n // BLOCK)].long()
        keys = key_cache[blocks].flatten(0, 1)[:n]
        values = value_cache[blocks].flatten(0, 1)[:n]
        rows.append(attend(query[b:b + 1], keys, values, n - 1, 0, features)[0])
    return torch.stack(rows)


# 3 and 5 positions per work item cut the contexts below into several partitions, some ending mid-block and some
# inside a sliding window; PARTITION_TOKENS leaves each in one.
@pytest.mark.parametrize("partition", [3, 5, PARTITION_TOKENS])
@pytest.mark.parametrize("window,softcap,with_sinks", [
    (None, None, False), (5, None, False), (None, 2.0, False), (None, None, True), (3, 1.0, True), (11, None, True)])
def test_kernel_matches_reference_attention(window, softcap, with_sinks, partition):
    query, key_cache, value_cache, table, seq_lens = _case([1, 4, 7, 13, 30])
    sinks = torch.randn(query.shape[1]) if with_sinks else None
    features = LayerFeatures(scaling=0.25, sliding_window=window, softcap=softcap, sinks=sinks)
    got = paged_decode(query, key_cache, value_cache, table, seq_lens, 0.25, window, softcap, sinks,
                       partition=partition)
    want = _reference(query, key_cache, value_cache, table, seq_lens, features)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_a_sequence_attends_the_same_whatever_shares_its_step():
    """The partition length is fixed, not fitted to the batch, so a sequence's sums run in the same order alone and
    among others: its output is bit for bit the same."""
    query, key_cache, value_cache, table, seq_lens = _case([300, 7, 130, 2], num_heads=4, num_kv_heads=2)
    together = paged_decode(query, key_cache, value_cache, table, seq_lens, 0.25, None, None, None)
    for b in range(len(seq_lens)):
        alone = paged_decode(query[b:b + 1], key_cache, value_cache, table[b:b + 1], seq_lens[b:b + 1], 0.25, None,
                             None, None)
        assert torch.equal(alone[0], together[b])


def test_kernel_handles_multi_query_and_wider_values():
    query, key_cache, value_cache, table, seq_lens = _case([2, 9], num_heads=4, num_kv_heads=1, v_head_dim=24)
    features = LayerFeatures(scaling=0.5, sliding_window=None, softcap=None, sinks=None)
    got = paged_decode(query, key_cache, value_cache, table, seq_lens, 0.5, None, None, None)
    torch.testing.assert_close(got, _reference(query, key_cache, value_cache, table, seq_lens, features),
                               atol=2e-5, rtol=1e-5)


def test_warm_up_keeps_torch_threads():
    """With OMP_NUM_THREADS=1, numba's OpenMP pool, started by the kernel's first launch, raised torch's intra-op
    threads to numba's count (the cores): the worker ran two torch threads, the second spinning beside the frontend,
    though README's advice was followed. Run in a fresh interpreter: the pool starts once per process."""
    import os
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(1)\n"
            "from worker import decode_kernel\n"
            "torch.ones(64, 64) @ torch.ones(64, 64)\n"  # torch's pool running first, as after loading a model
            "decode_kernel.warm_up(torch.get_num_threads())\n"
            "after_warm_up = torch.get_num_threads()\n"
            "decode_kernel.warm_up(torch.get_num_threads())\n"
            "print(after_warm_up, torch.get_num_threads())\n")
    # as README advises on a shared machine; numba's pool as large as on a 2-core one, whatever this one has
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "2"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == ["1", "1"]


def test_exp_of_nonpositive_is_exp_to_float32_rounding():
    """The softmax's vectorized exp against float64's, over the whole range it is used on: within 1.5e-7 relative
    (float32's unit in the last place is 6e-8 to 1.2e-7 of a value), 1 at 0, and 0 where float32 has no normal
    number left (-inf included)."""
    import numpy as np
    from numba import njit

    from shuttle.worker.decode_kernel import exp_of_nonpositive

    @njit
    def apply(xs):
        out = np.empty_like(xs)
        for i in range(xs.shape[0]):
            out[i] = exp_of_nonpositive(xs[i])
        return out

    xs = np.linspace(-87.0, 0.0, 1_000_001).astype(np.float32)
    exact = np.exp(xs.astype(np.float64))
    assert np.max(np.abs(apply(xs) - exact) / exact) < 1.5e-7
    edges = apply(np.array([0.0, -0.0, -87.5, -1e4, -np.inf], dtype=np.float32))
    assert edges.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
