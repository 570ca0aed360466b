"""The `flex` backend's per-step block maps and BlockMasks (worker/flex_attention.py calls them once per step, and
every layer reuses what they build), all tensor ops on the cache's device.

**What is true and what is a shortcut.** Each call passes a `mask_mod` and a BlockMask:
- `mask_mod(b, h, q, kv)` is the whole truth: the key slot belongs to the query's sequence (through the step's
  physical-to-logical block map and the sequence's block-table row), and its position is visible from the query's
  (causal, and inside the sliding window if any).
- the BlockMask only lets the fused kernel skip work: it lists, per query block, the cache blocks that `mask_mod`
  admits anything from ("partial": `mask_mod` is evaluated there) and those it admits wholly ("full": it is not).

Eager flex (the CPU) ignores the lists and evaluates `mask_mod` on every (query, slot) pair; compiled flex (CUDA)
reads only the listed blocks. So the builders below must list every block `mask_mod` admits anything from and
call full only blocks it admits wholly; tests/engine/test_flex_attention.py checks both, since eager runs alone cannot.

**Logical positions.** `mask_mod` needs the position of a slot, but a slot is physical. A physical block sits at
the same logical index in every block table of a step that holds it (the prefix cache shares only
position-aligned blocks), so one map `p2l` int32 [N+1] per step (-1 where no row of the step reads the block) gives
it: position = p2l[kv // bs] * bs + kv % bs. `check_logical_blocks` tests that invariant (a debugging aid; it
syncs with the device). No per-sequence inverse map, no [blocks x cache] table: the largest per-step tensor is the
packed form's candidate list, [query blocks, QUERY_BLOCK, table width].

**Two call forms per layer** (rows are ordered decodes first, see worker/attention.py):
- decode form: Q [B_dec, H, 1, D] over the broadcast KV batch of 1; row b's BlockMask lists row b's own blocks
  (its block-table row, from the first one its window reaches);
- packed form: the prefill chunks' tokens Q [1, H, T_pre, D]; each query block of QUERY_BLOCK tokens lists the
  de-duplicated union of the blocks its tokens read (a block spanning two sequences reads both sets; `mask_mod`
  keeps them apart).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

QUERY_BLOCK = 16  # packed form's query block (tokens): small, since a block spanning sequences reads all their blocks
# The decode form's one query per row sits in a query block of this size: inductor skips every kernel config whose
# BLOCK_M does not divide it, and the decode template's BLOCK_M is the GQA group (up to 128) rounded to a power of 2
DECODE_QUERY_BLOCK = 128
_NO_BLOCK = torch.iinfo(torch.int32).max  # sorts after every real block id



def logical_block_map(block_table: torch.Tensor, seq_lens: torch.Tensor, num_cache_blocks: int,
                      block_size: int) -> torch.Tensor:
    """p2l: int32 [num_cache_blocks], the logical index at which the step's rows hold each physical block, -1 for
    blocks no row reads (the null block included: it only pads tables).

    Args:
        block_table: int32 [B, W]; seq_lens: int32 [B] (tokens each row attends).
    """
    width = block_table.shape[1]
    logical = torch.arange(width, dtype=torch.int32, device=block_table.device).expand_as(block_table)
    used = logical < ((seq_lens + block_size - 1) // block_size).unsqueeze(1)
    # unused entries (padding) write into one dump slot past the end; equal duplicates make scatter's order moot
    target = torch.where(used, block_table.long(), num_cache_blocks)
    p2l = torch.full((num_cache_blocks + 1,), -1, dtype=torch.int32, device=block_table.device)
    return p2l.scatter_(0, target.flatten(), logical.flatten())[:num_cache_blocks]


def check_logical_blocks(block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> None:
    """Raise ValueError when one physical block sits at two logical indices among the rows' used blocks (the
    invariant p2l rests on). Syncs with the device: a debugging aid, not part of the step path."""
    cpu_table, cpu_lens = block_table.cpu().long(), seq_lens.cpu().long()
    seen: dict[int, int] = {}
    for row, length in zip(cpu_table.tolist(), cpu_lens.tolist()):
        for logical, block in enumerate(row[:-(-length // block_size)]):
            if seen.setdefault(block, logical) != logical:
                raise ValueError(f"block {block} sits at logical index {seen[block]} in one row and {logical} in "
                                 f"another: the flex backend's physical-to-logical map cannot mask it")


def _compact(values: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's kept values moved to its front, in order.

    Args:
        values: int [R, C]; keep: bool [R, C].
    Returns:
        (counts int32 [R], indices int32 [R, C]), entries past a row's count set to block 0 (never read).
    """
    order = torch.argsort((~keep).to(torch.int32), dim=-1, stable=True)
    counts = keep.sum(-1, dtype=torch.int32)
    packed = values.gather(-1, order)
    columns = torch.arange(values.shape[-1], device=values.device)
    return counts, torch.where(columns < counts.unsqueeze(-1), packed, 0).to(torch.int32)


def step_mask_mod(table: torch.Tensor, p2l: torch.Tensor, row_of: torch.Tensor, qpos_of: torch.Tensor, by_batch: bool,
              block_size: int, window: int | None):
    """mask_mod(b, h, q, kv) -> bool: slot kv is one of the query's row's blocks, at a position <= the query's and
    (with a window) greater than query - window.

    Args:
        table: int32 [rows, W] block-table rows; p2l: int32 [N+1].
        row_of: int32, the table row of each batch index (`by_batch`) or each query index; qpos_of: int32, the
            query's position, the same way indexed (-1 for padding: nothing is visible from it).
    """
    def mask_mod(b, h, q, kv):
        index = b if by_batch else q
        row, qpos = row_of[index], qpos_of[index]
        block = kv // block_size
        logical = p2l[block]
        known = logical >= 0
        logical = torch.clamp(logical, min=0)
        kpos = logical * block_size + kv % block_size
        ok = known & (table[row, logical] == block) & (kpos <= qpos)
        if window is not None:
            ok = ok & (kpos > qpos - window)
        return ok
    return mask_mod


@dataclass
class FormInputs:
    """One call form's per-step tensors, padded to its buckets (on the cache's device).

    Attributes:
        table: int32 [rows, W] the rows' block-table rows (padding rows and columns: the null block).
        seq_lens: int32 [rows] (padding rows: 0).
        query_start: int32 [rows + 1] the rows' query tokens in the form's packed order (packed form only).
        row_of, qpos_of: int32, per batch row (decode) or per query token (packed): table row and position.
        num_queries: queries the form computes (padded): decode rows or packed tokens.
    """

    table: torch.Tensor
    seq_lens: torch.Tensor
    query_start: torch.Tensor | None
    row_of: torch.Tensor
    qpos_of: torch.Tensor
    num_queries: int


def decode_inputs(block_table: torch.Tensor, seq_lens: torch.Tensor, rows: int, width: int) -> FormInputs:
    """The decode form's inputs for the first table rows (one query each), padded to `rows` x `width`."""
    real, table_width = block_table.shape
    device = block_table.device
    # padding holds block 0, not the null block's id: mask_mod rejects it (seq_len 0, or not the row's block)
    table = torch.nn.functional.pad(block_table, (0, width - table_width, 0, rows - real))
    lens = torch.nn.functional.pad(seq_lens, (0, rows - real))
    return FormInputs(table, lens, None, torch.arange(rows, dtype=torch.int32, device=device), lens - 1, rows)


def packed_inputs(block_table: torch.Tensor, seq_lens: torch.Tensor, query_start: torch.Tensor, num_tokens: int,
                  rows: int, width: int, tokens: int) -> FormInputs:
    """The packed form's inputs for prefill rows.

    Args:
        block_table: int32 [B, W], seq_lens int32 [B]: the prefill rows only.
        query_start: int32 [B + 1], their tokens' offsets within the packed prefill tokens (starting at 0).
        num_tokens: real prefill tokens (query_start[-1], known on the host from the query's shape).
        rows, width, tokens: the padded sizes.
    """
    real, table_width = block_table.shape
    device = block_table.device
    table = torch.nn.functional.pad(block_table, (0, width - table_width, 0, rows - real))
    lens = torch.nn.functional.pad(seq_lens, (0, rows - real))
    # padding rows start and end at the last real token, so they own no token
    starts = torch.cat([query_start, query_start[-1:].expand(rows - real)])
    token = torch.arange(tokens, dtype=torch.int32, device=device)
    row = torch.searchsorted(starts[1:real + 1], token, right=True).clamp(max=real - 1).to(torch.int32)
    qpos = lens[row] - (starts[row + 1] - token)
    qpos = torch.where(token < num_tokens, qpos, -1).to(torch.int32)
    return FormInputs(table, lens, starts, row, qpos, tokens)


def decode_block_lists(inputs: FormInputs, block_size: int, window: int | None):
    """(kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) of the decode form: per row, int32 [rows]
    and [rows, W]. Row b reads logical blocks first..last of its table row (first: where its window starts); a
    block is full when every slot is at or before the query and inside the window."""
    table, lens = inputs.table, inputs.seq_lens
    logical = torch.arange(table.shape[1], device=table.device).unsqueeze(0)  # [1, W]
    qpos = (lens - 1).unsqueeze(1)  # [rows, 1]; padding rows: -1, reading nothing
    first_key = torch.zeros_like(qpos) if window is None else torch.clamp(qpos - window + 1, min=0)
    in_range = (logical >= first_key // block_size) & (logical * block_size <= qpos)
    full = in_range & ((logical + 1) * block_size - 1 <= qpos) & (logical * block_size >= first_key)
    return (*_compact(table, in_range & ~full), *_compact(table, full))


def packed_block_lists(inputs: FormInputs, block_size: int, window: int | None):
    """The same four lists for the packed form, per query block: int32 [query blocks] and [query blocks, C].

    For each query block and each of the (at most QUERY_BLOCK) rows its tokens belong to, the candidates are that
    row's logical blocks from where its first token's window starts to its last token's block. A block is full
    only when the query block holds tokens of that one row alone and every slot is visible from all of them;
    the rest are partial, de-duplicated across rows (shared prefix blocks).
    """
    table, starts = inputs.table, inputs.query_start
    assert starts is not None  # the packed form's inputs carry their query starts
    device = table.device
    rows, width = table.shape
    num_blocks_q = inputs.num_queries // QUERY_BLOCK
    block_start = torch.arange(num_blocks_q, device=device).unsqueeze(1) * QUERY_BLOCK  # [Qb, 1]
    block_end = block_start + QUERY_BLOCK
    first_row = inputs.row_of[block_start.squeeze(1)].unsqueeze(1)  # [Qb, 1]
    last_row = inputs.row_of[block_end.squeeze(1) - 1].unsqueeze(1)
    row = first_row + torch.arange(QUERY_BLOCK, device=device).unsqueeze(0)  # [Qb, R]
    present = row <= last_row
    row = torch.clamp(row, max=rows - 1)
    row_start, row_end, length = starts[row], starts[row + 1], inputs.seq_lens[row]
    first_token = torch.maximum(row_start, block_start)
    last_token = torch.minimum(row_end, block_end) - 1
    present = present & (first_token <= last_token)  # padding rows own no token
    first_q = length - (row_end - first_token)  # positions of the row's first and last token in the block
    last_q = length - (row_end - last_token)
    first_key = torch.zeros_like(first_q) if window is None else torch.clamp(first_q - window + 1, min=0)
    last_first_key = torch.zeros_like(last_q) if window is None else last_q - window + 1
    logical = torch.arange(width, device=device)  # [W]
    in_range = (present.unsqueeze(2) & (logical >= (first_key // block_size).unsqueeze(2))
                & (logical * block_size <= last_q.unsqueeze(2)))  # [Qb, R, W]
    alone = (row_start <= block_start) & (row_end >= block_end)  # every query of the block is this row's
    full = (in_range & alone.unsqueeze(2) & ((logical + 1) * block_size - 1 <= first_q.unsqueeze(2))
            & (logical * block_size >= last_first_key.unsqueeze(2)))
    blocks = table[row]  # [Qb, R, W]
    partial = torch.where(in_range & ~full, blocks, _NO_BLOCK).flatten(1)  # [Qb, R*W]
    partial, _ = partial.sort(dim=-1)
    repeated = torch.cat([torch.zeros_like(partial[:, :1], dtype=torch.bool), partial[:, 1:] == partial[:, :-1]], 1)
    keep = (partial != _NO_BLOCK) & ~repeated
    return (*_compact(partial, keep), *_compact(blocks.flatten(1), full.flatten(1)))


def block_mask(lists, mask_mod, decode: bool, num_queries: int, num_cache_blocks: int, block_size: int) -> BlockMask:
    """A BlockMask over the whole cache view from four block lists and the mask_mod.

    Args:
        lists: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices), int32: per decode row ([rows],
            [rows, C]) or per packed query block ([Qb], [Qb, C]).
        decode: the decode form (one batch row per sequence, query length 1) or the packed one (one batch row of
            num_queries tokens).
    """
    def shaped(counts, indices):
        if decode:  # [B, H=1, one query block] and [B, 1, 1, C]
            return counts.view(-1, 1, 1), indices.view(indices.shape[0], 1, 1, -1)
        return counts.view(1, 1, -1), indices.view(1, 1, *indices.shape)  # [1, 1, Qb] and [1, 1, Qb, C]

    kv_num, kv_indices = shaped(*lists[:2])
    full_num, full_indices = shaped(*lists[2:])
    q_block = DECODE_QUERY_BLOCK if decode else QUERY_BLOCK
    return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, BLOCK_SIZE=(q_block, block_size),
                                    mask_mod=mask_mod, seq_lengths=(1 if decode else num_queries,
                                                                    num_cache_blocks * block_size),
                                    compute_q_blocks=False)  # q-major lists are for the backward pass only
