"""Per-request state kept across steps, and the packing of one StepPlan into model inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.messages import StepPlan
from worker.attention import PagedAttentionMetadata, SequenceAttention
from worker.sampler import SamplingState


@dataclass(eq=False)
class CachedRequestState:
    """What the worker remembers of a request between steps.

    Attributes:
        token_ids: prompt + every token sampled so far (the worker appends its own samples).
        block_ids: the block table, as the scheduler sent it.
        sampling: parameters plus the state (seeded generator, penalty counts) that must outlive one step.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingState
    block_ids: list[int]
    num_computed_tokens: int = 0
    next_prompt_logprob: int = 0  # first prompt position whose logits (predicting the next token) are not sent yet


@dataclass
class PackedBatch:
    """Model inputs for one step: all scheduled tokens of all sequences side by side, no padding.

    Attributes:
        input_ids, positions: int64 [T].
        sample_rows: int64 [S], rows whose logits are sampled (the last scheduled token of each sequence
            whose chunk reaches the end of its known tokens).
        sampled_requests: the S requests, in row order.
        prompt_rows: per request asking for prompt logprobs, (state, rows, next prompt token ids): logits are
            also kept at those rows, after the S sampling rows, in this order.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: PagedAttentionMetadata
    sample_rows: torch.Tensor
    sampled_requests: list[CachedRequestState] = field(default_factory=list)
    prompt_rows: list[tuple[CachedRequestState, list[int], list[int]]] = field(default_factory=list)

    @property
    def logits_rows(self) -> torch.Tensor:
        """int64: the rows whose logits the model computes (sampling rows, then prompt-logprob rows)."""
        extra = [r for _, rows, _ in self.prompt_rows for r in rows]
        return torch.cat([self.sample_rows, torch.tensor(extra, dtype=torch.long)]) if extra else self.sample_rows


class InputBatch:
    """Applies plans to the per-request states and packs each step's tensors.

    Args:
        block_size: tokens per KV block.
        kv_caches: per layer (key, value), each [num_blocks, block_size, num_kv_heads, head_dim].
    """

    def __init__(self, block_size: int, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.block_size = block_size
        self.kv_caches = kv_caches
        self.requests: dict[str, CachedRequestState] = {}

    def apply(self, plan: StepPlan) -> list[tuple[CachedRequestState, int]]:
        """Update states from the plan; returns (state, num_scheduled_tokens) in plan order."""
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
        for request_id in plan.preempted_ids:
            if request_id in self.requests:
                self.requests[request_id].block_ids = []
        scheduled = []
        for new in plan.new_requests:
            state = CachedRequestState(new.request_id, list(new.token_ids),
                                       SamplingState(new.sampling, len(new.token_ids)), list(new.block_ids),
                                       new.num_computed_tokens)
            self.requests[new.request_id] = state
            scheduled.append((state, new.num_scheduled_tokens))
        for cached in plan.cached_requests:
            state = self.requests[cached.request_id]
            if cached.resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens
            scheduled.append((state, cached.num_scheduled_tokens))
        return scheduled

    def pack(self, scheduled: list[tuple[CachedRequestState, int]]) -> PackedBatch:
        """Build the packed tensors and attention metadata for the scheduled requests."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        sequences: list[SequenceAttention] = []
        sample_rows: list[int] = []
        sampled: list[CachedRequestState] = []
        prompt_rows: list[tuple[CachedRequestState, list[int], list[int]]] = []
        bs = self.block_size
        for state, num_new in scheduled:
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_new
            row = len(input_ids)
            input_ids.extend(state.token_ids[start:end])
            block_ids = torch.tensor(state.block_ids[: -(-end // bs)], dtype=torch.long)
            new_positions = torch.arange(start, end)
            positions.append(new_positions)
            slots.append(block_ids[new_positions // bs] * bs + new_positions % bs)
            sequences.append(SequenceAttention(row, row + num_new, block_ids, end, _chunk_mask(start, end)))
            if end == len(state.token_ids):
                sample_rows.append(row + num_new - 1)
                sampled.append(state)
            if state.sampling.params.prompt_logprobs is not None:
                # position p's logits predict token p + 1; the last prompt position is the ordinary sample
                first, last = max(start, state.next_prompt_logprob), min(end, state.sampling.prompt_len - 1)
                if first < last:
                    prompt_rows.append((state, [row + p - start for p in range(first, last)],
                                        state.token_ids[first + 1:last + 1]))
                    state.next_prompt_logprob = last
        attention = PagedAttentionMetadata(self.kv_caches, torch.cat(slots), sequences)
        return PackedBatch(torch.tensor(input_ids), torch.cat(positions), attention,
                           torch.tensor(sample_rows, dtype=torch.long), sampled, prompt_rows)


def _chunk_mask(start: int, end: int) -> torch.Tensor | None:
    """Causal mask of queries [start, end) over keys [0, end); None for one query or a prefill from 0."""
    if start == 0 or end - start == 1:
        return None
    query_pos = torch.arange(start, end).unsqueeze(1)
    return torch.arange(end).unsqueeze(0) <= query_pos  # [n, end]
