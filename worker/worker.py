"""One step of model execution: apply the plan, pack, forward, sample."""

from __future__ import annotations

import logging

import torch

from common.config import ShuttleConfig
from common.messages import PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from worker.attention import StepAttention
from worker.attention_backends import make_backend
from worker.capability import check_exactness
from worker.graph_runner import graph_runner_for
from worker.input_batch import InputBatch, StepInputs
from worker.kv_cache import KVCache
from worker.model_loader import DTYPES, architecture, load_model, probe_geometry
from worker.output_projection import chunk_output_projection
from worker.parallel import TensorParallel, local_numel
from worker.sampler import Sampler

log = logging.getLogger("shuttle.worker")


class ModelRunner:
    """Holds the model, its paged KV cache, per-request state and the sampler.

    Construction loads the model, probes its KV geometry, checks that the paged path reproduces transformers'
    eager attention on it (worker/capability.py), and only then allocates the cache.

    Under tensor parallel (worker/parallel.py) every rank builds one on its shard of the weights, runs the same
    plans and the same check (their collectives pair up), and holds its own KV heads; rank 0 samples.

    Args:
        config: the serving group's configuration.
        device: where weights and cache live (CPU is the reference path).
        parallel: this process's tensor-parallel rank (the default: no tensor parallelism).
    Raises:
        UnsupportedModelError: the model cannot be served exactly (the message says why).
    """

    def __init__(self, config: ShuttleConfig, device: torch.device = torch.device("cpu"),
                 parallel: TensorParallel = TensorParallel()):
        self.device = device
        self.parallel = parallel
        model_cfg, cache_cfg = config.model, config.cache
        self.dtype = DTYPES[model_cfg.dtype]
        self.block_size = cache_cfg.block_size
        self.model = load_model(model_cfg.model_dir, model_cfg.dtype, device, **parallel.load_kwargs())
        self.architecture = architecture(self.model)
        chunk_output_projection(self.model, device, parallel.enabled)
        self.geometry = probe_geometry(self.model)  # under tensor parallel: this rank's KV heads
        parallel.check_model(self.model, self.geometry)
        if config.worker.worker_threads > 0:
            torch.set_num_threads(config.worker.worker_threads)
        self.backend = make_backend(config.worker.attention_backend, self.block_size, device)
        if self.backend.name == "cpu":
            from worker import decode_kernel
            decode_kernel.warm_up(torch.get_num_threads())
        self.check_difference = check_exactness(self, model_cfg.max_model_len)
        log.info("%s: paged attention (%s backend) matches eager attention within %.2g nats", self.architecture,
                 self.backend.name, self.check_difference)
        self.kv_cache = KVCache.allocate(self.geometry, self.block_size, self.dtype, device, cache_cfg.num_kv_blocks,
                                         cache_cfg.kv_cache_memory)
        self.batch = InputBatch(self.block_size, self.kv_cache.null_block,
                                -(-model_cfg.max_model_len // self.block_size))
        self.sampler = Sampler(model_cfg.eos_token_ids)
        self.graphs = graph_runner_for(self, config)  # decode-only steps from CUDA graphs (None: all eager)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds."""
        return sum(local_numel(p) * p.element_size() for p in self.model.parameters())

    def forward(self, inputs: StepInputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                logits_rows: torch.Tensor) -> torch.Tensor:
        """The model over one step's packed tokens; returns logits [len(logits_rows), vocab] at those rows."""
        self.backend.begin_step()
        output = self.model(
            input_ids=inputs.input_ids.unsqueeze(0).to(self.device),
            position_ids=inputs.positions.unsqueeze(0).to(self.device),
            logits_to_keep=logits_rows.to(self.device),
            use_cache=False,
            paged_attention=StepAttention(inputs.attention, kv_caches, self.backend),
        )
        return output.logits[0]

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Returns the tokens sampled by requests whose chunk reached their last known token.

        A step that raises drops the state of its requests (the scheduler fails them), so later plans that still
        name them skip them instead of failing too.
        """
        scheduled = self.batch.apply(plan)
        if not scheduled:
            return StepResult(plan.step_id, [], [])
        try:
            return self._run(plan.step_id, self.batch.pack(scheduled))
        except Exception:
            for state, _ in scheduled:
                self.batch.drop(state.request_id)
            raise

    def _run(self, step_id: int, inputs: StepInputs) -> StepResult:
        if self.graphs is not None and self.graphs.can_run(inputs):
            logits = self.graphs.run(inputs)  # a decode-only step, replayed: [S, vocab]
        else:
            logits = self.forward(inputs, self.kv_cache.layers, inputs.logits_rows)  # [S + prompt rows, vocab]
        requests = inputs.sampled_requests
        prompt_logprobs = self._prompt_logprobs(logits[len(requests):], inputs.prompt_rows) \
            if self.parallel.is_driver else []
        if not requests:
            return StepResult(step_id, [], [], prompt_logprobs=prompt_logprobs)
        if not self.parallel.is_driver:  # rank 0 samples; this rank only needs the tokens to feed them forward
            for state, token in zip(requests, self.parallel.share_tokens(None, len(requests))):
                state.token_ids.append(token)
            return StepResult(step_id, [], [])
        sampled = self.sampler(logits[:len(requests)], [r.sampling for r in requests], [r.token_ids for r in requests])
        self.parallel.share_tokens(sampled.token_ids, len(requests))
        for state, token in zip(requests, sampled.token_ids):
            state.token_ids.append(token)
            state.sampling.record(token)
        return StepResult(step_id, [r.request_id for r in requests], sampled.token_ids, sampled.logprobs or [],
                          prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, prompt_rows) -> list[PromptLogprobs]:
        """Raw log-softmax at prompt positions: the logprob of each next prompt token and the top k."""
        out, offset = [], 0
        for state, first, rows, targets in prompt_rows:
            log_softmax = logits[offset:offset + len(rows)].float().log_softmax(dim=-1)  # [rows, vocab]
            offset += len(rows)
            k = state.sampling.params.prompt_logprobs
            top = log_softmax.topk(k, dim=-1) if k else None
            chosen = log_softmax[torch.arange(len(rows)), torch.tensor(targets)].tolist()
            out.append(PromptLogprobs(state.request_id, [
                TokenLogprobs(chosen[i], top.indices[i].tolist() if top else [], top.values[i].tolist() if top else [])
                for i in range(len(rows))], first))
        return out
