"""Verification of n-gram drafts: which of a sequence's drafts the target model accepts, and the token after them.

Rejection sampling (Leviathan et al. 2023; Chen et al. 2023) for a deterministic draft (its distribution q is
one-hot at the draft x): row j's target distribution p is the sampler's own, processed exactly as the sampler
processes the logits at that output position (logit_bias, the min_tokens mask, temperature, top-k, top-p, min-p);
x is accepted with probability p(x), else the row's token is drawn from p with x removed, renormalized, and the
sequence stops there. When every draft is accepted, the last row gives the bonus token, drawn as the sampler draws.
Each output token is thus distributed as p: P(x) = p(x) + (1 - p(x)) * 0 and, for y != x, P(y) = (1 - p(x)) *
p(y) / (1 - p(x)). Greedy rows (p one-hot at the argmax) accept a draft while it equals the argmax: the output is
the one without speculation, token for token.

Randomness stays a function of (seed, position) for seeded requests: the draw at output position n uses the
sampler's uniform for n, the acceptance test an independent uniform keyed by (seed, n) under another salt.
"""

from __future__ import annotations

import torch

from shuttle.common.messages import TokenLogprobs
from shuttle.worker.input_batch import CachedRequestState
from shuttle.worker.sampler import (
    LOGPROB_FLOOR,
    Sampler,
    _filtered_probabilities,
    _inverse_cdf,
    _logprobs,
    seeded_uniform,
    tokens_and_broken_rows,
)

ACCEPT_SALT = 0x5DEECE66D  # keys the acceptance test's uniforms apart from the draw's


def verify_drafts(sampler: Sampler, logits: torch.Tensor, requests: list[CachedRequestState]
                  ) -> list[tuple[list[int], list[TokenLogprobs | None], bool]]:
    """The tokens each request gains: its accepted drafts, then the target's token (1 to 1 + len(drafts) tokens).

    Args:
        sampler: the worker's sampler (its generator draws for unseeded requests).
        logits: float [R, vocab], R = sum of 1 + len(drafts); a request's rows consecutive, row j the target's
            logits after its last known token and its first j drafts.
        requests: the verifying requests, in row order (none has a grammar or penalties: the scheduler does not
            speculate for those).
    Returns:
        per request (token ids, logprobs per token: the target's raw logprobs, None entries when not asked, broken:
        whether a row it used holds NaN or +inf logits, sampler.tokens_and_broken_rows; its tokens mean nothing).
    """
    states, params, histories, num_outputs = [], [], [], []
    verifies: list[int] = []  # per row, the draft it verifies (0 on a request's last row: none)
    for state in requests:
        known = state.token_ids
        for j in range(len(state.draft_token_ids) + 1):
            verifies.append(state.draft_token_ids[j] if j < len(state.draft_token_ids) else 0)
            states.append(state.sampling)
            params.append(state.sampling.params)
            histories.append(known)  # read by penalties alone, and requests with penalties never speculate
            num_outputs.append(len(known) + j - state.sampling.prompt_len)
    logits = logits.float()
    wants = [i for i, p in enumerate(params) if p.logprobs is not None]
    raw = logits[wants].log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR) if wants else None
    processed = sampler._process(logits, states, params, histories, num_outputs)
    largest, best = torch.max(processed, dim=-1)  # as greedy_tokens
    argmax, broken_rows = tokens_and_broken_rows(best, largest)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    probs: dict[int, torch.Tensor] = {}
    draft_prob: dict[int, tuple[float, float]] = {}  # row -> (p of its draft, total mass), read in one copy
    if random_rows:
        filtered = _filtered_probabilities(processed[random_rows], [params[i] for i in random_rows])
        probs = dict(zip(random_rows, filtered))
        drafts_at = torch.tensor([verifies[i] for i in random_rows], device=filtered.device)
        chosen = filtered.gather(1, drafts_at.unsqueeze(1)).squeeze(1)
        draft_prob = dict(zip(random_rows, zip(chosen.tolist(), filtered.sum(dim=-1).tolist())))
    out_tokens: list[list[int]] = []
    out_rows: list[list[int]] = []
    row = 0
    for state in requests:
        drafts, p = state.draft_token_ids, state.sampling.params
        tokens: list[int] = []
        rows: list[int] = []
        for j in range(len(drafts) + 1):
            i = row + j
            rows.append(i)
            if p.greedy:
                tokens.append(argmax[i])
                if j == len(drafts) or drafts[j] != argmax[i]:
                    break
                continue
            dist = probs[i]
            draw = _uniform(sampler, p.seed, num_outputs[i])
            if j == len(drafts):  # every draft accepted: the bonus token, drawn as the sampler draws
                tokens.append(int(_inverse_cdf(dist.unsqueeze(0), draw.to(dist.device).unsqueeze(0))[0]))
                break
            x = drafts[j]
            p_x, total = draft_prob[i]
            if float(_uniform(sampler, None if p.seed is None else p.seed ^ ACCEPT_SALT, num_outputs[i])) * total < p_x:
                tokens.append(x)
                continue
            residual = dist.clone()
            residual[x] = 0.0
            tokens.append(int(_inverse_cdf(residual.unsqueeze(0), draw.to(dist.device).unsqueeze(0))[0]))
            break
        row += len(drafts) + 1
        out_tokens.append(tokens)
        out_rows.append(rows)
    flat_rows = [i for rows in out_rows for i in rows]
    flat_tokens = [t for tokens in out_tokens for t in tokens]
    logprobs: list[TokenLogprobs | None] = [None] * len(flat_rows)
    if raw is not None:
        asked = [k for k, i in enumerate(flat_rows) if params[i].logprobs is not None]
        if asked:
            picked = raw[[wants.index(flat_rows[k]) for k in asked]]
            found = _logprobs(picked, list(range(len(asked))), [params[flat_rows[k]] for k in asked],
                              [flat_tokens[k] for k in asked], len(asked))
            for k, entry in zip(asked, found):
                logprobs[k] = entry
    result, offset = [], 0
    broken = set(broken_rows)
    for tokens, rows in zip(out_tokens, out_rows):
        result.append((tokens, logprobs[offset:offset + len(tokens)], not broken.isdisjoint(rows)))
        offset += len(tokens)
    return result


def _uniform(sampler: Sampler, seed: int | None, position: int) -> torch.Tensor:
    """float64 scalar in (0, 1): a function of (seed, position) when seeded, else from the sampler's generator."""
    if seed is not None:
        return torch.tensor(seeded_uniform(seed, position), dtype=torch.float64)
    return torch.rand((), generator=sampler.generator, dtype=torch.float64)
