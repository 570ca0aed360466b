"""Speculative decoding (--speculative-config: ngram, and draft_model with a 2-layer draft of the target) on the
in-process engine against transformers' generate on stories260K: greedy output token for token with prefix caching
and under preemption, drafts actually accepted; a draft model that is the target itself has every draft accepted
(its KV, shared block ids and all, is right); and sampled next-token frequencies with speculation matching those
without (chi-square)."""

import functools
import random
import time
from pathlib import Path

import pytest

from scripts.dev.make_random_model import truncate_model
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.messages import FinishReason, Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.common.speculative import SpeculativeConfig
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker.worker import ModelRunner
from tests.conftest import hf_greedy
from tests.engine.test_engine_inprocess import terminal_collector
from tests.server import MODEL_DIR

NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    """A draft model of stories260K: its first 2 of 5 layers (scripts/dev/make_random_model.py)."""
    return str(truncate_model(Path(MODEL_DIR), tmp_path_factory.mktemp("draft") / "stories260K-draft2", 2))


def draft_config(model_dir: str, k: int = 3) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", num_speculative_tokens=k, model=model_dir)


@functools.cache
def _runner(block_size: int, num_blocks: int, draft: SpeculativeConfig | None = None) -> ModelRunner:
    model = ModelConfig.from_dir(MODEL_DIR)
    return ModelRunner(ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                                     cache=CacheConfig(block_size, num_blocks),
                                     scheduler=SchedulerConfig(speculative_config=draft)))


def make_engine(num_blocks=400, max_batched=2048, speculative=NGRAM, prefix_caching=True, block_size=16):
    """A Scheduler under `speculative` (None: off) and a ModelRunner holding no request state."""
    model = ModelConfig.from_dir(MODEL_DIR)
    config = SchedulerConfig(max_num_batched_tokens=max_batched, speculative_config=speculative)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, prefix_caching), model.max_model_len,
                          model.eos_token_ids)
    drafting = speculative is not None and speculative.method == "draft_model"
    runner = _runner(block_size, num_blocks, speculative if drafting else None)
    for request_id in list(runner.batch.requests):
        runner.batch.drop(request_id)
    return scheduler, runner


def run(scheduler, runner, prompts, params):
    """Every request's output token ids (and logprobs entries), driven with the block pool checked every turn."""
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=p,
                                           arrival_time=time.time() + i))

    def collect(batch):
        for out in batch:
            assert out.error_status == 0, out.error_message
            outputs[out.request_id] += out.new_token_ids

    drive(scheduler, runner, collect, max_in_flight=2, check_blocks=True)
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_blocks
    return [outputs[str(i)] for i in range(len(prompts))]


def repetitive_prompts(n, seed=0):
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrase = [rng.randrange(3, 512) for _ in range(rng.randrange(4, 12))]
        tail = [rng.randrange(3, 512) for _ in range(rng.randrange(0, 30))]
        prompts.append([1] + phrase * rng.randrange(2, 5) + tail)
    return prompts


@pytest.mark.parametrize("num_blocks, max_batched", [(400, 2048), (40, 2048), (400, 9)])
def test_greedy_with_ngram_speculation_matches_transformers(num_blocks, max_batched):
    prompts = repetitive_prompts(10)
    max_tokens = [random.Random(i).randrange(30, 120) for i in range(len(prompts))]
    scheduler, runner = make_engine(num_blocks, max_batched)
    got = run(scheduler, runner, prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    for prompt, m, out in zip(prompts, max_tokens, got):
        assert out == hf_greedy(prompt, m)
    stats = scheduler.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens > 0  # drafts were verified and accepted
    assert stats.spec_num_accepted_tokens == sum(stats.spec_accepted_per_pos)
    assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    if num_blocks < 50:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("num_blocks, max_batched", [(400, 2048), (24, 2048), (400, 9)])
def test_greedy_with_a_draft_model_matches_transformers(num_blocks, max_batched, draft_dir):
    prompts = repetitive_prompts(8, seed=2)
    max_tokens = [random.Random(i).randrange(30, 100) for i in range(len(prompts))]
    scheduler, runner = make_engine(num_blocks, max_batched, speculative=draft_config(draft_dir))
    got = run(scheduler, runner, prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    for prompt, m, out in zip(prompts, max_tokens, got):
        assert out == hf_greedy(prompt, m)
    stats = scheduler.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_accepted_tokens == sum(stats.spec_accepted_per_pos)
    if num_blocks < 50:
        assert scheduler.num_preemptions > 0


@pytest.mark.parametrize("num_blocks", [400, 40])
def test_the_target_as_its_own_draft_has_every_draft_accepted(num_blocks):
    """Greedy drafts from the target itself are all accepted exactly when the draft KV is right at every position:
    written by prefill chunks, by the draft passes (the last draft's too), after preemption, and for blocks found in
    the prefix cache (the continuations)."""
    spec = draft_config(str(MODEL_DIR))
    prompts = repetitive_prompts(6, seed=3)
    scheduler, runner = make_engine(num_blocks, speculative=spec)
    first = run(scheduler, runner, prompts, [SamplingParams(max_tokens=60, temperature=0.0)] * len(prompts))
    continued = [prompt + out for prompt, out in zip(prompts, first)]
    hits_before = scheduler.kv.prefix_hits
    second = run(scheduler, runner, continued, [SamplingParams(max_tokens=30, temperature=0.0)] * len(prompts))
    for prompt, out in zip(continued, second):
        assert out == hf_greedy(prompt, 30)
    stats = scheduler.stats()
    assert stats.spec_num_draft_tokens > 200 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos[0] == stats.spec_num_drafts
    if num_blocks < 50:
        assert scheduler.num_preemptions > 0
    else:
        assert scheduler.kv.prefix_hits > hits_before


def test_prefix_cache_hits_only_accepted_blocks_written_by_speculative_steps():
    """A continuation of each finished conversation finds its blocks (written by speculative steps, rejected
    drafts' KV included in their last block until overwritten) and still equals transformers."""
    prompts = repetitive_prompts(6, seed=1)
    scheduler, runner = make_engine(num_blocks=120)
    first = run(scheduler, runner, prompts, [SamplingParams(max_tokens=80, temperature=0.0)] * len(prompts))
    hits_before = scheduler.kv.prefix_hits
    continued = [prompt + out for prompt, out in zip(prompts, first)]
    second = run(scheduler, runner, continued, [SamplingParams(max_tokens=40, temperature=0.0)] * len(prompts))
    for prompt, out in zip(continued, second):
        assert out == hf_greedy(prompt, 40)
    # every continuation found at least the full blocks of its first prompt + output (not counting the last token)
    assert scheduler.kv.prefix_hits - hits_before == sum((len(p) - 1) // 16 * 16 for p in continued)
    assert scheduler.stats().spec_num_accepted_tokens > 0


def sample_outputs(speculative, seeds, prompt, **sampling):
    scheduler, runner = make_engine(num_blocks=2000, speculative=speculative)
    params = [SamplingParams(max_tokens=4, seed=seed, ignore_eos=True, **sampling) for seed in seeds]
    return run(scheduler, runner, [prompt] * len(seeds), params), scheduler.stats()


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.8, top_k=12, top_p=0.9,
                                                                  logit_bias=((13, 2.0),))])
def test_sampled_token_frequencies_with_speculation_match_those_without(sampling):
    from scipy.stats import chi2_contingency

    prompt = [1] + hf_greedy([1], 80)  # the model's own story: its n-grams are often what it would sample
    seeds = range(1500)
    plain, _ = sample_outputs(None, seeds, prompt, **sampling)
    spec, stats = sample_outputs(NGRAM, [seed + 10**6 for seed in seeds], prompt, **sampling)
    assert stats.spec_num_accepted_tokens > 100 and stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens
    for position in (1, 2, 3):  # the first output token is sampled by the prefill, without drafts
        counts: dict[int, list[int]] = {}
        for column, outputs in enumerate((plain, spec)):
            for out in outputs:
                counts.setdefault(out[position], [0, 0])[column] += 1
        table = [c for c in counts.values() if sum(c) >= 10]
        rare = [sum(c[i] for c in counts.values() if sum(c) < 10) for i in (0, 1)]
        if sum(rare):
            table.append(rare)
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)
    again, _ = sample_outputs(NGRAM, [seed + 10**6 for seed in seeds[:200]], prompt, **sampling)
    assert again == spec[:200]  # seeded requests sample the same tokens again, in another batch


def run_outputs(scheduler, runner, prompts, params):
    """Every request's RequestOutputs joined: (token ids, logprob entries, finish reason)."""
    got = {str(i): ([], [], None) for i in range(len(prompts))}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=p,
                                           arrival_time=time.time() + i))

    def collect(batch):
        for out in batch:
            tokens, logprobs, _ = got[out.request_id]
            got[out.request_id] = (tokens + out.new_token_ids, logprobs + out.logprobs, out.finish_reason)

    drive(scheduler, runner, collect, max_in_flight=2, check_blocks=True)
    return [got[str(i)] for i in range(len(prompts))]


def test_greedy_processing_logprobs_and_stops_are_the_ones_without_speculation():
    """logit_bias, min_tokens (its stop-id mask advanced along the drafts) and stop ids cut inside the gained tokens
    give the output without speculation, and the accepted tokens' logprobs are the target model's."""
    prompts = repetitive_prompts(8, seed=4)
    story = hf_greedy([1], 60)
    stop_id = story[30]
    params = [SamplingParams(max_tokens=70, temperature=0.0, logprobs=2),
              SamplingParams(max_tokens=70, temperature=0.0, logit_bias=((story[5], 3.0), (story[9], -2.0))),
              SamplingParams(max_tokens=70, temperature=0.0, min_tokens=40, stop_token_ids=(stop_id,)),
              SamplingParams(max_tokens=70, temperature=0.0, stop_token_ids=(stop_id,), logprobs=0)] * 2
    prompts = [[1] + story[:20]] * 4 + prompts[:4]
    plain = run_outputs(*make_engine(speculative=None), prompts, params)
    scheduler, runner = make_engine()
    spec = run_outputs(scheduler, runner, prompts, params)
    assert scheduler.stats().spec_num_accepted_tokens > 0
    for (tokens, logprobs, reason), (want_tokens, want_logprobs, want_reason) in zip(spec, plain):
        assert (tokens, reason) == (want_tokens, want_reason)
        assert len(logprobs) == len(want_logprobs)
        for got, want in zip(logprobs, want_logprobs):
            assert got.top_token_ids == want.top_token_ids
            assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)
    assert spec[3][2] == FinishReason.STOP and spec[3][0][-1] == stop_id  # the stop id cut the gained tokens


def test_a_verifying_request_whose_logits_turn_nan_ends_alone_with_500(monkeypatch):
    """NaN logits in a verifying request's rows (the target overflowing): that request ends with one 500, its
    neighbour verifying drafts in the same steps runs to the end equal to transformers."""
    from shuttle.worker import worker as worker_module

    verify = worker_module.verify_drafts

    def poisoning_verify(sampler, logits, requests):
        row = 0
        for state in requests:
            rows = len(state.draft_token_ids) + 1
            if state.request_id == "1" and len(state.token_ids) - state.sampling.prompt_len >= 6:
                logits[row:row + rows, 5] = float("nan")
            row += rows
        return verify(sampler, logits, requests)

    monkeypatch.setattr(worker_module, "verify_drafts", poisoning_verify)
    scheduler, runner = make_engine()
    prompts = repetitive_prompts(2, seed=4)
    outputs, ends, collect = terminal_collector("0", "1")
    for i, prompt in enumerate(prompts):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, arrival_time=time.time(),
                                           sampling=SamplingParams(max_tokens=60, temperature=0.0)))
    drive(scheduler, runner, collect, max_in_flight=2, check_blocks=True)
    assert outputs["0"] == hf_greedy(prompts[0], 60) and ends["0"].finish_reason == FinishReason.LENGTH
    assert (ends["1"].finish_reason, ends["1"].error_status) == (FinishReason.ERROR, 500)
    assert "are not finite" in ends["1"].error_message
    assert outputs["1"] == hf_greedy(prompts[1], 60)[:len(outputs["1"])] and len(outputs["1"]) >= 6
    assert scheduler.stats().spec_num_drafts > 0
    assert scheduler.kv.pool.num_free == scheduler.kv.pool.num_blocks and not scheduler.requests


def test_the_reported_kv_bytes_per_token_count_the_draft_models_too(draft_dir):
    """A trial: the start-up line said the target's 1280 bytes/token while the budget held 1792 (both models'), so
    its MiB figure was the target's share alone."""
    target = _runner(16, 32)
    both = _runner(16, 32, draft_config(draft_dir))
    assert target.kv_bytes_per_token == 5 * 256  # stories260K: 5 layers, K + V of 32 float32 values each
    assert both.kv_bytes_per_token == target.kv_bytes_per_token * 7 // 5  # and its first 2 layers again

