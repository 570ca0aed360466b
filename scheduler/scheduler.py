"""Step planning: which requests run next and how many tokens each computes.

There is no prefill phase and no decode phase (the note atop vLLM v1's `schedule()` says the same): every
request has `num_computed_tokens` chasing its booked tokens, under one token budget per step. Running requests
are served first (a decode costs one token), then waiting requests fill what is left, their prompts cut into
chunks. When a running request needs a block and none is free, the lowest-ranked running request is preempted:
its blocks are freed and it waits again, to be recomputed later.

Book at schedule time, settle on results: `schedule()` advances `num_computed_tokens` and adds a placeholder for
each token the step will sample, so the next step can be planned while this one runs (the worker feeds its own
samples forward). `update_from_output()` turns placeholders into tokens, checks stop conditions and commits
written blocks to the prefix cache. A result for a request that finished or was preempted since the step was
planned is dropped: each planned entry remembers the Request object and its preemption epoch, never just an id
that a client could reuse.

Under --speculative-config a decoding request also books its drafts (scheduler/speculation_book.py) as more tokens
of the step; its settlement takes the 1 to 1 + drafts tokens the worker accepted and rolls back the rest (docs/
scheduling.md, "Speculative decoding").
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import time
from collections import defaultdict
from operator import attrgetter

from shuttle.common.config import SchedulerConfig
from shuttle.common.messages import (
    NEVER_FITS,
    FinishReason,
    GrammarsCompiled,
    RequestOutput,
    SchedulerStats,
    StepPlan,
    StepResult,
    Submit,
    TokenLogprobs,
)
from shuttle.scheduler.admission import AdmissionView, SloAdmission
from shuttle.scheduler.fairness import GroupShares
from shuttle.scheduler.grammar_gate import GrammarGate
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.lora_slots import LoRASlots, adapter_key
from shuttle.scheduler.queue import WaitingQueue
from shuttle.scheduler.request import Request, RequestStatus
from shuttle.scheduler.scheduled_step import ScheduledRequest, ScheduledStep
from shuttle.scheduler.speculation_book import SpeculationBook
from shuttle.scheduler.worker_mirror import WorkerMirror

_RANK = attrgetter("rank")


class Scheduler:
    """Owns requests, queues and the KV cache manager. Driven by the loop (scheduler/loop.py) or by tests
    with fabricated StepResults.

    Args:
        config: budgets and queue bound.
        kv: the KV cache manager sized from the worker's report.
        max_model_len: longest prompt + output in tokens.
        eos_token_ids: model end-of-sequence ids.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, eos_token_ids: tuple[int, ...],
                 admission: SloAdmission | None = None, lora: LoRASlots | None = None):
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.waiting = WaitingQueue(config.scheduling_policy, config.priority_aging_seconds)
        self.running: list[Request] = []  # kept in rank order: the preemption victim is always last
        self.shares = GroupShares(config.max_num_seqs, config.max_seqs_per_request)
        threshold = config.long_prefill_token_threshold
        self.prefill_chunk_cap = max(1, config.max_num_batched_tokens // 4) if threshold is None else threshold
        self.worker_mirror = WorkerMirror()  # what the worker holds of each request
        self._step_id = 0
        self.num_preemptions = 0
        self.num_rejected = 0
        self.num_timed_out = 0
        self.num_admitted = 0  # requests that left the waiting queue (resumes included): the admission rate
        self.num_scheduled_tokens = 0
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadline_seq = itertools.count()
        self._pending_outputs: dict[bytes, list[RequestOutput]] = defaultdict(list)
        self.grammars = GrammarGate()  # constrained requests wait there for their grammar (scheduler/grammar_gate.py)
        # SLO admission (scheduler/admission.py); the process that owns the scheduler loads any profile, not this class
        self.admission = admission if admission is not None else SloAdmission(config.ttft_slo_ms)
        # --speculative-config: who drafts, and vLLM's spec_decode counters (scheduler/speculation_book.py)
        spec = config.speculative_config
        self.speculation = SpeculationBook(spec) if spec is not None else None
        self.lora = lora  # the worker's LoRA adapter slots (--enable-lora; None: no adapters served)

    def _admission_view(self) -> AdmissionView:
        """What SLO admission may read: the budgets, the cache's size, the running set and the waiting queue."""
        return AdmissionView(self.config.max_num_batched_tokens, self.config.max_num_seqs, self.kv.block_size,
                             self.kv.pool.num_blocks, self.running, self.waiting, self.config.async_scheduling,
                             self.prefill_chunk_cap)

    # ---- arrivals and departures ------------------------------------------------------------------------

    def add_request(self, client: bytes, submit: Submit) -> None:
        """Queue a request, or answer at once with a terminal error when it can never run or the queue is full."""
        if submit.request_id in self.requests:
            return self.reject(client, submit.request_id, 400, f"request id {submit.request_id!r} is already in use")
        if len(submit.prompt_token_ids) >= self.max_model_len:  # the frontend checks its own limit; a remote group's
            return self.reject(client, submit.request_id, 400,  # may be smaller
                               f"the prompt's {len(submit.prompt_token_ids)} tokens leave no room for output in this "
                               f"serving group's max_model_len {self.max_model_len}")
        max_len = min(len(submit.prompt_token_ids) + submit.sampling.max_tokens, self.max_model_len)
        if self.kv.blocks_needed(max_len) > self.kv.pool.num_blocks:
            return self.reject(client, submit.request_id, 400,
                                f"prompt + max_tokens needs {max_len} {NEVER_FITS}; the whole cache holds "
                                f"{self.kv.pool.num_blocks * self.kv.block_size}")
        if submit.lora_name and (self.lora is None or not submit.lora_path):
            return self.reject(client, submit.request_id, 404, f"LoRA adapter {submit.lora_name!r} is not served")
        request = Request(submit.request_id, client, list(submit.prompt_token_ids), submit.sampling,
                          submit.arrival_time, submit.priority, submit.group_id or submit.request_id,
                          background=submit.background, lora_name=submit.lora_name,
                          lora_key=adapter_key(submit.lora_name, submit.lora_path, submit.lora_load_id)
                          if submit.lora_name else "")
        request.rank = self.waiting.rank(request)
        if self.num_waiting >= self.config.max_waiting_requests and not self._make_room_for(request):
            return self.reject(client, submit.request_id, 503, "the server is at capacity: waiting queue is full")
        verdict = self.admission.check(self._admission_view(), request, submit.ttft_slo_ms)
        if verdict is not None and verdict.unattainable:  # too late even alone: a 503 would be retried forever
            whose = f"its ttft_slo_ms {submit.ttft_slo_ms:g}" if submit.ttft_slo_ms else \
                f"the server's --ttft-slo-ms {self.admission.default_slo_ms:g}"
            return self.reject(client, submit.request_id, 400,
                                f"{whose} can never be met here: this prompt's predicted time to first token on an "
                                f"idle server is {verdict.predicted_ttft_s * 1000:.0f} ms", rejection="slo")
        if verdict is not None:  # its first token would come too late even if it waited: say so now
            return self.reject(client, submit.request_id, 503,
                                f"the server cannot meet the TTFT objective now: predicted time to first token "
                                f"{verdict.predicted_ttft_s * 1000:.0f} ms", verdict.retry_after_s, "slo")
        timeout = submit.timeout or self.config.request_timeout
        if submit.timeout and self.config.request_timeout:  # the server's limit is a cap, not a default only
            timeout = min(submit.timeout, self.config.request_timeout)
        if timeout > 0:
            request.deadline = submit.arrival_time + timeout
            heapq.heappush(self._deadlines, (request.deadline, next(self._deadline_seq), request))
        self.requests[request.request_id] = request
        self.shares.arrive(request)
        if not self.grammars.hold(request):  # a constrained request waits outside the queue for its grammar
            self.waiting.push(request)

    def on_grammars_compiled(self, message: GrammarsCompiled) -> None:
        """The worker's answer to CompileGrammars: queue the requests whose grammar is ready; end with 400 those
        whose constraint does not compile (before they ever ran: the client gets a plain 400), with 503 those the
        worker cannot compile now."""
        ready, failed = self.grammars.answered(message)
        for request in ready:
            if request.is_live:
                self.waiting.push(request)
        for request, error, status in failed:
            if request.is_live:
                self._finish(request, FinishReason.ERROR, status, error)

    @property
    def num_waiting(self) -> int:
        """Requests waiting to run: queued, parked over their client request's share, or waiting for a grammar."""
        return len(self.waiting) + self.shares.num_parked + self.grammars.num_held

    def _make_room_for(self, request: Request) -> bool:
        """With the waiting queue full, turn away its lowest-ranked request if `request` ranks above it.
        Under FCFS a newcomer ranks last in its service class, so there only an interactive request can displace
        anyone (a waiting background one)."""
        if self.waiting.policy == "fcfs" and request.background:
            return False
        worst = max(self.waiting, key=_RANK)
        if request.rank >= worst.rank:
            return False
        self.num_rejected += 1
        self._finish(worst, FinishReason.ERROR, 503, "the server is at capacity: displaced by higher-priority requests")
        return True

    def expire(self, now: float) -> None:
        """End every request whose deadline (time.time() seconds) has passed, freeing its blocks."""
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, request = heapq.heappop(self._deadlines)
            if request.is_live:
                self.num_timed_out += 1
                self._finish(request, FinishReason.ERROR, 408,
                             f"request timed out after {request.deadline - request.arrival_time:.3g} s")

    def abort(self, request_ids: list[str]) -> None:
        """End requests now (client gone or cancelled); their blocks return to the pool immediately. A step in
        flight that still computes them is harmless: the worker runs plans in order, so blocks reused by a later
        plan are written after it, and its sampled tokens for them are dropped when it returns."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, FinishReason.ABORT)

    def fail_step(self, step: ScheduledStep, status: int, message: str) -> None:
        """End every live request of a step the worker failed with an error output."""
        for entry in step.scheduled.values():
            if entry.request.is_live:
                self._finish(entry.request, FinishReason.ERROR, status, message)

    def abort_client(self, client: bytes, message: str) -> list[str]:
        """End every request of a frontend taken for gone (it stopped heartbeating), freeing their blocks. Each still
        gets its terminal output, a 503 carrying `message`: a frontend that is really gone never receives it (a
        ROUTER drops what it cannot route), and one that was only slow learns that its requests ended instead of
        waiting on them forever. Returns the ids."""
        request_ids = [r.request_id for r in self.requests.values() if r.client == client]
        for request_id in request_ids:
            self._finish(self.requests[request_id], FinishReason.ERROR, 503, message)
        return request_ids

    def _emit(self, request: Request, token_ids: list[int], reason: FinishReason | None = None,
              logprobs: list[TokenLogprobs] | None = None, status: int = 0, message: str = "") -> None:
        """Queue one output for the request's frontend; its first output also carries what is sent once
        (when it left the queue, and the prompt's logprobs)."""
        first = not request.has_output
        request.has_output = True
        self._pending_outputs[request.client].append(RequestOutput(
            request_id=request.request_id, new_token_ids=token_ids, finish_reason=reason,
            num_cached_tokens=max(request.num_cached_tokens, 0), error_status=status, error_message=message,
            logprobs=logprobs or [], first_scheduled_time=request.first_scheduled_time if first else 0.0,
            prompt_logprobs=request.prompt_logprobs if first else []))

    def reject(self, client: bytes, request_id: str, status: int, message: str, retry_after_s: float = 0.0,
                rejection: str = "") -> None:
        """Answer a request that is not queued with its one terminal error (`status`: 400, 404, 503; counted in
        num_rejected; `retry_after_s` and `rejection` as RequestOutput's)."""
        self.num_rejected += 1
        self._pending_outputs[client].append(
            RequestOutput(request_id=request_id, finish_reason=FinishReason.ERROR, error_status=status,
                          error_message=message,
                          retry_after_s=retry_after_s, rejection=rejection))

    def _finish(self, request: Request, reason: FinishReason, status: int = 0, message: str = "",
                new_token_ids: list[int] | None = None, logprobs: list[TokenLogprobs] | None = None) -> None:
        if request.status == RequestStatus.RUNNING:
            self._leave_running(request)
        elif not self.grammars.release(request):
            self.waiting.remove(request)
        self.grammars.done(request)  # past the gate: its grammar's pin goes
        self.shares.leave(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        self.admission.on_finished(request)
        del self.requests[request.request_id]
        self.worker_mirror.forget(request)
        self._emit(request, new_token_ids or [], reason, logprobs, status, message)

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        if request.lora_slot >= 0:
            assert self.lora is not None
            self.lora.give_back(request.lora_slot)
            request.lora_slot = -1
        unparked = self.shares.stop_running(request)
        if unparked is not None:
            self.waiting.push(unparked)

    # ---- planning -----------------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> ScheduledStep:
        """Plan one step under max_num_seqs and max_num_batched_tokens, booking its tokens."""
        budget = self.config.max_num_batched_tokens
        step = ScheduledStep(StepPlan(step_id=self._step_id, new_requests=[], cached_requests=[]))
        self._step_id += 1
        new_blocks: dict[str, list[int]] = {}
        self._free_slots_for_interactive()

        preemptions_before = self.num_preemptions
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            index += 1
            num_new = min(request.num_tokens_booked - request.num_computed_tokens, budget, self._chunk_limit())
            if num_new <= 0 or self._booked_to_the_end(request):
                continue  # its last token is already booked: it waits for a step in flight to settle
            drafts = self._drafts(request, budget) if self.speculation is not None else []
            # drafts take only free blocks: no request is preempted to make room for a guess
            added = self.kv.allocate_slots(request, 1 + len(drafts)) if drafts else None
            if added is None:
                drafts = []
                added = self._allocate_or_preempt(request, num_new)
                if added is None:
                    break  # the request itself was preempted; everything after it ranks lower still
            new_blocks[request.request_id] = added
            budget -= self._book(step, request, num_new + len(drafts), drafts)

        # A step that had to preempt admits nobody: the blocks it freed belong to the running requests.
        if self.num_preemptions == preemptions_before:
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                head = self.waiting.peek()
                if head is None:
                    break
                request = head
                if self.shares.over_share(request):
                    self.shares.park(self.waiting.pop())  # its client request holds its share: others go first
                    continue
                if request.lora_key and not self.lora.can_take(request.lora_key):  # type: ignore[union-attr]
                    break  # its adapter waits for a slot; those behind it wait too, so that it never starves
                cached = [] if request.sampling.prompt_logprobs is not None else self.kv.find_cached_prefix(request)
                num_cached = len(cached) * self.kv.block_size
                num_new = min(request.num_tokens - num_cached, budget, self._chunk_limit(len(self.waiting) > 1))
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
                if request.lora_key:
                    assert self.lora is not None  # add_request refused adapters without --enable-lora
                    request.lora_slot = self.lora.take(request.lora_key)
                self.num_admitted += 1
                bisect.insort(self.running, request, key=_RANK)
                self.shares.start_running(request)
                new_blocks[request.request_id] = added
                budget -= self._book(step, request, num_new)

        self.worker_mirror.fill_plan(step, self.kv.block_tables, new_blocks)
        if self.lora is not None:
            step.plan.lora_loads = self.lora.take_loads()
        self.admission.on_planned(step)
        return step

    def _chunk_limit(self, others_wait: bool | None = None) -> int:
        """Most tokens one request may compute this step: the long-prefill cap while other requests wait (fair
        chunked prefill), else no limit beyond the budget."""
        if others_wait is None:
            others_wait = len(self.waiting) > 0
        capped = others_wait and self.prefill_chunk_cap > 0
        return self.prefill_chunk_cap if capped else self.config.max_num_batched_tokens

    def _booked_to_the_end(self, request: Request) -> bool:
        """True when a placeholder already books the request's last token (max_tokens or max_model_len)."""
        return (len(request.output_token_ids) + request.num_output_placeholders >= request.sampling.max_tokens
                or request.num_tokens_booked >= self.max_model_len)

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """Drafts for a decoding request, as many as the budget, the chunk cap, max_tokens and max_model_len leave
        room for (scheduler/speculation_book.py proposes them)."""
        book = self.speculation
        assert book is not None
        if not book.may_speculate(request):
            return []
        limit = min(budget - 1, self._chunk_limit() - 1,
                    request.sampling.max_tokens - len(request.output_token_ids) - 1,
                    self.max_model_len - request.num_tokens - 1)
        return book.propose(request, limit)

    def _book(self, step: ScheduledStep, request: Request, num_new: int, drafts: list[int] | None = None) -> int:
        """Advance the request's computed tokens now; a chunk that reaches its end books a sampled placeholder.
        With drafts (`num_new` is 1 + their number) the one placeholder stands for the 1 to num_new tokens the
        step gains; settling rolls back what was rejected."""
        start = request.num_computed_tokens
        end = request.num_computed_tokens = start + num_new
        samples = end == request.num_tokens_booked or bool(drafts)
        if samples:
            request.num_output_placeholders += 1
        step.scheduled[request.request_id] = ScheduledRequest(request, request.epoch, start, num_new, samples,
                                                              tuple(drafts or ()))
        self.num_scheduled_tokens += num_new
        num_prompt = len(request.prompt_token_ids)
        if start < num_prompt:
            step.num_prompt_tokens += min(end, num_prompt) - start
        elif num_new == 1 and samples:
            step.num_decode_tokens += 1
        return num_new

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

    def _free_slots_for_interactive(self) -> None:
        """Running background (batch) requests give their slots to waiting interactive ones, so a running set full
        of batch work never holds an interactive request's first token back; they resume later by recompute, as
        after any preemption. Runs before the step books anything, so no victim has tokens in this step."""
        free = self.config.max_num_seqs - len(self.running)
        need = self.waiting.num_interactive - max(free, 0)
        while need > 0 and self.running and self.running[-1].background:
            self._preempt(self.running[-1])
            need -= 1

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks and queue it again; the worker forgets it, and a step in flight that samples
        for it is stale (a new epoch). It resumes by recomputing its prompt and confirmed outputs."""
        self._leave_running(request)
        self.kv.free(request, finished=False)
        request.num_computed_tokens = 0
        request.num_output_placeholders = 0
        request.epoch += 1
        request.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.worker_mirror.forget(request)
        self.waiting.push(request)

    # ---- results --------------------------------------------------------------------------------------------

    def update_from_output(self, step: ScheduledStep, result: StepResult) -> None:
        """Settle a step: commit written blocks, turn placeholders into sampled tokens, finish what stopped.
        Outputs collect in `take_outputs()`."""
        self.admission.on_settled(step)
        scheduled = step.scheduled
        failed = {failure.request_id: failure for failure in result.failed}
        for entry in scheduled.values():
            request = entry.request
            if request.is_live and request.epoch == entry.epoch and not entry.draft_token_ids \
                    and request.request_id not in failed:  # its KV may be unwritten (left out of the step)
                self.kv.commit(request, entry.start + entry.num_new)  # a speculative entry commits once settled
        for request_id, failure in failed.items():
            left_out = scheduled.get(request_id)
            if left_out is not None and left_out.request.is_live and left_out.request.epoch == left_out.epoch:
                self._finish(left_out.request, FinishReason.ERROR, failure.status, failure.message)
        for chunk in result.prompt_logprobs:
            chunk_entry = scheduled.get(chunk.request_id)
            if chunk_entry is not None and chunk_entry.request.is_live:
                collected = chunk_entry.request.prompt_logprobs
                if chunk.start <= len(collected) < chunk.start + len(chunk.entries):  # recomputed chunks add nothing
                    collected.extend(chunk.entries[len(collected) - chunk.start:])
        logprobs = result.logprobs
        gained: dict[str, list[tuple[int, TokenLogprobs | None]]] = {}  # speculative entries' tokens, in order
        for i, (request_id, token_id) in enumerate(zip(result.request_ids, result.token_ids)):
            found = scheduled.get(request_id)
            if found is None:
                continue
            request = found.request
            if not request.is_live or request.epoch != found.epoch:
                continue  # finished, aborted or preempted since this step was planned
            if found.draft_token_ids:
                gained.setdefault(request_id, []).append((token_id, logprobs[i] if logprobs else None))
                continue
            request.num_output_placeholders -= 1
            request.output_token_ids.append(token_id)
            token_lp = logprobs[i] if logprobs else None
            token_logprobs = [token_lp] if token_lp is not None else []
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                self._finish(request, reason, new_token_ids=[token_id], logprobs=token_logprobs)
            else:
                self._emit(request, [token_id], logprobs=token_logprobs)
        for request_id, tokens in gained.items():
            self._settle_drafts(scheduled[request_id], tokens)

    def _settle_drafts(self, entry: ScheduledRequest, tokens: list[tuple[int, TokenLogprobs | None]]) -> None:
        """Settle a speculative entry that gained `tokens` (its accepted drafts, then the target's token): the
        rejected drafts' slots are rolled back (computed tokens, and blocks past them given back), the written
        blocks of accepted tokens committed, and the tokens cut at a stop token or max_tokens."""
        request = entry.request
        assert self.speculation is not None  # only its drafts make a speculative entry
        self.speculation.record(request, len(entry.draft_token_ids), len(tokens) - 1)
        request.num_output_placeholders -= 1
        request.num_computed_tokens = entry.start + len(tokens)  # the last gained token is not computed yet
        new_ids: list[int] = []
        new_logprobs: list[TokenLogprobs] = []
        reason = None
        for token_id, token_lp in tokens:
            request.output_token_ids.append(token_id)
            new_ids.append(token_id)
            if token_lp is not None:
                new_logprobs.append(token_lp)
            reason = self._stop_reason(request, token_id)
            if reason is not None:
                break
        self.kv.commit(request, request.num_computed_tokens)
        if reason is not None:
            self._finish(request, reason, new_token_ids=new_ids, logprobs=new_logprobs)
        else:
            self.kv.trim(request, request.num_computed_tokens)
            self._emit(request, new_ids, logprobs=new_logprobs)

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
            num_waiting=self.num_waiting, num_running=len(self.running), num_free_blocks=pool.num_free,
            num_cached_blocks=pool.num_cached, num_total_blocks=pool.num_blocks, num_preemptions=self.num_preemptions,
            prefix_cache_queries=self.kv.prefix_queries, prefix_cache_hits=self.kv.prefix_hits, num_steps=self._step_id,
            num_rejected=self.num_rejected, num_timed_out=self.num_timed_out,
            num_blocks_in_use=pool.num_blocks - pool.num_free, num_admitted=self.num_admitted,
            num_scheduled_tokens=self.num_scheduled_tokens, **self._spec_stats(), **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        waiting = sorted({r.lora_name for r in self.waiting if r.lora_name})
        return {"lora_running": self.lora.running_names, "lora_waiting": waiting}

    def _spec_stats(self) -> dict:
        book = self.speculation
        if book is None:
            return {}
        return {"spec_num_drafts": book.num_drafts, "spec_num_draft_tokens": book.num_draft_tokens,
                "spec_num_accepted_tokens": book.num_accepted_tokens,
                "spec_accepted_per_pos": list(book.accepted_per_pos)}
