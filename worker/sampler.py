"""Turns the logits of sampling positions into token ids, every row under its own request's parameters, batched.

Order of operations (as vLLM and transformers apply them): a constrained request's grammar mask (applied by the
ModelRunner before the sampler, worker/grammar.py), logit_bias, the min_tokens mask of stop ids, repetition /
frequency / presence penalties, then temperature, top-k, top-p and min-p, then the draw. Log-probabilities are
reported from the model's raw distribution, before any of that but the grammar mask (as vLLM reports them: a
constrained request's alternatives are tokens its grammar allows).

The draw is inverse-CDF sampling with one uniform number per row. For a seeded request that number is a pure
function of (seed, output position) (SplitMix64, Steele, Lea and Flood, "Fast splittable pseudorandom number
generators", OOPSLA 2014), so a seeded request samples the same tokens in any batch, after a preemption that
recomputes it, and on any rank, with no generator state to carry. Unseeded rows draw from the worker's generator.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shuttle.common.messages import TokenLogprobs
from shuttle.common.sampling import SamplingParams
from shuttle.worker.grammar import GrammarError, GrammarState

_MASK64 = (1 << 64) - 1
# What a token of probability 0 (logit -inf: masked by a grammar) reports as its logprob: JSON has no -Infinity, and
# vLLM reports -9999.0 there too.
LOGPROB_FLOOR = -9999.0


def seeded_uniform(seed: int, position: int) -> float:
    """A number in (0, 1) determined by (seed, position) alone: SplitMix64's output function over a key that
    mixes both (its constants are those of the paper's reference implementation)."""
    x = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return ((x >> 11) + 0.5) / 2.0**53


class SamplingState:
    """Per-request sampling state the worker keeps across steps.

    Attributes:
        prompt_len: tokens of the prompt (output positions count from it).
        bias_ids, bias_values: logit_bias as int64 [K] ids and float32 [K] values (built once).
        output_counts: float32 [vocab] occurrences of each token in the output; seen: bool [vocab], tokens in
            prompt or output (both built on first use by a request with penalties).
        grammar: where a constrained request is in its grammar (worker/grammar.py; set by the driver rank's
            ModelRunner, None elsewhere and for unconstrained requests); the logits are masked before sampling.
    """

    def __init__(self, params: SamplingParams, prompt_len: int):
        self.params = params
        self.prompt_len = prompt_len
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        self.bias_values = torch.tensor([b for _, b in params.logit_bias], dtype=torch.float32)
        self.output_counts: torch.Tensor | None = None
        self.seen: torch.Tensor | None = None
        self.grammar: GrammarState | None = None
        # argmax of the raw logits is the whole job (the common case, taken without the batched passes)
        self.plain_greedy = (params.greedy and params.logprobs is None and not params.logit_bias
                             and not params.has_penalties and params.min_tokens == 0)

    def penalty_tensors(self, token_ids: list[int], vocab_size: int,
                        device: torch.device = torch.device("cpu")) -> tuple[torch.Tensor, torch.Tensor]:
        """(output_counts float32 [vocab], seen bool [vocab]) on `device` (the logits' device), built on first use."""
        if self.output_counts is None:
            self.output_counts = torch.bincount(torch.tensor(token_ids[self.prompt_len:], dtype=torch.long),
                                                minlength=vocab_size)[:vocab_size].float().to(device)
            seen = torch.zeros(vocab_size, dtype=torch.bool)
            seen[torch.tensor(token_ids, dtype=torch.long)] = True
            self.seen = seen.to(device)
        assert self.seen is not None  # built with output_counts
        return self.output_counts, self.seen

    def record(self, token_id: int) -> None:
        """Count a newly sampled token (only once penalty tensors exist; they are built from ids otherwise) and
        advance the grammar by it.

        Raises:
            GrammarError: the grammar does not allow the token (a bug: its logits were masked).
        """
        if self.grammar is not None and not self.grammar.accept(token_id):
            raise GrammarError(f"sampled token {token_id} does not follow the request's grammar")
        if self.output_counts is not None:
            assert self.seen is not None  # built with output_counts
            self.output_counts[token_id] += 1
            self.seen[token_id] = True


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's largest logit (the first where several are equal, NaN counting as largest, as
    `argmax`): int64 [S] of float [S, vocab].

    Through `torch.max` rather than `argmax`: torch's CPU argmax is 5x slower over bfloat16 rows (over 32000 logits
    on 2 threads: 103 against 21 us for one row, 3.2 against 0.57 ms for 64) and 1.4x over float32 ones; the two give
    the same index.
    """
    return torch.max(logits, dim=-1).indices


def tokens_and_broken_rows(tokens: torch.Tensor, largest: torch.Tensor) -> tuple[list[int], list[int]]:
    """The token ids (int64 [S]) as a list, and the rows whose largest logit (float [S], the row's max) is NaN or
    +inf, in one copy to the host. Such a row's distribution is undefined (softmax gives NaN everywhere): the model
    (or an adapter) overflowed, and no token drawn from it, nor its logprobs, means anything. A row of -inf alone
    (a grammar that admits nothing) is not broken here: its grammar reports it."""
    token_list, flags = torch.stack((tokens, (~(largest < float("inf"))).long())).tolist()
    return token_list, [i for i, flag in enumerate(flags) if flag]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None  # None when no row asked for logprobs
    broken_rows: list[int] = field(default_factory=list)  # rows whose logits are not finite (tokens_and_broken_rows)


class Sampler:
    """Greedy and random sampling with OpenAI/vLLM parameters, batched over rows, on the logits' device (the
    per-row parameters go there as small tensors; the uniform numbers are drawn on the host, so seeded rows are the
    same on every device, and copied over once; the sampled ids come back in one copy).

    Args:
        eos_token_ids: masked out (unless ignore_eos) while a request has fewer than min_tokens outputs.
        seed: seeds the generator used by requests without a seed.
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
            SamplerOutput with S token ids (and logprobs for rows that asked), and the rows whose logits hold NaN or
            +inf (their token is the argmax, a valid id, and means nothing).
        """
        if all(s.plain_greedy for s in states):
            largest, tokens = torch.max(logits, dim=-1)  # as greedy_tokens
            token_list, broken = tokens_and_broken_rows(tokens, largest)
            return SamplerOutput(token_list, None, broken)
        logits = logits.float()
        params = [s.params for s in states]
        wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
        raw_logprobs = None
        if wants_logprobs:
            raw_logprobs = logits[wants_logprobs].log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR)
        num_outputs = [len(ids) - s.prompt_len for ids, s in zip(token_ids, states)]
        logits = self._process(logits, states, params, token_ids, num_outputs)
        largest, tokens = torch.max(logits, dim=-1)  # as greedy_tokens; a NaN or +inf survives the processing
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            chosen = [params[i] for i in random_rows]
            probs = _filtered_probabilities(logits[rows], chosen)
            uniforms = torch.rand(len(random_rows), generator=self.generator, dtype=torch.float64)
            for j, (i, p) in enumerate(zip(random_rows, chosen)):
                if p.seed is not None:
                    uniforms[j] = seeded_uniform(p.seed, num_outputs[i])
            tokens[rows] = _inverse_cdf(probs, uniforms.to(logits.device))
        token_list, broken = tokens_and_broken_rows(tokens, largest)
        if raw_logprobs is None:
            return SamplerOutput(token_list, None, broken)
        return SamplerOutput(token_list, _logprobs(raw_logprobs, wants_logprobs, params, token_list, len(states)),
                             broken)

    def _process(self, logits: torch.Tensor, states: list[SamplingState], params: list[SamplingParams],
                 token_ids: list[list[int]], num_outputs: list[int]) -> torch.Tensor:
        """logit_bias, the min_tokens mask and penalties, applied only to the rows that use them."""
        device = logits.device
        bias_rows = [i for i, p in enumerate(params) if p.logit_bias]
        if bias_rows:
            row_index = torch.cat([torch.full((len(states[i].bias_ids),), i) for i in bias_rows]).to(device)
            token_index = torch.cat([states[i].bias_ids for i in bias_rows]).to(device)
            logits.index_put_((row_index, token_index),
                              torch.cat([states[i].bias_values for i in bias_rows]).to(device), accumulate=True)
        masked = [(i, list(p.stop_token_ids) + ([] if p.ignore_eos else list(self.eos_token_ids)))
                  for i, p in enumerate(params) if num_outputs[i] < p.min_tokens]
        masked = [(i, ids) for i, ids in masked if ids]
        if masked:
            row_index = torch.tensor([i for i, ids in masked for _ in ids], device=device)
            token_index = torch.tensor([t for _, ids in masked for t in ids], device=device)
            logits[row_index, token_index] = float("-inf")
        penalized = [i for i, p in enumerate(params) if p.has_penalties]
        if penalized:
            vocab = logits.shape[1]
            tensors = [states[i].penalty_tensors(token_ids[i], vocab, device) for i in penalized]
            counts = torch.stack([c for c, _ in tensors])  # [R, vocab]
            seen = torch.stack([s for _, s in tensors])
            rows = torch.tensor(penalized, device=device)
            repetition = torch.tensor([params[i].repetition_penalty for i in penalized], device=device).unsqueeze(1)
            frequency = torch.tensor([params[i].frequency_penalty for i in penalized], device=device).unsqueeze(1)
            presence = torch.tensor([params[i].presence_penalty for i in penalized], device=device).unsqueeze(1)
            block = logits[rows]
            penalized_block = torch.where(block > 0, block / repetition, block * repetition)
            block = torch.where(seen, penalized_block, block)
            logits[rows] = block - frequency * counts - presence * (counts > 0).float()
        return logits


def _filtered_probabilities(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k, top-p and min-p filtering. logits: float [R, vocab]."""
    vocab, device = logits.shape[1], logits.device
    logits = logits / torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    k_values = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]  # decided on the host: no device sync
    top_k = torch.tensor(k_values, device=device)
    if min(k_values) < vocab:
        values = logits.topk(max(k_values), dim=-1).values
        kth = values.gather(1, (top_k - 1).clamp(max=values.shape[1] - 1).unsqueeze(1))
        kth = torch.where((top_k < vocab).unsqueeze(1), kth, torch.full_like(kth, float("-inf")))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Keep a token if the mass before it is below top_p (so the top token always stays).
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p
        drop_sorted[:, 0] = False  # even a top_p that rounds to 0 in float32 keeps the top token
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), 0.0)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Token index per row: the first whose cumulative probability exceeds u * total (float64, so tokens with
    zero probability are never drawn and the tail keeps its mass). probs [R, vocab], uniforms float64 [R]."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp(max=probs.shape[1] - 1)


def token_ranks(logprobs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """vLLM's logprob rank: how many tokens are at least as likely as the chosen one, itself included (ties share the
    worse rank). logprobs [R, vocab] float, chosen [R] or [R, 1] (each row's chosen logprob); returns int64 [R]."""
    return (logprobs >= chosen.reshape(-1, 1)).sum(dim=-1)


def _logprobs(raw: torch.Tensor, rows: list[int], params: list[SamplingParams], tokens: list[int],
              num_rows: int) -> list[TokenLogprobs | None]:
    """The sampled token's raw logprob, its rank and the k most likely, for the rows that asked (raw:
    [len(rows), vocab])."""
    out: list[TokenLogprobs | None] = [None] * num_rows
    k_max = max(params[i].logprobs or 0 for i in rows)  # (every row here asked: none is None)
    top = raw.topk(k_max, dim=-1) if k_max else None
    picked = raw.gather(1, torch.tensor([tokens[i] for i in rows], device=raw.device).unsqueeze(1))
    ranks = token_ranks(raw, picked)
    # one copy to the host for both (float64 holds either exactly)
    chosen, rank_values = torch.stack((picked.squeeze(1).double(), ranks.double())).tolist()
    top_ids = top.indices.tolist() if top is not None else []  # without top, every k is 0: never read
    top_values = top.values.tolist() if top is not None else []
    for j, i in enumerate(rows):
        k = params[i].logprobs
        out[i] = TokenLogprobs(logprob=chosen[j], top_token_ids=top_ids[j][:k] if k else [],
                               top_logprobs=top_values[j][:k] if k else [], rank=int(rank_values[j]))
    return out
