"""The all-decode fast path of InputBatch.pack builds exactly the tensors of the general path."""

import torch

from shuttle.common.sampling import SamplingParams
from shuttle.worker.input_batch import CachedRequestState, InputBatch
from shuttle.worker.sampler import SamplingState

NULL_BLOCK = 999


def decoding_batch(num_seqs: int) -> tuple[InputBatch, list[tuple[CachedRequestState, int]]]:
    """num_seqs requests in decode at different context lengths (2..), each with its blocks written."""
    batch = InputBatch(block_size=4, null_block=NULL_BLOCK, max_blocks_per_seq=16, initial_rows=2)
    scheduled = []
    for i in range(num_seqs):
        length = 2 + 3 * i  # prompt + outputs so far; the last token is the one to feed
        state = CachedRequestState(f"r{i}", list(range(100, 100 + length)),
                                   SamplingState(SamplingParams(max_tokens=50), 2), batch._take_row(),
                                   num_computed_tokens=length - 1)
        batch._append_blocks(state, [10 * i + b for b in range(-(-length // 4))])
        scheduled.append((state, 1))
    return batch, scheduled


def test_decode_fast_path_equals_the_general_path():
    for num_seqs in (1, 3, 7):  # 7 rows: the persistent table has grown twice
        batch, scheduled = decoding_batch(num_seqs)
        fast, general = batch.pack(scheduled), batch._pack_mixed(scheduled)
        for name in ("input_ids", "positions", "sample_rows"):
            assert torch.equal(getattr(fast, name), getattr(general, name)), name
        for name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            assert torch.equal(getattr(fast.attention, name), getattr(general.attention, name)), name
        for name in ("query_start_list", "seq_lens_list", "num_decodes", "max_query_len", "max_seq_len"):
            assert getattr(fast.attention, name) == getattr(general.attention, name), name
        assert fast.sampled_requests == general.sampled_requests and fast.prompt_rows == general.prompt_rows == []
        # the last token of each sequence goes into the slot of its position
        assert fast.input_ids.tolist() == [s.token_ids[-1] for s, _ in scheduled]


def test_a_row_that_does_not_sample_takes_the_general_path():
    batch, scheduled = decoding_batch(3)
    state, _ = scheduled[1]
    state.num_computed_tokens -= 1  # one token of its prompt or outputs is still uncomputed: not a plain decode
    inputs = batch.pack(scheduled)
    assert inputs.sample_rows.tolist() == [0, 2] and inputs.sampled_requests == [scheduled[0][0], scheduled[2][0]]
