"""Per-request state kept across steps, and the packing of one StepPlan into the step's tensors.

Each request the worker holds owns a row of a persistent block-table array (numpy, int32), filled as block ids
arrive, so a step's block table is one fancy-index of the scheduled rows; unused entries hold the null block.
Rows are packed decodes first (one query token each), then prefill chunks, the order attention backends expect.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from shuttle.common.messages import StepPlan
from shuttle.worker.attention import AttentionMetadata
from shuttle.worker.sampler import SamplingState


@dataclass(eq=False)
class CachedRequestState:
    """What the worker remembers of a request between steps.

    Attributes:
        token_ids: prompt + every token sampled so far (the worker appends its own samples, which is what lets
            the next step be planned before this one's result reaches the scheduler).
        row: the request's row in the persistent block table.
        num_blocks: block ids written in that row.
        sampling: parameters plus per-request sampling state.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingState
    row: int
    num_blocks: int = 0
    num_computed_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # this step's drafts, verified after it runs
    lora_slot: int = -1  # the LoRA adapter slot its rows use (worker/lora.py; -1: the base model)
    next_prompt_logprob: int = 0  # first prompt position whose logits (predicting the next token) are not sent yet


@dataclass
class StepInputs:
    """Model inputs for one step: all scheduled tokens of all sequences side by side, no padding.

    Attributes:
        input_ids, positions: int64 [T].
        attention: the step's AttentionMetadata.
        sample_rows: int64 [S], packed rows whose logits are sampled (the last token of each sequence whose chunk
            reaches the end of its known tokens); sampled_requests: those S requests, in the same order.
        prompt_rows: per request asking for prompt logprobs, (state, first prompt position, rows, next prompt
            token ids); logits are also kept at those rows, after the S sampling rows, in this order.
        spec_requests: requests verifying drafts; each has 1 + len(drafts) sampling rows, kept after the S rows
            above (in this order, the rows of one request consecutive) and before the prompt-logprob rows.
        token_slots: int64 [T], each packed token's LoRA adapter slot (-1: the base model); None when no row of
            the step runs through an adapter.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    sample_rows: torch.Tensor
    sampled_requests: list[CachedRequestState] = field(default_factory=list)
    prompt_rows: list[tuple[CachedRequestState, int, list[int], list[int]]] = field(default_factory=list)
    spec_requests: list[CachedRequestState] = field(default_factory=list)
    token_slots: torch.Tensor | None = None

    @property
    def logits_rows(self) -> torch.Tensor:
        """int64: the rows whose logits the model computes (sampling rows, then prompt-logprob rows)."""
        extra = [r for _, _, rows, _ in self.prompt_rows for r in rows]
        return torch.cat([self.sample_rows, torch.tensor(extra, dtype=torch.long)]) if extra else self.sample_rows


class InputBatch:
    """Applies plans to the per-request states and packs each step's tensors.

    Args:
        block_size: tokens per KV block.
        null_block: block id that pads block tables (never handed out by the scheduler).
        max_blocks_per_seq: columns of the persistent block table (max_model_len / block_size, rounded up).
    """

    def __init__(self, block_size: int, null_block: int, max_blocks_per_seq: int, initial_rows: int = 64):
        self.block_size = block_size
        self.null_block = null_block
        self.requests: dict[str, CachedRequestState] = {}
        self.num_constrained = 0  # requests held with a grammar (worker/grammar.py): 0 means no step masks logits
        self.num_lora = 0  # requests held with a LoRA adapter (worker/lora.py): 0 means no step builds token slots
        self._table = np.full((initial_rows, max_blocks_per_seq), null_block, dtype=np.int32)
        self._free_rows = list(range(initial_rows - 1, -1, -1))
        self._row_ranges: dict[int, tuple[torch.Tensor, torch.Tensor, list[int]]] = {}

    def apply(self, plan: StepPlan) -> list[tuple[CachedRequestState, int]]:
        """Update states from the plan; returns (state, num_scheduled_tokens) of the step's requests.

        A cached request the worker does not hold (its state was dropped when a step failed) is skipped: the
        scheduler fails it, and its sampled tokens would be dropped anyway.
        """
        for request_id in plan.finished_ids:
            self.drop(request_id)
        scheduled = []
        for new in plan.new_requests:
            self.drop(new.request_id)
            state = CachedRequestState(new.request_id, list(new.token_ids),
                                       SamplingState(new.sampling, new.prompt_len or len(new.token_ids)),
                                       self._take_row(), num_computed_tokens=new.num_computed_tokens,
                                       lora_slot=new.lora_slot)
            self._append_blocks(state, new.block_ids)
            self.requests[new.request_id] = state
            self.num_constrained += new.sampling.structured is not None
            self.num_lora += new.lora_slot >= 0
            scheduled.append((state, new.num_scheduled_tokens))
        for cached in plan.cached_requests:
            known = self.requests.get(cached.request_id)
            if known is None:
                continue
            state = known
            self._append_blocks(state, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            state.draft_token_ids = cached.draft_token_ids
            scheduled.append((state, cached.num_scheduled_tokens))
        return scheduled

    def drop(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            self.num_constrained -= state.sampling.params.structured is not None
            self.num_lora -= state.lora_slot >= 0
            self._table[state.row, :state.num_blocks] = self.null_block
            self._free_rows.append(state.row)

    def _take_row(self) -> int:
        if not self._free_rows:
            grown = np.full((len(self._table) * 2, self._table.shape[1]), self.null_block, dtype=np.int32)
            grown[:len(self._table)] = self._table
            self._free_rows = list(range(len(grown) - 1, len(self._table) - 1, -1))
            self._table = grown
        return self._free_rows.pop()

    def trim_blocks(self, state: CachedRequestState, num_tokens: int) -> None:
        """Forget the request's blocks past its first `num_tokens` tokens (rejected drafts' slots), as the
        scheduler's KV cache manager gives them back by the same rule."""
        keep = -(-num_tokens // self.block_size)
        if state.num_blocks > keep:
            self._table[state.row, keep:state.num_blocks] = self.null_block
            state.num_blocks = keep

    def _append_blocks(self, state: CachedRequestState, block_ids: list[int]) -> None:
        if block_ids:
            self._table[state.row, state.num_blocks:state.num_blocks + len(block_ids)] = block_ids
            state.num_blocks += len(block_ids)

    def pack(self, scheduled: list[tuple[CachedRequestState, int]]) -> StepInputs:
        """Build the step's tensors for the scheduled requests (decodes first)."""
        positions = []
        for state, num_new in scheduled:
            if num_new != 1 or len(state.token_ids) != state.num_computed_tokens + 1:
                break
            positions.append(state.num_computed_tokens)
        else:
            return self._pack_decodes([state for state, _ in scheduled], positions)
        return self._pack_mixed(scheduled)

    def _pack_mixed(self, scheduled: list[tuple[CachedRequestState, int]]) -> StepInputs:
        """pack() for any step: prefill chunks (prompt logprobs included) and decodes."""
        decodes = [item for item in scheduled if item[1] == 1]
        prefills = [item for item in scheduled if item[1] != 1]
        ordered = decodes + prefills
        input_ids: list[int] = []
        query_start = [0]
        starts: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[CachedRequestState] = []
        spec_rows: list[int] = []
        spec: list[CachedRequestState] = []
        prompt_rows = []
        for state, num_new in ordered:
            start = state.num_computed_tokens
            end = start + num_new
            row = query_start[-1]
            if num_new == 1:
                input_ids.append(state.token_ids[start])
            else:
                input_ids.extend(state.token_ids[start:end])
            query_start.append(row + num_new)
            starts.append(start)
            seq_lens.append(end)
            if state.draft_token_ids:  # the last known token, then the drafts: every row's logits verify
                input_ids.extend(state.draft_token_ids)
                spec_rows.extend(range(row, row + num_new))
                spec.append(state)
            elif end == len(state.token_ids):
                sample_rows.append(row + num_new - 1)
                sampled.append(state)
            if state.sampling.params.prompt_logprobs is not None:
                # position p's logits predict token p + 1; the last prompt position is the ordinary sample
                first, last = max(start, state.next_prompt_logprob), min(end, state.sampling.prompt_len - 1)
                if first < last:
                    prompt_rows.append((state, first, [row + p - start for p in range(first, last)],
                                        state.token_ids[first + 1:last + 1]))
                    state.next_prompt_logprob = last
        bs = self.block_size
        lens = np.array(seq_lens, dtype=np.int64)
        width = int(-(-lens.max() // bs))
        table = self._table[[state.row for state, _ in ordered], :width]
        counts: np.ndarray = np.diff(np.array(query_start, dtype=np.int64))  # numpy's stubs make it timedelta64
        seq_of_token = np.repeat(np.arange(len(ordered)), counts)
        positions = np.arange(query_start[-1], dtype=np.int64) + np.repeat(np.array(starts) - query_start[:-1], counts)
        slots = table[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        attention = AttentionMetadata(
            query_start_loc=torch.tensor(query_start,
                                         dtype=torch.int32), seq_lens=torch.from_numpy(lens.astype(np.int32)),
            block_table=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots), num_decodes=len(decodes),
            max_query_len=int(counts.max()), max_seq_len=int(lens.max()), query_start_list=query_start,
            seq_lens_list=seq_lens)
        return StepInputs(torch.tensor(input_ids, dtype=torch.long), torch.from_numpy(positions), attention,
                          torch.tensor(sample_rows + spec_rows, dtype=torch.long), sampled, prompt_rows, spec,
                          _token_slots([state for state, _ in ordered], counts) if self.num_lora else None)

    def pack_decode_rows(self, states: list[CachedRequestState], token_ids: list[int],
                         positions: list[int]) -> StepInputs:
        """One row per state: `token_ids[i]` at `positions[i]` (a draft model's pass, worker/draft_model.py), every
        row sampled. The states' blocks must cover the positions."""
        return self._pack_decodes(states, positions, token_ids)

    def _pack_decodes(self, states: list[CachedRequestState], positions: list[int],
                      token_ids: list[int] | None = None) -> StepInputs:
        """pack() for a step of decodes only (each row's one new token is its last known one, so every row samples
        and none is in its prompt): the common steady state, built with fewer passes. `token_ids`: the rows'
        tokens when they are not the states' last known ones."""
        bs, num_seqs = self.block_size, len(states)
        pos = np.array(positions, dtype=np.int64)
        lens = pos + 1
        width = int(-(-lens.max() // bs))
        table = self._table[[s.row for s in states], :width]
        slots = table[np.arange(num_seqs), pos // bs].astype(np.int64) * bs + pos % bs
        if num_seqs not in self._row_ranges:  # shared read-only tensors 0..B (query_start_loc, sample_rows)
            self._row_ranges[num_seqs] = (torch.arange(num_seqs + 1, dtype=torch.int32),
                                          torch.arange(num_seqs, dtype=torch.long), list(range(num_seqs + 1)))
        query_start_loc, sample_rows, query_start = self._row_ranges[num_seqs]
        attention = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=torch.from_numpy(lens.astype(np.int32)),
            block_table=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots), num_decodes=num_seqs,
            max_query_len=1, max_seq_len=int(lens.max()), query_start_list=query_start, seq_lens_list=lens.tolist())
        tokens = [s.token_ids[-1] for s in states] if token_ids is None else token_ids
        return StepInputs(torch.tensor(tokens, dtype=torch.long), torch.from_numpy(pos),
                          attention, sample_rows, states, token_slots=_token_slots(states) if self.num_lora else None)


def _token_slots(states: list[CachedRequestState], counts: np.ndarray | None = None) -> torch.Tensor | None:
    """int64 [T]: each packed token's LoRA slot (`counts`: tokens per state, 1 each when None); None when every
    state runs the base model."""
    if all(state.lora_slot < 0 for state in states):
        return None
    slots = np.array([state.lora_slot for state in states], dtype=np.int64)
    return torch.from_numpy(slots if counts is None else np.repeat(slots, counts))
