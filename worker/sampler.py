"""Turns the logits of sampling positions into token ids, each row under its own request's parameters.

Order of operations (as vLLM and transformers apply them): logit_bias, the min_tokens mask of stop ids,
repetition / frequency / presence penalties, then temperature, top-k, top-p and min-p, then the draw.
Log-probabilities are reported from the model's raw distribution, before any of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.messages import TokenLogprobs
from common.sampling import SamplingParams


class SamplingState:
    """Per-request state that must persist across steps for the request to sample the same tokens in any batch.

    Attributes:
        generator: the request's own RNG when it has a seed (None: the worker's shared generator).
        output_counts: float [vocab], occurrences of each token in the output (built on first use).
        seen: bool [vocab], tokens in prompt or output, for the repetition penalty (built on first use).
    """

    def __init__(self, params: SamplingParams, prompt_len: int):
        self.params = params
        self.prompt_len = prompt_len
        self.generator = torch.Generator().manual_seed(params.seed % 2**64) if params.seed is not None else None
        self.output_counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        # logit_bias as tensors once, not every step: int64 ids [B], float32 biases [B]
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)

    def penalty_tensors(self, token_ids: list[int], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.output_counts is None:
            self.output_counts = torch.bincount(torch.tensor(token_ids[self.prompt_len:], dtype=torch.long),
                                                minlength=vocab_size)[:vocab_size].float()
            self.seen = torch.zeros(vocab_size, dtype=torch.bool)
            self.seen[torch.tensor(token_ids, dtype=torch.long)] = True
        return self.output_counts, self.seen

    def record(self, token_id: int) -> None:
        """Count a newly sampled token (only once penalty tensors exist; they are rebuilt from ids otherwise)."""
        if self.output_counts is not None:
            self.output_counts[token_id] += 1
            self.seen[token_id] = True


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs


class Sampler:
    """Greedy and random sampling with OpenAI/vLLM parameters.

    Random draws use the exponential-race form of categorical sampling (argmax of p / E with E ~ Exp(1),
    equivalent to drawing from p), row by row from the request's own generator when it has a seed.

    Args:
        eos_token_ids: masked out (unless ignore_eos) while a request has fewer than min_tokens outputs.
        seed: seeds the shared generator used by requests without a seed.
    """

    def __init__(self, eos_token_ids: tuple[int, ...] = (), seed: int = 0):
        self.eos_token_ids = tuple(eos_token_ids)
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState], token_ids: list[list[int]]) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: float [S, vocab] at the S sampling positions.
            states: per row sampling state; token_ids: per row prompt + output so far.
        Returns:
            SamplerOutput with S token ids (and logprobs for rows that asked).
        """
        logits = logits.float()
        raw_logprobs = self._raw_logprobs(logits, states)
        logits = self._process(logits, states, token_ids)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows)
            probs = _filtered_probabilities(logits[rows], [states[i].params for i in random_rows])
            for j, i in enumerate(random_rows):
                noise = torch.empty_like(probs[j]).exponential_(generator=states[i].generator or self.generator)
                tokens[i] = (probs[j] / noise).argmax()
        token_list = tokens.tolist()
        if raw_logprobs is None:
            return SamplerOutput(token_list, None)
        logprobs: list[TokenLogprobs | None] = [None] * len(states)
        for i, row in raw_logprobs.items():
            k = states[i].params.logprobs
            top = row.topk(k) if k else None
            logprobs[i] = TokenLogprobs(row[token_list[i]].item(), top.indices.tolist() if top else [],
                                        top.values.tolist() if top else [])
        return SamplerOutput(token_list, logprobs)

    @staticmethod
    def _raw_logprobs(logits: torch.Tensor, states: list[SamplingState]) -> dict[int, torch.Tensor] | None:
        """Row index -> float [vocab] log-softmax of the raw logits, for rows that asked for logprobs."""
        wanted = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not wanted:
            return None
        log_softmax = logits[torch.tensor(wanted)].log_softmax(dim=-1)
        return {i: log_softmax[j] for j, i in enumerate(wanted)}

    def _process(self, logits: torch.Tensor, states: list[SamplingState], token_ids: list[list[int]]) -> torch.Tensor:
        vocab = logits.shape[1]
        for i, state in enumerate(states):
            params = state.params
            if params.logit_bias:
                logits[i, state.bias_ids] += state.bias_values
            if len(token_ids[i]) - state.prompt_len < params.min_tokens:
                stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_token_ids))
                if stop_ids:
                    logits[i, torch.tensor(stop_ids)] = float("-inf")
            if params.has_penalties:
                counts, seen = state.penalty_tensors(token_ids[i], vocab)
                row = logits[i]
                if params.repetition_penalty != 1.0:
                    penalized = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
                    row = torch.where(seen, penalized, row)
                row = row - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
                logits[i] = row
        return logits


def _filtered_probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
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
        drop_sorted[:, 0] = False  # even a top_p that rounds to 0 in float32 keeps the top token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_p = torch.tensor([p.min_p for p in params]).unsqueeze(1)
    if (min_p > 0).any():
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
