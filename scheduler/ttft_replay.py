"""The replay behind SLO admission's TTFT prediction (scheduler/admission.py): the scheduler's own rules, run on a
light copy of its state (budgets, the long-prefill cap, slots and KV blocks), one step at a time.

tests/unit/test_ttft_prediction.py checks the prediction built on it against the simulator, which runs the real
Scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Sequence

from shuttle.scheduler.request import Request
from shuttle.scheduler.step_cost import StepCostModel


@dataclass(frozen=True, slots=True)
class AdmissionView:
    """The read-only part of the scheduler's state that a prediction replays: budgets, cache size, requests.

    Attributes:
        max_num_batched_tokens: the per-step token budget.
        max_num_seqs: most sequences in one step.
        block_size: tokens per KV block.
        num_blocks: KV blocks in the whole cache.
        running: running requests in rank order.
        waiting: waiting requests in any order (the prediction sorts those ahead by rank).
        overlapped: two steps in flight (async scheduling): a finished request holds its slot one step longer.
        prefill_chunk_cap: most prompt tokens one request computes in a step while others wait (0: the budget).
    """

    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    running: Sequence[Request]
    waiting: Iterable[Request]
    overlapped: bool = True
    prefill_chunk_cap: int = 0


@dataclass(slots=True)
class Seq:
    """A request in the prediction: prompt (or recompute) tokens still to prefill, outputs still to come."""

    prefill: int
    outputs: float
    context: int
    target: bool = False  # the arriving request
    request_id: str = ""


class Replay:
    """The scheduler's rules on the prediction's requests: budgets, the long-prefill cap, slots and KV blocks.

    Blocks are reserved for a request's whole expected length when it is admitted. With two steps in flight
    (`view.overlapped`), a request that sampled its last token still holds its slot and blocks in the step planned
    before its result came back: its slot is free again one step after it finished ("lingering").
    """

    def __init__(self, view: AdmissionView, running: list[Seq], queue: list[Seq],
                 in_newest_step: frozenset[str] = frozenset()):
        self.view = view
        self.queue = deque(queue)
        # Those whose last token is booked already run no more. Booked in the newest step in flight, they hold their
        # slot through the next plan (made before that step settles); booked only in an older one, they are gone by
        # then (it settles first).
        booked_out = [s for s in running if s.outputs <= 0 and s.prefill == 0]
        self.lingering = [s for s in booked_out if s.request_id in in_newest_step] if view.overlapped else []
        self.running = [s for s in running if s.outputs > 0 or s.prefill > 0]
        self.blocks_used = sum(map(self.reserve, self.running + self.lingering))

    def reserve(self, seq: Seq) -> int:
        """Blocks a request holds by its end (expected)."""
        return -(-(seq.context + seq.prefill + math.ceil(seq.outputs)) // self.view.block_size)

    def release(self, seqs: list[Seq]) -> None:
        self.blocks_used -= sum(map(self.reserve, seqs))

    def _cap(self) -> int:
        """Most prompt tokens of one request this step: the long-prefill cap while others wait."""
        view = self.view
        return view.prefill_chunk_cap if view.prefill_chunk_cap > 0 and self.queue else view.max_num_batched_tokens

    def compose(self) -> tuple[list[tuple[int, int, bool]], list[tuple[Seq, int]]]:
        """The next step: the running requests' decodes and prompt chunks, then admissions from the queue while the
        budget, the slots and the blocks allow. Returns the chunks (context, tokens, samples) for the cost model
        and each request with the tokens it computes."""
        view = self.view
        budget = view.max_num_batched_tokens
        chunks: list[tuple[int, int, bool]] = []
        computed: list[tuple[Seq, int]] = []
        cap = self._cap()
        for seq in self.running:
            if budget <= 0:
                break
            num_new = 1 if seq.prefill == 0 else min(seq.prefill, budget, cap)
            chunks.append((seq.context, num_new, seq.prefill <= num_new))
            computed.append((seq, num_new))
            budget -= num_new
        while self.queue and budget > 0 and len(self.running) + len(self.lingering) < view.max_num_seqs:
            head = self.queue[0]
            if self.blocks_used + self.reserve(head) > view.num_blocks and self.running:
                break
            self.queue.popleft()
            self.running.append(head)
            self.blocks_used += self.reserve(head)
            num_new = min(head.prefill, budget, self._cap())
            chunks.append((head.context, num_new, head.prefill <= num_new))
            computed.append((head, num_new))
            budget -= num_new
        return chunks, computed

    def only_decodes_ahead(self) -> bool:
        """Every running request decodes and none can be admitted until one of them finishes."""
        view, queue = self.view, self.queue
        can_admit = bool(queue) and len(self.running) < view.max_num_seqs and \
            self.blocks_used + self.reserve(queue[0]) <= view.num_blocks
        return not self.lingering and all(s.prefill == 0 for s in self.running) and not can_admit

    def decode_stretch(self, cost: StepCostModel) -> float:
        """Run the decodes until the next request finishes; returns their seconds."""
        steps = max(1, math.ceil(min(s.outputs for s in self.running)))
        seconds = cost.decode_run(len(self.running), sum(s.context for s in self.running), steps)
        for seq in self.running:
            seq.outputs -= steps
            seq.context += steps
        return seconds

    def advance(self, computed: list[tuple[Seq, int]]) -> bool:
        """Apply one composed step; True when it ends the target's prompt (its first token is sampled)."""
        for seq, num_new in computed:
            if seq.prefill:
                seq.prefill -= num_new
                seq.context += num_new
                if seq.prefill == 0:
                    if seq.target:
                        return True
                    seq.outputs -= 1
            else:
                seq.outputs -= 1
                seq.context += 1
        return False

    def end_step(self) -> None:
        """After a step: last step's finished requests free their slots; this step's finish (or linger)."""
        self.release(self.lingering)
        finished = [s for s in self.running if s.outputs <= 0 and s.prefill == 0]
        if finished:
            self.running = [s for s in self.running if s.outputs > 0 or s.prefill > 0]
        if self.view.overlapped:
            self.lingering = finished
        else:
            self.release(finished)
            self.lingering = []
