"""What the worker holds of each request, as the scheduler tracks it: a request's first plan carries all of it
(NewRequestData: tokens, sampling, block table), later plans only what changed (CachedRequestData: new blocks and
the chunk), and a request the worker knew that finished or was preempted is named once in the next plan's
finished_ids so the worker drops its state (vLLM v1's scheduler output has the same split)."""

from __future__ import annotations

from shuttle.common.messages import CachedRequestData, NewRequestData
from shuttle.scheduler.request import Request
from shuttle.scheduler.scheduled_step import ScheduledStep


class WorkerMirror:
    """The set of requests the worker holds state for, and those to drop at the next plan."""

    def __init__(self) -> None:
        self._known: set[str] = set()
        self._finished_since_plan: list[str] = []

    def forget(self, request: Request) -> None:
        """The request ended or was preempted: the next plan tells the worker to drop it (if it ever had it)."""
        if request.request_id in self._known:
            self._known.discard(request.request_id)
            self._finished_since_plan.append(request.request_id)

    def fill_plan(self, step: ScheduledStep, block_tables: dict[str, list[int]],
                  new_blocks: dict[str, list[int]]) -> None:
        """Write step.plan's request data from its booked entries: new data for requests the worker does not hold,
        cached data (the blocks added this step) for the others, and the ids to drop.

        Args:
            block_tables: request id -> its whole block table (a new request's, sent whole).
            new_blocks: request id -> blocks allocated to it in this step.
        """
        plan = step.plan
        plan.finished_ids, self._finished_since_plan = self._finished_since_plan, []
        for request_id, entry in step.scheduled.items():
            if request_id not in self._known:
                self._known.add(request_id)
                request = entry.request
                plan.new_requests.append(NewRequestData(
                    request_id=request_id, token_ids=request.all_token_ids, sampling=request.sampling,
                    block_ids=list(block_tables[request_id]), num_computed_tokens=entry.start,
                    num_scheduled_tokens=entry.num_new,
                    prompt_len=len(request.prompt_token_ids) if request.output_token_ids else 0,
                    lora_slot=request.lora_slot))
            else:
                plan.cached_requests.append(CachedRequestData(
                    request_id=request_id, new_block_ids=new_blocks[request_id], num_computed_tokens=entry.start,
                    num_scheduled_tokens=entry.num_new, draft_token_ids=list(entry.draft_token_ids)))
