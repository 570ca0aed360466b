"""Turns the logits of sampling positions into token ids, each row under its own request's parameters."""

from __future__ import annotations

import torch

from common.sampling import SamplingParams


class Sampler:
    """Greedy, temperature, top-k, top-p and min-p sampling.

    Random draws use the exponential-race form of categorical sampling (argmax of p / E with
    E ~ Exp(1), equivalent to drawing from p), one row at a time from the request's own generator when it
    has a seed, so a seeded request draws the same numbers whatever else is in the batch.

    Args:
        seed: seeds the shared generator used by requests without a seed.
    """

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: float [S, vocab] logits of the S sampling positions.
            params, generators: per row.
        Returns:
            int64 [S] token ids.
        """
        logits = logits.float()
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens
        rows = torch.tensor(random_rows)
        subset = [params[i] for i in random_rows]
        probs = self._probabilities(logits[rows], subset)
        for j, i in enumerate(random_rows):
            noise = torch.empty_like(probs[j]).exponential_(generator=generators[i] or self.generator)
            tokens[i] = (probs[j] / noise).argmax()
        return tokens

    @staticmethod
    def _probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Probabilities after temperature, top-k, top-p and min-p filtering. logits: float [R, vocab]."""
        temperature = torch.tensor([p.temperature for p in params]).unsqueeze(1)
        logits = logits / temperature
        top_k = [p.top_k if p.top_k > 0 else logits.shape[1] for p in params]
        if any(k < logits.shape[1] for k in top_k):
            kth = torch.stack([logits[r].topk(min(k, logits.shape[1])).values[-1] for r, k in enumerate(top_k)])
            logits = logits.masked_fill(logits < kth.unsqueeze(1), float("-inf"))
        probs = logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
        if (top_p < 1.0).any():
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            # Keep a token if the mass before it is below top_p (so the top token always stays).
            drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
        min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
        if (min_p > 0).any():
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        return probs
