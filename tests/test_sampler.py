"""Sampler: greedy is argmax, filters keep the right tokens, seeded rows do not depend on the batch."""

import torch

from common.sampling import SamplingParams
from worker.sampler import Sampler


def test_greedy_is_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    tokens = Sampler()(logits, [SamplingParams(temperature=0.0)] * 4, [None] * 4)
    assert tokens.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_restrict_choices():
    logits = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0]]).repeat(200, 1)
    sampler = Sampler(seed=1)
    for params, allowed in [(SamplingParams(top_k=2), {0, 1}), (SamplingParams(top_p=0.5), {0}),
                            (SamplingParams(min_p=0.2), {0, 1})]:
        tokens = sampler(logits, [params] * 200, [None] * 200)
        assert set(tokens.tolist()) <= allowed
    tokens = sampler(logits, [SamplingParams()] * 200, [None] * 200)
    assert len(set(tokens.tolist())) >= 3  # no filter: other tokens do appear


def test_seeded_row_is_independent_of_batch():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(temperature=1.0, seed=42)

    def alone() -> int:
        return Sampler()(logits[2:3], [params], [torch.Generator().manual_seed(42)]).item()

    batch = Sampler(seed=5)(logits, [SamplingParams()] * 2 + [params] + [SamplingParams()] * 3,
                            [None, None, torch.Generator().manual_seed(42), None, None, None])
    assert batch[2].item() == alone()


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    logits = probs.log().unsqueeze(0).repeat(4000, 1)
    tokens = Sampler(seed=3)(logits, [SamplingParams()] * 4000, [None] * 4000)
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03)
