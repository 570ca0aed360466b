"""Scheduler and model runner in one process (no sockets), checked token for token against transformers'
generate under chunked prefill, preemption, and prefix caching on and off."""

import functools
import random
import time

import pytest

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.messages import FinishReason, Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.in_process import drive as serve_in_process
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker.worker import ModelRunner
from tests.conftest import hf_greedy
from tests.server import MODEL_DIR


def drive(scheduler, runner, on_outputs, max_in_flight=2):
    """scheduler/in_process.drive with the block pool checked after every turn."""
    serve_in_process(scheduler, runner, on_outputs, max_in_flight=max_in_flight, check_blocks=True)


def make_engine(num_blocks, max_batched, prefix_caching=True, block_size=16):
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(block_size, num_blocks, enable_prefix_caching=prefix_caching),
                           scheduler=SchedulerConfig(max_num_batched_tokens=max_batched))
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, block_size, prefix_caching),
                          model.max_model_len, model.eos_token_ids)
    return scheduler, runner_for(config)


@functools.cache
def _runner(config):
    return ModelRunner(config)


def runner_for(config):
    """One ModelRunner per configuration, with its per-request state reset (loading and checking the model once)."""
    runner = _runner(config)
    for request_id in list(runner.batch.requests):
        runner.batch.drop(request_id)
    return runner


def run_to_completion(prompts, max_tokens, num_blocks, max_batched, prefix_caching=True, block_size=16,
                      max_in_flight=2):
    """Greedy outputs of every prompt on a fresh stories260K engine (see greedy_outputs)."""
    scheduler, runner = make_engine(num_blocks, max_batched, prefix_caching, block_size)
    outputs, cached = greedy_outputs(scheduler, runner, prompts, max_tokens, max_in_flight=max_in_flight)
    assert scheduler.kv.pool.num_free == num_blocks
    return outputs, scheduler, cached


def greedy_outputs(scheduler, runner, prompts, max_tokens, first_alone=True, max_in_flight=2):
    """Greedy outputs of every prompt, and each request's num_cached_tokens. With `first_alone`, the first prompt
    runs alone until its prefill settled, so the others can find its blocks in the prefix cache."""
    outputs = {str(i): [] for i in range(len(prompts))}
    cached = {}

    def collect(batch):
        for out in batch:
            outputs[out.request_id] += out.new_token_ids
            cached[out.request_id] = out.num_cached_tokens

    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt,
                                           sampling=SamplingParams(max_tokens=m,
                                                                   temperature=0.0), arrival_time=time.time()))
        if i == 0 and first_alone:
            while not outputs["0"] and scheduler.has_work:
                drive_one(scheduler, runner, collect)
    drive(scheduler, runner, collect, max_in_flight)
    return [outputs[str(i)] for i in range(len(prompts))], cached


def terminal_collector(*request_ids: str):
    """(outputs, ends, collect): `collect` for drive() gathers each request's output tokens into `outputs` and its
    one terminal output into `ends` (a second one fails the test)."""
    outputs: dict[str, list[int]] = {request_id: [] for request_id in request_ids}
    ends: dict = {}

    def collect(batch):
        for out in batch:
            outputs[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                assert out.request_id not in ends, "a second terminal output"
                ends[out.request_id] = out

    return outputs, ends, collect


def drive_one(scheduler, runner, on_outputs):
    step = scheduler.schedule()
    scheduler.update_from_output(step, runner.execute(step.plan))
    on_outputs(scheduler.take_outputs().get(b"c", []))


@pytest.mark.parametrize("num_blocks, max_batched, prefix_caching, max_in_flight", [
    (400, 2048, True, 2), (400, 7, True, 2), (48, 2048, True, 2), (40, 13, False, 2), (48, 2048, True, 1)])
def test_matches_transformers(num_blocks, max_batched, prefix_caching, max_in_flight):
    rng = random.Random(0)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 200))] for _ in range(12)]
    max_tokens = [rng.randrange(20, 120) for _ in prompts]
    outputs, scheduler, _ = run_to_completion(prompts, max_tokens, num_blocks, max_batched, prefix_caching,
                                              max_in_flight=max_in_flight)
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
    scheduler, runner = make_engine(14, 7)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=params,
                                           arrival_time=time.time() + i))
    got = {}

    def collect(batch):
        for out in batch:
            if out.prompt_logprobs:
                assert out.request_id not in got  # sent once, even after a preemption recomputed the prompt
                got[out.request_id] = [lp.logprob for lp in out.prompt_logprobs]

    drive(scheduler, runner, collect)
    assert scheduler.num_preemptions > 0
    for i, prompt in enumerate(prompts):
        with torch.inference_mode():
            reference = hf_model()(torch.tensor([prompt])).logits[0].log_softmax(-1)
        want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        assert torch.allclose(torch.tensor(got[str(i)]), want, atol=1e-4)


def run_alone(scheduler, runner, request_id, prompt, **sampling):
    """Run one request to its end, alone: (its prompt logprobs, its num_cached_tokens, how many steps computed a
    chunk of them)."""
    scheduler.add_request(b"c", Submit(request_id=request_id, prompt_token_ids=prompt, arrival_time=time.time(),
                                       sampling=SamplingParams(max_tokens=2, temperature=0.0, **sampling)))
    prompt_logprobs, cached, chunks, finished = [], -1, 0, False
    while not finished:
        step = scheduler.schedule()
        result = runner.execute(step.plan)
        chunks += any(chunk.request_id == request_id for chunk in result.prompt_logprobs)
        scheduler.update_from_output(step, result)
        for out in scheduler.take_outputs().get(b"c", []):
            prompt_logprobs = prompt_logprobs or out.prompt_logprobs
            cached = max(cached, out.num_cached_tokens)
            finished = out.finish_reason is not None
    return prompt_logprobs, cached, chunks


def reference_log_softmax(prompt):
    """transformers' log_softmax over the whole prompt's forward, the rows that predict prompt tokens 1.. [P-1, V]."""
    import torch

    from tests.conftest import hf_model

    with torch.inference_mode():
        return hf_model()(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)


# float32 on both sides, but chunked prefill adds attention over the cache in another order than one full forward:
# the logprobs (magnitudes up to ~15 here) differ by a few 1e-6; 1e-4 is far above that noise and far below the gap
# between two tokens' logprobs, so ranks and top-k ids must agree exactly.
ATOL = 1e-4


def test_prompt_logprobs_top_k_and_ranks_match_transformers_under_chunked_prefill():
    import torch

    from tests.conftest import hf_tokenizer

    rng = random.Random(11)
    story = hf_tokenizer()("Once upon a time, there was a little girl named Lily. She loved to play.").input_ids
    prompt = story + [rng.randrange(3, 512) for _ in range(51 - len(story))]  # likely tokens, then unlikely ones
    scheduler, runner = make_engine(64, 7)  # 7 tokens a step: the prompt's logprobs come in 8 chunks
    got, cached, chunks = run_alone(scheduler, runner, "0", prompt, prompt_logprobs=4)
    reference = reference_log_softmax(prompt)
    want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (chunks, cached, len(got)) == (8, 0, len(prompt) - 1)
    assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=ATOL)
    # a rank counts the tokens at least as likely: exact, but for tokens within ATOL of the prompt token's logprob
    # (the tail of 512 logits is dense), which may fall on either side
    surely_above = (reference > want.unsqueeze(1) + ATOL).sum(-1)
    maybe_above = (reference >= want.unsqueeze(1) - ATOL).sum(-1)
    ranks = torch.tensor([lp.rank for lp in got])
    assert bool(((surely_above < ranks) & (ranks <= maybe_above)).all())
    assert int((surely_above + 1 == maybe_above).sum()) > len(got) // 2  # most leave no room: those are exact
    assert min(lp.rank for lp in got) == 1 and max(lp.rank for lp in got) > 4  # both cases of the prompt token
    top = reference.topk(4)
    assert [lp.top_token_ids for lp in got] == top.indices.tolist()
    assert torch.allclose(torch.tensor([lp.top_logprobs for lp in got]), top.values, atol=ATOL)


def test_prompt_logprobs_are_computed_for_positions_the_prefix_cache_holds():
    """vLLM's rule: a request with prompt_logprobs takes no prefix-cache hit (cached positions have no logits), so
    every prompt token gets its logprob though the same prompt's blocks are cached; the cache stays for others."""
    import torch

    rng = random.Random(12)
    prompt = [1] + [rng.randrange(3, 512) for _ in range(52)]
    scheduler, runner = make_engine(64, 2048)
    assert run_alone(scheduler, runner, "warm", prompt)[1] == 0
    got, cached, _ = run_alone(scheduler, runner, "scored", prompt, prompt_logprobs=0)
    assert run_alone(scheduler, runner, "again", prompt)[1] == 48  # three whole blocks were there to hit
    reference = reference_log_softmax(prompt)
    want = reference[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert (cached, len(got)) == (0, len(prompt) - 1)
    assert torch.allclose(torch.tensor([lp.logprob for lp in got]), want, atol=ATOL)
    assert all(lp.top_token_ids == [] for lp in got)


@pytest.mark.parametrize("neighbour", [SamplingParams(max_tokens=40, temperature=0.0),
                                       SamplingParams(max_tokens=40, temperature=0.0, logprobs=1)])
def test_a_request_whose_logits_turn_nan_ends_alone_with_500(monkeypatch, neighbour):
    """Logits that hold NaN (a model or adapter overflowing in its dtype) leave nothing to sample: that request ends
    with one 500 naming the output position, after the tokens it had; its neighbour in the same steps runs to the
    end equal to transformers, on the sampler's all-greedy path and on its general one (logprobs)."""
    scheduler, runner = make_engine(256, 64)
    sampler = runner.sampler
    poisoned_at = 5  # the poisoned request's output position whose logits are NaN

    def poisoning_sampler(logits, states, token_ids):
        for row, (state, ids) in enumerate(zip(states, token_ids)):
            if state.params.max_tokens == 30 and len(ids) - state.prompt_len == poisoned_at:
                logits[row, 11] = float("nan")
        return sampler(logits, states, token_ids)

    monkeypatch.setattr(runner, "sampler", poisoning_sampler)
    outputs, ends, collect = terminal_collector("free", "poisoned")
    prompt = [1, 45, 88, 301, 12, 9]
    scheduler.add_request(b"c", Submit(request_id="free", prompt_token_ids=prompt, sampling=neighbour,
                                       arrival_time=time.time()))
    scheduler.add_request(b"c", Submit(request_id="poisoned", prompt_token_ids=prompt, arrival_time=time.time(),
                                       sampling=SamplingParams(max_tokens=30, temperature=0.0)))
    drive(scheduler, runner, collect)
    assert outputs["free"] == hf_greedy(prompt, 40)
    assert outputs["poisoned"] == hf_greedy(prompt, poisoned_at)
    failed = ends["poisoned"]
    assert (failed.finish_reason, failed.error_status) == (FinishReason.ERROR, 500)
    assert f"logits at output position {poisoned_at} are not finite" in failed.error_message
    assert scheduler.kv.pool.num_free == 256 and not scheduler.requests
