"""Sampler: greedy is argmax, filters keep the right tokens, seeded rows do not depend on the batch, penalties,
logit_bias, min_tokens and logprobs do what OpenAI documents."""

import torch

from shuttle.common.sampling import SamplingParams
from shuttle.worker.sampler import Sampler, SamplingState, greedy_tokens


def states(params: SamplingParams, n: int, prompt_len: int = 1) -> list[SamplingState]:
    return [SamplingState(params, prompt_len) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, states(SamplingParams(temperature=0.0), 4), [[1]] * 4)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs is None


def test_greedy_tokens_pick_argmax_s_index_among_ties_and_nans_in_both_dtypes():
    """greedy_tokens goes through torch.max for speed; it must name the same index argmax does: the first of equal
    largest logits, and a NaN where a row has one."""
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randint(0, 6, (32, 3000), generator=gen).float() / 7).to(dtype)  # every row full of ties
        logits[5, 17] = float("nan")
        assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
        assert greedy_tokens(logits)[5] == 17


def test_top_k_top_p_min_p_restrict_choices():
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0]]).repeat(200, 1)
    sampler = Sampler(seed=1)
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.5), {0}),
                            (SamplingParams(min_p=0.2), {0, 1})]:
        assert set(sampler(logits, states(params, 200), [[1]] * 200).token_ids) <= allowed
    assert len(set(sampler(logits, states(SamplingParams(), 200), [[1]] * 200).token_ids)) >= 3


def test_seeded_row_is_independent_of_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler()(logits[2:3], [SamplingState(params, 1)], [[1]]).token_ids[0]
    rows = states(SamplingParams(), 2) + [SamplingState(params, 1)] + states(SamplingParams(), 3)
    assert Sampler(seed=5)(logits, rows, [[1]] * 6).token_ids[2] == alone


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    tokens = torch.tensor(Sampler(seed=3)(logits, states(SamplingParams(), 4000), [[1]] * 4000).token_ids)
    assert torch.allclose(torch.bincount(tokens, minlength=3).float() / 4000, probs, atol=0.03)


def test_logit_bias_min_tokens_and_penalties():
    logits = torch.tensor([[0.0, 5.0, 4.0, 1.0]])
    greedy = SamplingParams(temperature=0.0)
    sampler = Sampler(eos_token_ids=(1,))
    assert sampler(logits.clone(), [SamplingState(SamplingParams(temperature=0.0, logit_bias=((3, 10.0),)), 1)],
                   [[0]]).token_ids == [3]
    # token 1 is EOS: masked until min_tokens outputs exist
    assert sampler(logits.clone(), [SamplingState(SamplingParams(temperature=0.0, min_tokens=2), 1)],
                   [[0, 2]]).token_ids == [2]
    assert sampler(logits.clone(), [SamplingState(SamplingParams(temperature=0.0, min_tokens=1), 1)],
                   [[0, 2]]).token_ids == [1]
    # output already holds token 1 twice: frequency penalty 1.0 lowers it by 2, below token 2
    assert sampler(logits.clone(), [SamplingState(SamplingParams(temperature=0.0, frequency_penalty=1.0), 1)],
                   [[0, 1, 1]]).token_ids == [2]
    assert sampler(logits.clone(), [SamplingState(SamplingParams(temperature=0.0, presence_penalty=1.5), 1)],
                   [[0, 1, 1]]).token_ids == [2]
    assert sampler(logits.clone(), [SamplingState(SamplingParams(temperature=0.0, repetition_penalty=2.0), 1)],
                   [[1]]).token_ids == [2]  # token 1 in the prompt: 5 / 2 < 4
    assert sampler(logits.clone(), [SamplingState(greedy, 1)], [[0, 1, 1]]).token_ids == [1]


def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(4))
    rows = [SamplingState(SamplingParams(temperature=0.0, logprobs=5), 1), SamplingState(SamplingParams(), 1),
            SamplingState(SamplingParams(temperature=0.7, logprobs=0, seed=1), 1)]
    out = Sampler()(logits.clone(), rows, [[1]] * 3)
    reference = logits.log_softmax(-1)
    first, second, third = out.logprobs
    assert second is None and third.top_token_ids == []
    assert abs(first.logprob - reference[0, out.token_ids[0]].item()) < 1e-6
    assert first.top_token_ids == reference[0].topk(5).indices.tolist()
    assert first.top_logprobs == sorted(first.top_logprobs, reverse=True)
    assert abs(third.logprob - reference[2, out.token_ids[2]].item()) < 1e-6


def test_rows_whose_logits_hold_nan_or_posinf_are_reported_broken_and_masked_rows_are_not():
    """A NaN or +inf logit leaves no distribution to sample (softmax is NaN everywhere): the sampler names the row in
    `broken_rows`, on its all-greedy path and its general one, greedy or random. A row at -inf everywhere (a grammar
    that admits nothing) is not broken: its grammar reports it."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(4))
    logits[1, 7] = float("nan")
    logits[3, 2] = float("inf")
    logits[4] = float("-inf")
    greedy = SamplingParams(temperature=0.0)
    assert Sampler()(logits.clone(), states(greedy, 5), [[1]] * 5).broken_rows == [1, 3]
    for params in (SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.8, seed=1)):
        assert Sampler()(logits.clone(), states(params, 5), [[1]] * 5).broken_rows == [1, 3]
    assert Sampler()(logits[[0, 2]].clone(), states(greedy, 2), [[1]] * 2).broken_rows == []
