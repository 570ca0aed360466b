"""Step planning: which requests run next and how many tokens each computes.

There is no prefill phase and no decode phase (the note atop vLLM v1's `schedule()` says the same): every
request has `num_computed_tokens` chasing `num_tokens`, under one token budget per step. Running requests
are served first (a decode costs one token), then waiting requests fill what is left, their prompts cut
into chunks. When a running request needs a block and none is free, the lowest-ranked running request is
preempted: its blocks are freed and it waits again, to be recomputed later.
"""

from __future__ import annotations

import heapq
import time
from collections import defaultdict
from dataclasses import dataclass, field

from common.config import SchedulerConfig
from common.messages import (
    CachedRequestData, FinishReason, NewRequestData, RequestOutput, SchedulerStats, StepPlan, StepResult, Submit,
    TokenLogprobs,
)
from scheduler.kv_cache import KVCacheManager
from scheduler.queue import WaitingQueue
from scheduler.request import Request, RequestStatus


@dataclass
class ScheduledStep:
    """What the scheduler remembers of the plan in flight, to apply its result."""

    plan: StepPlan
    num_scheduled: dict[str, int] = field(default_factory=dict)
    num_prompt_tokens: int = 0  # of the scheduled tokens, how many are prompt (prefill) tokens


class Scheduler:
    """Owns requests, queues and the KV cache manager. Driven by the loop (scheduler/loop.py) or by tests
    with fabricated StepResults.

    Args:
        config: budgets and queue bound.
        kv: the KV cache manager sized from the worker's report.
        max_model_len: longest prompt + output in tokens.
        eos_token_ids: model end-of-sequence ids.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, eos_token_ids: tuple[int, ...]):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy, config.priority_aging_seconds)
        self.running: list[Request] = []
        self._known_to_worker: set[str] = set()
        self._finished_since_plan: list[str] = []
        self._preempted_since_plan: list[str] = []
        self._needs_full_block_table: set[str] = set()  # preempted: resend the whole table on resume
        self._step_id = 0
        self.num_preemptions = 0
        self.num_rejected = 0
        self.num_timed_out = 0
        self._deadlines: list[tuple[float, str]] = []
        self._pending_outputs: dict[bytes, list[RequestOutput]] = defaultdict(list)

    # ---- arrivals and departures ------------------------------------------------------------------------

    def add_request(self, client: bytes, submit: Submit) -> None:
        """Queue a request, or answer at once with a terminal error when it can never run or the queue is full."""
        if submit.request_id in self.requests:
            return self._reject(client, submit.request_id, 400, f"request id {submit.request_id!r} is already in use")
        max_len = min(len(submit.prompt_token_ids) + submit.sampling.max_tokens, self.max_model_len)
        if self.kv.blocks_needed(max_len) > self.kv.pool.num_blocks:
            return self._reject(client, submit.request_id, 400,
                                f"prompt + max_tokens needs {max_len} tokens of KV cache; the whole cache holds "
                                f"{self.kv.pool.num_blocks * self.kv.block_size}")
        request = Request(submit.request_id, client, list(submit.prompt_token_ids), submit.sampling,
                          submit.arrival_time, submit.priority)
        if len(self.waiting) >= self.config.max_waiting_requests and not self._make_room_for(request):
            return self._reject(client, submit.request_id, 503, "the server is at capacity: waiting queue is full")
        timeout = submit.timeout or self.config.request_timeout
        if submit.timeout and self.config.request_timeout:  # the server's limit is a cap, not a default only
            timeout = min(submit.timeout, self.config.request_timeout)
        if timeout > 0:
            request.deadline = submit.arrival_time + timeout
            heapq.heappush(self._deadlines, (request.deadline, request.request_id))
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def _make_room_for(self, request: Request) -> bool:
        """With the waiting queue full, turn away its lowest-ranked request if `request` ranks above it.
        Under FCFS a newcomer always ranks last, so only the priority policy can displace anyone."""
        if self.waiting.policy == "fcfs":
            return False
        worst = max(self.waiting, key=self.waiting.rank)
        if self.waiting.rank(request) >= self.waiting.rank(worst):
            return False
        self.num_rejected += 1
        self._finish(worst, FinishReason.ERROR, 503, "the server is at capacity: displaced by higher-priority requests")
        return True

    def expire(self, now: float) -> None:
        """End every request whose deadline (time.time() seconds) has passed, freeing its blocks."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            if request is not None:
                self.num_timed_out += 1
                self._finish(request, FinishReason.ERROR, 408,
                             f"request timed out after {request.deadline - request.arrival_time:.3g} s")

    def abort(self, request_ids: list[str]) -> None:
        """End requests now (client gone or cancelled); their blocks return to the pool immediately."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, FinishReason.ABORT)

    def abort_client(self, client: bytes) -> list[str]:
        """End every request of a frontend that is gone, freeing their blocks; their outputs are dropped.
        Returns the ids. (Issue 9: the loop calls this for frontends that stopped heartbeating.)"""
        request_ids = [r.request_id for r in self.requests.values() if r.client == client]
        self.abort(request_ids)
        self._pending_outputs.pop(client, None)
        return request_ids

    def fail(self, request_ids: list[str], status: int, message: str) -> None:
        """End requests with an error output (e.g. the worker failed their step)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, FinishReason.ERROR, status, message)

    def _emit(self, request: Request, token_ids: list[int], reason: FinishReason | None = None,
              logprobs: list[TokenLogprobs] | None = None, status: int = 0, message: str = "") -> None:
        """Queue one output for the request's frontend; its first output also carries what is sent once
        (when it left the queue, and the prompt's logprobs)."""
        first = not request.has_output
        request.has_output = True
        self._pending_outputs[request.client].append(RequestOutput(
            request.request_id, token_ids, reason, max(request.num_cached_tokens, 0), status, message, logprobs or [],
            request.first_scheduled_time if first else 0.0, request.prompt_logprobs if first else []))

    def _reject(self, client: bytes, request_id: str, status: int, message: str) -> None:
        self.num_rejected += 1
        self._pending_outputs[client].append(
            RequestOutput(request_id, finish_reason=FinishReason.ERROR, error_status=status, error_message=message))

    def _finish(self, request: Request, reason: FinishReason, status: int = 0, message: str = "",
                new_token_ids: list[int] | None = None, logprobs: list[TokenLogprobs] | None = None) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request.request_id)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        del self.requests[request.request_id]
        self._needs_full_block_table.discard(request.request_id)
        if request.request_id in self._known_to_worker:
            self._known_to_worker.discard(request.request_id)
            self._finished_since_plan.append(request.request_id)
        self._emit(request, new_token_ids or [], reason, logprobs, status, message)

    # ---- planning -----------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> ScheduledStep:
        """Plan one step under max_num_seqs and max_num_batched_tokens."""
        budget = self.config.max_num_batched_tokens
        step = ScheduledStep(StepPlan(self._step_id, [], []))
        self._step_id += 1
        new_blocks: dict[str, list[int]] = {}

        preemptions_before = self.num_preemptions
        # Serve in rank order, so the lowest-ranked running request (the preemption victim) is always last
        # and never one already planned this step.
        self.running.sort(key=self.waiting.rank)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            added = self._allocate_or_preempt(request, num_new)
            if added is None:
                break  # the request itself was preempted; everything after it ranks lower still
            new_blocks[request.request_id] = added
            step.num_scheduled[request.request_id] = num_new
            budget -= num_new
            index += 1

        # A step that had to preempt admits nobody: the blocks it freed belong to the running requests.
        if self.num_preemptions == preemptions_before:
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting.peek()
                if request is None:
                    break
                cached = [] if request.sampling.prompt_logprobs is not None else self.kv.find_cached_prefix(request)
                num_cached = len(cached) * self.kv.block_size
                num_new = min(request.num_tokens - num_cached, budget)
                added = self.kv.allocate_slots(request, num_new, cached)
                if added is None:
                    break
                self.waiting.pop()
                if request.sampling.prompt_logprobs is None:
                    self.kv.record_prefix_lookup(request.num_tokens, num_cached)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached
                    request.first_scheduled_time = time.time()
                request.num_computed_tokens = num_cached
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                new_blocks[request.request_id] = added
                step.num_scheduled[request.request_id] = num_new
                budget -= num_new

        self._fill_plan(step, new_blocks)
        return step

    def _allocate_or_preempt(self, request: Request, num_new: int) -> list[int] | None:
        """Allocate slots for a running request, preempting lower-ranked ones until it fits.
        Returns None when `request` itself had to be preempted."""
        while True:
            added = self.kv.allocate_slots(request, num_new)
            if added is not None:
                return added
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return None

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request, finished=False)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        if request.request_id in self._known_to_worker:
            self._preempted_since_plan.append(request.request_id)
            self._needs_full_block_table.add(request.request_id)
        self.waiting.push(request)

    def _fill_plan(self, step: ScheduledStep, new_blocks: dict[str, list[int]]) -> None:
        plan = step.plan
        plan.finished_ids, self._finished_since_plan = self._finished_since_plan, []
        plan.preempted_ids, self._preempted_since_plan = self._preempted_since_plan, []
        for request_id, num_new in step.num_scheduled.items():
            request = self.requests[request_id]
            num_prompt = len(request.prompt_token_ids)
            step.num_prompt_tokens += max(0, min(request.num_computed_tokens + num_new, num_prompt)
                                          - request.num_computed_tokens)
            if request_id not in self._known_to_worker:
                self._known_to_worker.add(request_id)
                plan.new_requests.append(NewRequestData(
                    request_id, request.all_token_ids, request.sampling, self.kv.block_tables[request_id],
                    request.num_computed_tokens, num_new))
            else:
                resumed = request_id in self._needs_full_block_table
                self._needs_full_block_table.discard(request_id)
                blocks = self.kv.block_tables[request_id] if resumed else new_blocks[request_id]
                plan.cached_requests.append(CachedRequestData(
                    request_id, blocks, request.num_computed_tokens, num_new, resumed))

    # ---- results --------------------------------------------------------------------------------------------

    def update_from_output(self, step: ScheduledStep, result: StepResult) -> None:
        """Advance computed tokens, append sampled ones and finish what stopped. Outputs collect in
        `take_outputs()`."""
        for request_id, num_new in step.num_scheduled.items():
            request = self.requests.get(request_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.num_computed_tokens += num_new
        for chunk in result.prompt_logprobs:
            request = self.requests.get(chunk.request_id)
            if request is not None:
                request.prompt_logprobs.extend(chunk.entries)
        for i, (request_id, token_id) in enumerate(zip(result.request_ids, result.token_ids)):
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            request.output_token_ids.append(token_id)
            logprobs = [result.logprobs[i]] if result.logprobs and result.logprobs[i] is not None else []
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason, new_token_ids=[token_id], logprobs=logprobs)
            else:
                self._emit(request, [token_id], logprobs=logprobs)

    def _stop_reason(self, request: Request, token_id: int) -> FinishReason | None:
        sampling = request.sampling
        num_output = len(request.output_token_ids)
        if num_output > sampling.min_tokens:  # the sampler masks stop ids before min_tokens
            if token_id in sampling.stop_token_ids or (not sampling.ignore_eos and token_id in self.eos_token_ids):
                return FinishReason.STOP
        if num_output >= sampling.max_tokens or request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def take_outputs(self) -> dict[bytes, list[RequestOutput]]:
        """Outputs produced since the last call, grouped by frontend identity."""
        outputs, self._pending_outputs = self._pending_outputs, defaultdict(list)
        return outputs

    def stats(self) -> SchedulerStats:
        pool = self.kv.pool
        return SchedulerStats(
            num_waiting=len(self.waiting), num_running=len(self.running), num_free_blocks=pool.num_free,
            num_cached_blocks=pool.num_cached, num_total_blocks=pool.num_blocks, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits, num_steps=self._step_id,
            num_rejected=self.num_rejected, num_timed_out=self.num_timed_out,
            num_blocks_in_use=pool.num_blocks - pool.num_free)
