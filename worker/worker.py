"""One step of model execution: apply the plan, pack, forward, sample."""

from __future__ import annotations

import torch

from common.config import ShuttleConfig
from common.messages import PromptLogprobs, StepPlan, StepResult, TokenLogprobs
from worker.input_batch import InputBatch
from worker.kv_cache import KVCache
from worker.model_loader import DTYPES, kv_geometry, load_model
from worker.sampler import Sampler


class ModelRunner:
    """Holds the model, its paged KV cache, per-request state and the sampler.

    Args:
        config: the serving group's configuration.
        device: where weights and cache live (CPU is the reference path).
    """

    def __init__(self, config: ShuttleConfig, device: torch.device = torch.device("cpu")):
        self.device = device
        model_cfg, cache_cfg = config.model, config.cache
        self.model = load_model(model_cfg.model_dir, model_cfg.dtype, device)
        num_layers, num_kv_heads, head_dim = kv_geometry(model_cfg.model_dir)
        self.kv_cache = KVCache.allocate(num_layers, num_kv_heads, head_dim, cache_cfg.block_size,
                                         DTYPES[model_cfg.dtype], device, cache_cfg.num_kv_blocks,
                                         cache_cfg.kv_cache_memory)
        self.batch = InputBatch(cache_cfg.block_size, self.kv_cache.layers)
        self.sampler = Sampler(model_cfg.eos_token_ids)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step. Returns the tokens sampled by requests whose chunk reached their last known token."""
        scheduled = self.batch.apply(plan)
        if not scheduled:
            return StepResult(plan.step_id, [], [])
        packed = self.batch.pack(scheduled)
        output = self.model(
            input_ids=packed.input_ids.unsqueeze(0).to(self.device),
            position_ids=packed.positions.unsqueeze(0).to(self.device),
            logits_to_keep=packed.logits_rows.to(self.device),
            use_cache=False,
            paged_attention=packed.attention,
        )
        logits = output.logits[0]  # [S + prompt-logprob rows, vocab]
        requests = packed.sampled_requests
        prompt_logprobs = self._prompt_logprobs(logits[len(requests):], packed.prompt_rows)
        if not requests:
            return StepResult(plan.step_id, [], [], prompt_logprobs=prompt_logprobs)
        sampled = self.sampler(logits[:len(requests)], [r.sampling for r in requests], [r.token_ids for r in requests])
        for state, token in zip(requests, sampled.token_ids):
            state.token_ids.append(token)
            state.sampling.record(token)
        return StepResult(plan.step_id, [r.request_id for r in requests], sampled.token_ids, sampled.logprobs or [],
                          prompt_logprobs)

    @staticmethod
    def _prompt_logprobs(logits: torch.Tensor, prompt_rows) -> list[PromptLogprobs]:
        """Raw log-softmax at prompt positions: the logprob of each next prompt token and the top k."""
        out, offset = [], 0
        for state, rows, targets in prompt_rows:
            log_softmax = logits[offset:offset + len(rows)].float().log_softmax(dim=-1)  # [rows, vocab]
            offset += len(rows)
            k = state.sampling.params.prompt_logprobs
            top = log_softmax.topk(k, dim=-1) if k else None
            chosen = log_softmax[torch.arange(len(rows)), torch.tensor(targets)].tolist()
            out.append(PromptLogprobs(state.request_id, [
                TokenLogprobs(chosen[i], top.indices[i].tolist() if top else [], top.values[i].tolist() if top else [])
                for i in range(len(rows))]))
        return out
