"""Scheduler and model runner in one process (no sockets), checked token for token against transformers'
generate under chunked prefill, preemption, and prefix caching on and off."""

import random
import time

import pytest

from common.config import CacheConfig, IpcConfig, ModelConfig, SchedulerConfig, ShuttleConfig
from common.messages import Submit
from common.sampling import SamplingParams
from scheduler.kv_cache import KVCacheManager
from scheduler.scheduler import Scheduler
from tests.conftest import hf_greedy
from tests.server import MODEL_DIR
from worker.worker import ModelRunner


def run_to_completion(prompts, max_tokens, num_blocks, max_batched, prefix_caching=True, block_size=16):
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(block_size, num_blocks, enable_prefix_caching=prefix_caching),
                           scheduler=SchedulerConfig(max_num_batched_tokens=max_batched))
    runner = ModelRunner(config)
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, block_size, prefix_caching),
                          model.max_model_len, model.eos_token_ids)
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        scheduler.add_request(b"c", Submit(str(i), prompt, SamplingParams(max_tokens=m, temperature=0.0), time.time()))
    outputs = {str(i): [] for i in range(len(prompts))}
    cached = {}
    while scheduler.has_work:
        step = scheduler.schedule()
        scheduler.update_from_output(step, runner.execute(step.plan))
        scheduler.kv.pool.check_invariants()
        for out in scheduler.take_outputs().get(b"c", []):
            outputs[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens
    assert scheduler.kv.pool.num_free == num_blocks
    return [outputs[str(i)] for i in range(len(prompts))], scheduler, cached


@pytest.mark.parametrize("num_blocks, max_batched, prefix_caching", [
    (400, 2048, True), (400, 7, True), (48, 2048, True), (40, 13, False)])
def test_matches_transformers(num_blocks, max_batched, prefix_caching):
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 200))] for _ in range(12)]
    max_tokens = [rng.randrange(20, 120) for _ in prompts]
    outputs, scheduler, _ = run_to_completion(prompts, max_tokens, num_blocks, max_batched, prefix_caching)
    for prompt, m, got in zip(prompts, max_tokens, outputs):
        assert got == hf_greedy(prompt, m)
    if num_blocks < 50:
        assert scheduler.num_preemptions > 0
    if prefix_caching:
        assert scheduler.kv.prefix_hits > 0


def test_prompt_logprobs_across_prefill_chunks_and_preemption():
    import torch

    from tests.conftest import hf_model

    rng = random.Random(5)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (60, 45, 90)]
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(16, 14), scheduler=SchedulerConfig(max_num_batched_tokens=7))
    runner = ModelRunner(config)
    scheduler = Scheduler(config.scheduler, KVCacheManager(14, 16), model.max_model_len, model.eos_token_ids)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        scheduler.add_request(b"c", Submit(str(i), prompt, params, time.time() + i))
    got = {}
    while scheduler.has_work:
        step = scheduler.schedule()
        scheduler.update_from_output(step, runner.execute(step.plan))
        for out in scheduler.take_outputs().get(b"c", []):
            if out.prompt_logprobs:
                assert out.request_id not in got  # sent once, even after a preemption recomputed the prompt
                got[out.request_id] = [lp.logprob for lp in out.prompt_logprobs]
    assert scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            reference = hf_model()(torch.tensor([prompt])).logits[0].log_softmax(-1)
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(got[str(i)]), want, atol=1e-4)
