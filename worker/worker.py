"""One step of model execution: apply the plan, pack, forward, sample."""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from shuttle.common.capacity import blocks_per_request, kv_blocks_for_memory, kv_cache_bytes
from shuttle.common.config import ShuttleConfig
from shuttle.common.cpu_threads import WORKER_THREADS_ENV
from shuttle.common.devices import cpu_bf16_flags, resolve_dtype
from shuttle.common.messages import PromptLogprobs, RequestFailure, StepPlan, StepResult, TokenLogprobs
from shuttle.common.speculative import DRAFT_MODEL
from shuttle.worker.attention import StepAttention
from shuttle.worker.attention_backends import make_backend
from shuttle.worker.capability import check_exactness
from shuttle.worker.cpu_compiled_decode import CompiledCpuDecode, compiled_decode_for
from shuttle.worker.cpu_linears import prepare_cpu_linears
from shuttle.worker.draft_model import DraftModel
from shuttle.worker.flex_attention import compiled_head_dim_problem, max_kv_blocks_for, token_buckets
from shuttle.worker.grammar import GrammarCompiler, GrammarError, GrammarMasks
from shuttle.worker.graph_runner import DecodeGraphRunner, graph_runner_for, graphs_off_reason
from shuttle.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from shuttle.worker.kv_cache import KVCache
from shuttle.worker.kv_sizing import (
    CUDA_GRAPH_ALLOWANCE,
    KVPlan,
    plan_kv_blocks,
    profile_peak,
    profile_plan,
    snapshot,
)
from shuttle.worker.lora import LoRAAdapters
from shuttle.worker.model_loader import DTYPES, UnsupportedModelError, architecture, load_model, probe_geometry
from shuttle.worker.parallel import TensorParallel, local_device, local_numel
from shuttle.worker.quantization import quantize_model
from shuttle.worker.sampler import LOGPROB_FLOOR, Sampler, token_ranks
from shuttle.worker.speculation import verify_drafts
from shuttle.worker.staging import StepStaging

log = logging.getLogger("shuttle.worker")


def set_worker_threads(worker_threads: int) -> None:
    """torch's intra-op threads: the launcher's choice ($SHUTTLE_WORKER_THREADS, common/cpu_threads.py), else
    --worker-threads, else left as the process has them (an in-process engine: its caller's); one inter-op thread
    when launched. Before the first torch op, so that no pool starts at another size."""
    launched = int(os.environ.get(WORKER_THREADS_ENV) or 0)
    threads = launched or worker_threads
    if threads > 0:
        torch.set_num_threads(threads)
    if launched:
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # the inter-op pool has started already: it keeps its size
            pass


class ModelRunner:
    """Holds the model, its paged KV cache, per-request state and the sampler.

    Construction runs the start-up phases in order: claim the device; load the model, probe its KV geometry and
    check that the paged path reproduces transformers' eager attention on it (worker/capability.py); only then size
    and allocate the cache; prepare the batch, sampler and grammars; compile (a compiled backend's prefill shapes);
    capture (CUDA graphs for decode steps; on the CPU, the compiled decode forward). The cache gets, on CUDA
    (unless --num-kv-blocks), as many blocks as --gpu-memory-utilization leaves after one profiling step at the
    largest step shape (worker/kv_sizing.py),
    elsewhere --kv-cache-memory or --num-kv-blocks.

    Under tensor parallel (worker/parallel.py) every rank builds one on its shard of the weights, runs the same
    plans and the same check (their collectives pair up), and holds its own KV heads; rank 0 samples.

    Args:
        config: the serving group's configuration; `auto` in its device, dtype and attention backend is resolved here
            when the launcher has not (common/devices.py).
        device: where weights and cache live (None: config.worker.device, for this rank of serving group 0; CPU is
            the reference path; a bare "cuda" means the current CUDA device).
        parallel: this process's tensor-parallel rank (the default: no tensor parallelism).
    Raises:
        UnsupportedModelError: the model cannot be served exactly (the message says why).
        KVSizingError: on CUDA, the memory budget cannot hold one max_model_len request.
        DeviceError: the configured CUDA device is not there.
    """

    def __init__(self, config: ShuttleConfig, device: torch.device | None = None,
                 parallel: TensorParallel = TensorParallel()):
        self.device = self._claim_device(config, device, parallel)
        self.parallel = parallel
        baseline = snapshot(self.device) if self.device.type == "cuda" else None  # before the weights (kv_sizing.py)
        self._load(config)
        self._allocate_kv_cache(config, baseline)
        self._prepare_steps(config)
        self.warm_up_seconds = 0.0
        if self.backend.compiled:
            self.warm_up_prefill_shapes(config.scheduler.max_num_batched_tokens, config.model.max_model_len)
        # decode-only steps from CUDA graphs, or on the CPU from the compiled forward (None: all eager)
        self.graphs: DecodeGraphRunner | CompiledCpuDecode | None = \
            graph_runner_for(self, config) or compiled_decode_for(self, config)

    # ---- the phases of start-up, in order ----------------------------------------------------------------

    @staticmethod
    def _claim_device(config: ShuttleConfig, device: torch.device | None, parallel: TensorParallel) -> torch.device:
        """This rank's device, made current (CUDA), with the worker's CPU threads set."""
        if device is None:
            device = local_device(config.worker.device, 0, parallel.rank, parallel.size)
        if device.type == "cuda" and device.index is None:  # torch 2.11's set_device refuses a bare "cuda"
            device = torch.device("cuda", torch.cuda.current_device())
        set_worker_threads(config.worker.worker_threads)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return device

    def _load(self, config: ShuttleConfig) -> None:
        """Load the weights (quantized, chunked or widened where the device needs it), probe the KV geometry, choose
        the attention backend and check that the paged path reproduces eager attention on this model."""
        model_cfg, device, parallel = config.model, self.device, self.parallel
        self.dtype_name = resolve_dtype(model_cfg.dtype, device.type)
        self.dtype = DTYPES[self.dtype_name]
        kv_name = config.cache.kv_cache_dtype  # --kv-cache-dtype: auto is the model's dtype
        self.kv_dtype = self.dtype if kv_name == "auto" else DTYPES[kv_name]
        self.block_size = config.cache.block_size
        self.staging = StepStaging(device)
        self.model = load_model(model_cfg.model_dir, self.dtype_name, device, model_cfg.hf_overrides,
                                **parallel.load_kwargs(), trust_remote_code=model_cfg.trust_remote_code)
        bf16_units = bool(cpu_bf16_flags())  # what the int8 and bf16 linears' matmul dtype follows
        self.quantized_linears = quantize_model(self.model, config.worker.quantization, device, parallel.enabled,
                                                bf16_units)
        self.architecture = architecture(self.model)
        self.cpu_linears = prepare_cpu_linears(self.model, device, parallel.enabled, bf16_units,
                                               torch.get_num_threads())
        lora = config.lora  # --enable-lora: every target linear wrapped once, the slots empty (worker/lora.py)
        self.lora = LoRAAdapters(self.model, lora.max_loras, lora.max_lora_rank, parallel.rank, parallel.size) \
            if lora.enable_lora else None
        if self.lora is not None:
            self.lora.check([module.path for module in lora.lora_modules])
        self.geometry = probe_geometry(self.model)  # under tensor parallel: this rank's KV heads
        parallel.check_model(self.model, self.geometry)
        self.backend = make_backend(config.worker.attention_backend, self.block_size, device,  # auto as devices.py
                                    blocks_per_request(model_cfg.max_model_len, self.block_size))
        problem = compiled_head_dim_problem(self.geometry) if self.backend.compiled else None
        if problem:
            raise UnsupportedModelError(f"{self.architecture}: {problem}")
        if self.backend.name == "cpu":
            from shuttle.worker import decode_kernel
            decode_kernel.warm_up(torch.get_num_threads(), (self.kv_dtype,))
        self.check_difference = check_exactness(self, model_cfg.max_model_len)
        spec = config.scheduler.speculative_config
        self.drafter: DraftModel | None = None  # --speculative-config's draft_model (worker/draft_model.py)
        if spec is not None and spec.method == DRAFT_MODEL and spec.model:
            self.drafter = DraftModel(spec.model, self.dtype_name, device,
                                      self.model.get_output_embeddings().weight.shape[0], model_cfg.trust_remote_code)
        log.info("%s: paged attention (%s backend) matches eager attention within %.2g nats", self.architecture,
                 self.backend.name, self.check_difference)

    def _allocate_kv_cache(self, config: ShuttleConfig, baseline) -> None:
        """Size the KV cache (CUDA: from a profiled step, unless --num-kv-blocks) and allocate it."""
        cache_cfg = config.cache
        self.kv_plan: KVPlan | None = None  # how --gpu-memory-utilization sized the cache (CUDA only)
        self.activation_peak_bytes = 0  # the profiling step's torch peak (CUDA only; 0: not profiled)
        num_blocks = cache_cfg.num_kv_blocks
        if baseline is not None and num_blocks is None:
            self.kv_plan = self._size_kv_cache(config, baseline)
            num_blocks = self.kv_plan.num_blocks
        if num_blocks is None and self.drafter is not None:  # the budget holds both models' KV of each block
            num_blocks = kv_blocks_for_memory(cache_cfg.kv_cache_memory, self.kv_bytes_per_token, self.block_size)
        self.kv_cache = KVCache.allocate(self.geometry, self.block_size, self.kv_dtype, self.device, num_blocks,
                                         cache_cfg.kv_cache_memory)
        if self.drafter is not None:
            self.drafter.allocate(self.kv_cache.num_blocks, self.block_size, self.kv_dtype, self.device)
        # how the cache was sized, for the start-up line
        if self.kv_plan is not None:
            self.kv_budget = (f"--gpu-memory-utilization {cache_cfg.gpu_memory_utilization} of "
                              f"{self.kv_plan.total / 2**30:.1f} GiB" + (", capped by flex's 32-bit offsets"
                                                                          if self.kv_plan.capped else ""))
        elif cache_cfg.num_kv_blocks is not None:
            self.kv_budget = "--num-kv-blocks"
        else:
            self.kv_budget = f"--kv-cache-memory {cache_cfg.kv_cache_memory / 2**20:.0f} MiB"

    def _prepare_steps(self, config: ShuttleConfig) -> None:
        """What every step uses beside the model: the persistent batch, the sampler and (rank 0) the grammars."""
        model_cfg = config.model
        self.batch = InputBatch(self.block_size, self.kv_cache.null_block,
                                -(-model_cfg.max_model_len // self.block_size))
        self.sampler = Sampler(model_cfg.eos_token_ids, seed=model_cfg.seed)  # --seed: for requests without one
        # Grammars live where tokens are sampled: rank 0 (worker/grammar.py)
        vocab = self.model.config.get_text_config().vocab_size
        self.grammars = GrammarCompiler(model_cfg.tokenizer_dir or model_cfg.model_dir, vocab,
                                        model_cfg.eos_token_ids, model_cfg.trust_remote_code) \
            if self.parallel.is_driver else None
        self._masks: GrammarMasks | None = None  # built on the first constrained step

    # ---- serving ------------------------------------------------------------------------------------------

    @property
    def dtype_label(self) -> str:
        """The model's dtype for the start-up line, with the KV cache's when --kv-cache-dtype makes it another."""
        if self.kv_dtype == self.dtype:
            return self.dtype_name
        return f"{self.dtype_name} (KV cache {str(self.kv_dtype).removeprefix('torch.')})"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (a draft model's included, and reordered copies of tied heads)."""
        draft = self.drafter.weight_bytes if self.drafter is not None else 0
        parameters = sum(local_numel(p) * p.element_size() for p in self.model.parameters())
        return parameters + self.cpu_linears.copied_bytes + draft

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes one token takes in this rank's caches: the target's, plus the draft model's."""
        draft = self.drafter.bytes_per_token(self.kv_dtype) if self.drafter is not None else 0
        return KVCache.bytes_per_token_of(self.geometry, self.kv_dtype) + draft

    def _size_kv_cache(self, config: ShuttleConfig, baseline) -> KVPlan:
        """KV blocks for --gpu-memory-utilization: profile the largest step over a scratch cache, then the
        arithmetic of worker/kv_sizing.py (the flex cap under flex, a CUDA-graph allowance when graphs follow)."""
        bs, max_model_len = self.block_size, config.model.max_model_len
        vocab = self.model.get_output_embeddings().weight.shape[0]
        plan, blocks = profile_plan(config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs,
                                    max_model_len, bs, vocab)
        bytes_per_token = self.kv_bytes_per_token
        scratch = KVCache.allocate(self.geometry, bs, self.kv_dtype, self.device, blocks, 0)
        figures = profile_peak(functools.partial(self.profile_step, plan, scratch, max_model_len), self.device,
                               baseline,
                               kv_cache_bytes(blocks, bs, bytes_per_token))
        del scratch
        self.activation_peak_bytes = figures.activation_peak
        graphs = graphs_off_reason(self.device, config, self.backend.name, self.parallel.enabled) is None
        cap = max_kv_blocks_for(self.geometry, bs) if self.backend.name == "flex" else None
        kv_plan = plan_kv_blocks(figures, config.cache.gpu_memory_utilization, bytes_per_token, bs, max_model_len,
                                 CUDA_GRAPH_ALLOWANCE if graphs else 0, cap)
        log.info("KV sizing: %.2f GiB requested; weights %.2f GiB, activation peak %.2f GiB, non-torch %.2f GiB, "
                 "CUDA graphs %.2f GiB; %d blocks (%.2f GiB)", kv_plan.requested / 2**30, figures.weights / 2**30,
                 figures.activation_peak / 2**30, figures.non_torch_increase / 2**30,
                 (CUDA_GRAPH_ALLOWANCE if graphs else 0) / 2**30, kv_plan.num_blocks, kv_plan.kv_bytes / 2**30)
        return kv_plan

    @torch.inference_mode()
    def profile_step(self, plan: StepPlan, cache: KVCache, max_model_len: int) -> None:
        """Run `plan` (kv_sizing.profile_plan's new requests) as one step over `cache`, sampling every request with
        a sampler of its own (the worker's random state is left alone); nothing of it stays."""
        batch = InputBatch(self.block_size, cache.null_block, blocks_per_request(max_model_len, self.block_size),
                           initial_rows=max(len(plan.new_requests), 1))
        inputs = batch.pack(batch.apply(plan))
        logits = self.forward(inputs, cache.layers, inputs.logits_rows)
        requests = inputs.sampled_requests
        if requests and self.parallel.is_driver:
            Sampler(())(logits[:len(requests)], [r.sampling for r in requests], [r.token_ids for r in requests])

    def warm_up_prefill_shapes(self, max_num_batched_tokens: int, max_model_len: int) -> None:
        """Compile a compiled attention backend (flex on CUDA) for every prefill shape before serving: one
        prefill-only step per packed-token bucket up to max_num_batched_tokens, over the real cache (its blocks hold
        junk until requests write them, and only written blocks become prefix-cache hits). The decode shapes are
        compiled by graph capture, which follows. Without this, each new bucket compiled (seconds of inductor)
        while the requests of that step waited: the first GPU bench's TTFT p50 was 5 s for that alone.

        A bucket whose step would need more blocks than the cache has is skipped: no step of that size fits."""
        began = time.perf_counter()
        vocab = self.model.get_output_embeddings().weight.shape[0]
        done = []
        for bucket in token_buckets(max_num_batched_tokens):
            tokens = min(bucket, max_num_batched_tokens)  # as few sequences as max_model_len allows
            plan, blocks = profile_plan(tokens, -(-tokens // max_model_len), max_model_len, self.block_size, vocab)
            if blocks <= self.kv_cache.num_blocks and plan.new_requests:
                self.profile_step(plan, self.kv_cache, max_model_len)
                done.append(bucket)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warm_up_seconds = time.perf_counter() - began
        log.info("compiled the %s backend for %d prefill token buckets (%s) in %.1f s", self.backend.name, len(done),
                 ", ".join(map(str, done)), self.warm_up_seconds)

    def forward(self, inputs: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_rows: torch.Tensor, model: torch.nn.Module | None = None) -> torch.Tensor:
        """The model (or `model`: the draft model, worker/draft_model.py) over one step's packed tokens; returns
        logits [len(logits_rows), vocab] at those rows.

        The inputs reach the device through self.staging (on CUDA one non-blocking copy of a pinned buffer; on the
        CPU the tensors themselves)."""
        self.backend.begin_step()
        step = self.staging(inputs, logits_rows)
        output = (model or self.model)(
            input_ids=step.input_ids.unsqueeze(0),
            position_ids=step.positions.unsqueeze(0),
            logits_to_keep=step.logits_rows,
            use_cache=False,
            paged_attention=StepAttention(step.attention, kv_caches, self.backend),
        )
        return output.logits[0]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Returns the tokens sampled by requests whose chunk reached their last known token.

        A step that raises drops the state of its requests (the scheduler fails them), so later plans that still
        name them skip them instead of failing too.
        """
        if plan.lora_loads:
            assert self.lora is not None  # a scheduler without --enable-lora plans no load
            for load in plan.lora_loads:
                try:
                    self.lora.load(load.slot, load.name, load.path)
                except Exception as exc:  # its slot is marked broken: only the requests through it fail, below
                    log.error("LoRA adapter %s could not be loaded into slot %d: %s", load.name, load.slot, exc)
        scheduled = self.batch.apply(plan)
        failed = self._leave_out_broken_adapters(scheduled)
        if not scheduled:
            return StepResult(step_id=plan.step_id, request_ids=[], token_ids=[], failed=failed)
        try:
            if self.batch.num_constrained and self.grammars is not None:
                self._attach_grammars(plan, self.grammars)
            packed = None
            if self.drafter is not None:  # the draft model writes its KV for the step's rows and fills draft slots
                packed = self.drafter.propose(self.forward, self.batch, scheduled)
            result = self._run(plan.step_id, packed or self.batch.pack(scheduled))
        except Exception:
            for state, _ in scheduled:
                self.batch.drop(state.request_id)
            raise
        result.failed = failed + result.failed
        return result

    def _leave_out_broken_adapters(self, scheduled: list[tuple[CachedRequestState, int]]) -> list[RequestFailure]:
        """Take the requests whose adapter slot is broken (its load failed) out of `scheduled` (in place) and drop
        their state: each fails alone, the rest of the step runs."""
        if self.lora is None or not self.lora.broken:
            return []
        broken = self.lora.broken
        failed = [RequestFailure(state.request_id, broken[state.lora_slot]) for state, _ in scheduled
                  if state.lora_slot in broken]
        if failed:
            scheduled[:] = [(state, n) for state, n in scheduled if state.lora_slot not in broken]
            for failure in failed:
                self.batch.drop(failure.request_id)
        return failed

    def _run(self, step_id: int, inputs: StepInputs) -> StepResult:
        if self.lora is not None:
            self.lora.begin_step(inputs.token_slots)
        if self.graphs is not None and self.graphs.can_run(inputs):
            logits = self.graphs.run(inputs)  # a decode-only step, replayed or compiled: [S, vocab]
        else:
            logits = self.forward(inputs, self.kv_cache.layers, inputs.logits_rows)  # [S + prompt rows, vocab]
        requests = inputs.sampled_requests
        num_spec_rows = sum(len(s.draft_token_ids) + 1 for s in inputs.spec_requests)
        prompt_logprobs = self._prompt_logprobs(logits[len(requests) + num_spec_rows:], inputs.prompt_rows) \
            if self.parallel.is_driver else []
        if inputs.spec_requests:  # (tensor parallel refuses speculation at start-up: only a driver gets here)
            return self._verify(step_id, logits, inputs, prompt_logprobs)
        if not requests:
            return StepResult(step_id=step_id, request_ids=[], token_ids=[], prompt_logprobs=prompt_logprobs)
        if not self.parallel.is_driver:  # rank 0 samples; this rank only needs the tokens to feed them forward
            for state, token in zip(requests, self.parallel.share_tokens(None, len(requests))):
                state.token_ids.append(token)
            return StepResult(step_id=step_id, request_ids=[], token_ids=[])
        if self.batch.num_constrained:
            self._mask_by_grammar(logits[:len(requests)], requests)
        sampled = self.sampler(logits[:len(requests)], [r.sampling for r in requests], [r.token_ids for r in requests])
        self.parallel.share_tokens(sampled.token_ids, len(requests))
        failed: list[RequestFailure] = []
        for row, (state, token) in enumerate(zip(requests, sampled.token_ids)):
            state.token_ids.append(token)
            self._record(state, token, failed, row in sampled.broken_rows)
        result = StepResult(step_id=step_id, request_ids=[r.request_id for r in requests],
                            token_ids=sampled.token_ids, logprobs=sampled.logprobs or [],
                            prompt_logprobs=prompt_logprobs, failed=failed)
        return _without_failed(result) if failed else result

    def _verify(self, step_id: int, logits: torch.Tensor, inputs: StepInputs,
                prompt_logprobs: list[PromptLogprobs]) -> StepResult:
        """A step with drafts: sample the plain rows, verify the drafts (worker/speculation.py), feed every gained
        token forward and give back the blocks of rejected drafts. A request that gained n tokens is named n times
        in the result, in order."""
        requests = inputs.sampled_requests
        request_ids: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        failed: list[RequestFailure] = []
        if requests:
            if self.batch.num_constrained:
                self._mask_by_grammar(logits[:len(requests)], requests)
            sampled = self.sampler(logits[:len(requests)], [r.sampling for r in requests],
                                   [r.token_ids for r in requests])
            for row, (state, token) in enumerate(zip(requests, sampled.token_ids)):
                state.token_ids.append(token)
                self._record(state, token, failed, row in sampled.broken_rows)
            request_ids += [r.request_id for r in requests]
            token_ids += sampled.token_ids
            logprobs += sampled.logprobs or [None] * len(requests)
        num_spec_rows = sum(len(s.draft_token_ids) + 1 for s in inputs.spec_requests)
        verified = verify_drafts(self.sampler, logits[len(requests):len(requests) + num_spec_rows],
                                 inputs.spec_requests)
        for state, (gained, gained_logprobs, broken) in zip(inputs.spec_requests, verified):
            start = len(state.token_ids) - 1  # the step computed from the last known token
            for token in gained:  # (a constrained request drafts nothing: its grammar cannot refuse these)
                state.token_ids.append(token)
                state.sampling.record(token)
            if broken:
                failed.append(_non_finite_failure(state, len(gained)))
            self.batch.trim_blocks(state, start + len(gained))
            state.draft_token_ids = []
            request_ids += [state.request_id] * len(gained)
            token_ids += gained
            logprobs += gained_logprobs
        result = StepResult(step_id=step_id, request_ids=request_ids, token_ids=token_ids,
                            logprobs=logprobs if any(lp is not None for lp in logprobs) else [],
                            prompt_logprobs=prompt_logprobs, failed=failed)
        return _without_failed(result) if failed else result

    @staticmethod
    def _record(state: CachedRequestState, token: int, failed: list[RequestFailure], broken: bool) -> None:
        """Advance `state`'s sampling (penalty counts, grammar) by its sampled `token`. A request whose logits were
        not finite (`broken`: NaN or +inf, the model or its adapter overflowed) is added to `failed` (a 500 for it
        alone: no token or logprob of it means anything). A constrained request whose grammar admitted no token at
        all (its mask left every logit at -inf: a constraint that matches no text, or nothing past what it produced)
        cannot go on either: a 400 for it alone. Either way its state stays until the scheduler's next plan names it
        finished, as an aborted request's does: every tensor-parallel rank runs the same requests in every step, only
        this one (the driver) holds grammars, and an overlapped plan may already feed `token` (a valid id) forward."""
        if broken:
            failed.append(_non_finite_failure(state, 1))
            return
        try:
            state.sampling.record(token)
        except GrammarError:
            position = len(state.token_ids) - 1 - state.sampling.prompt_len
            failed.append(RequestFailure(state.request_id, f"the structured output constraint admits no token at "
                                         f"output position {position}: it matches no text that way", status=400))

    def _attach_grammars(self, plan: StepPlan, grammars: GrammarCompiler) -> None:
        """A matcher for each new constrained request, past the outputs it already has (after a preemption)."""
        for new in plan.new_requests:
            if new.sampling.structured is not None:
                state = self.batch.requests[new.request_id]
                state.sampling.grammar = grammars.matcher(new.sampling.structured,
                                                          state.token_ids[state.sampling.prompt_len:])

    def _mask_by_grammar(self, logits: torch.Tensor, requests) -> None:
        """Mask, in place, the sampling rows (logits [S, vocab]) of constrained requests whose grammar applies
        already (not while a reasoning model still thinks: GrammarState.active)."""
        rows = [i for i, r in enumerate(requests) if r.sampling.grammar is not None and r.sampling.grammar.active]
        if rows:
            if self._masks is None:
                assert self.grammars is not None  # only its matchers give a request a grammar
                self._masks = GrammarMasks(self.grammars.vocab_size, logits.device)
            self._masks.apply(logits, rows, [requests[i].sampling.grammar for i in rows])

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, prompt_rows) -> list[PromptLogprobs]:
        """Raw log-softmax at prompt positions: the logprob of each next prompt token, its rank, and the top k."""
        out, offset = [], 0
        for state, first, rows, targets in prompt_rows:
            log_softmax = logits[offset:offset + len(rows)].float().log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR)
            offset += len(rows)
            k = state.sampling.params.prompt_logprobs
            top = log_softmax.topk(k, dim=-1) if k else None
            rows_index = torch.arange(len(rows), device=logits.device)
            chosen = log_softmax[rows_index, torch.tensor(targets, device=logits.device)]
            ranks = token_ranks(log_softmax, chosen).tolist()
            values = chosen.tolist()
            out.append(PromptLogprobs(request_id=state.request_id, entries=[
                TokenLogprobs(logprob=values[i], top_token_ids=top.indices[i].tolist() if top else [],
                              top_logprobs=top.values[i].tolist() if top else [], rank=ranks[i])
                for i in range(len(rows))], start=first))
        return out


def _non_finite_failure(state: CachedRequestState, gained: int) -> RequestFailure:
    """The 500 of a request whose logits held NaN or +inf, at the first of the `gained` output positions just
    appended to `state`."""
    position = len(state.token_ids) - gained - state.sampling.prompt_len
    return RequestFailure(state.request_id, f"the model's logits at output position {position} are not finite (NaN "
                          "or +inf: the model or its adapter overflowed in this dtype); no token can be sampled",
                          status=500)


def _without_failed(result: StepResult) -> StepResult:
    """`result` without the tokens of its failed requests (they end with their error instead)."""
    gone = {failure.request_id for failure in result.failed}
    keep = [i for i, request_id in enumerate(result.request_ids) if request_id not in gone]
    result.request_ids = [result.request_ids[i] for i in keep]
    result.token_ids = [result.token_ids[i] for i in keep]
    if result.logprobs:
        result.logprobs = [result.logprobs[i] for i in keep]
    result.prompt_logprobs = [chunk for chunk in result.prompt_logprobs if chunk.request_id not in gone]
    return result
