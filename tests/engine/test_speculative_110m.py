"""Speculative decoding at the 110M Llama shape (768 wide, 12 layers, the Llama 2 tokenizer; random weights made
here): greedy output with n-gram speculation and with a 2-layer draft model (the model's first two layers, its
tokenizer and head) equals transformers' generate token for token, with prefix caching on and under preemption.

Random weights of this shape repeat their tokens in runs, so n-gram drafts are found and accepted, and the 2-layer
draft agrees often enough that both accepted and rejected drafts occur."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from scripts.dev.make_random_model import DEFAULT_TOKENIZER, make_random_model, truncate_model
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.messages import Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.common.speculative import SpeculativeConfig
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker.worker import ModelRunner

BLOCK = 16
NUM_BLOCKS = 12  # 192 slots for 3 sequences of up to 70 tokens: the last to arrive is preempted


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    if not (DEFAULT_TOKENIZER / "tokenizer.json").exists():
        pytest.skip(f"no Llama 2 tokenizer at {DEFAULT_TOKENIZER}")
    root = tmp_path_factory.mktemp("llama-110m")
    target = make_random_model(root / "target", "110m")
    return target, truncate_model(target, root / "draft2", 2)


def greedy(target, spec: SpeculativeConfig, prompts: list[list[int]], max_tokens: int):
    model = ModelConfig.from_dir(target)
    scheduler_config = SchedulerConfig(speculative_config=spec)
    runner = ModelRunner(ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                                       cache=CacheConfig(BLOCK, NUM_BLOCKS), scheduler=scheduler_config))
    scheduler = Scheduler(scheduler_config, KVCacheManager(NUM_BLOCKS, BLOCK, True), model.max_model_len,
                          model.eos_token_ids)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, arrival_time=float(i),
                                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                                   ignore_eos=True)))

    def collect(batch):
        for out in batch:
            assert out.error_status == 0, out.error_message
            outputs[out.request_id] += out.new_token_ids

    drive(scheduler, runner, collect, max_in_flight=2, check_blocks=True)
    return [outputs[str(i)] for i in range(len(prompts))], scheduler


def test_greedy_with_speculation_at_the_110m_shape_matches_transformers(models):
    target, draft = models
    shared = [1, 450, 4996, 17354, 1701, 29916, 432, 17204, 975, 278, 17366, 11203, 29889] * 3
    prompts = [shared + [319, 2107], shared + [3118, 1565, 263], shared[:20]]  # the first two share blocks
    max_tokens = 32
    reference = AutoModelForCausalLM.from_pretrained(target)
    with torch.inference_mode():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   do_sample=False, pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    del reference
    ngram = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    drafted = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, model=str(draft))
    for spec in (ngram, drafted):
        got, scheduler = greedy(target, spec, prompts, max_tokens)
        assert got == want, spec.method
        stats = scheduler.stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens, spec.method
        assert scheduler.num_preemptions > 0 and scheduler.kv.prefix_hits > 0, spec.method
