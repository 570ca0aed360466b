"""Prompt-lookup drafts: a sequence's next tokens guessed from an earlier occurrence of its last tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft token ids: the tokens that followed the earliest earlier occurrence of the longest suffix of
    `token_ids` (prompt + output) between `min_n` and `max_n` tokens long; [] when no such suffix occurred before.

    The earliest occurrence leaves the most tokens after it to propose. Cost: one vectorized pass over the tokens
    (where the last token occurred before), then a pass over those candidates per suffix length.
    """
    num = len(token_ids)
    if k < 1 or num < min_n + 1:
        return []
    tokens = token_ids if isinstance(token_ids, np.ndarray) else np.asarray(token_ids, dtype=np.int64)
    # ends[i]: an earlier position where the last token occurred; a suffix of length n matches there when the
    # n - 1 tokens before it match too
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])
    longest = 1
    matched = ends
    best = ends if min_n <= 1 else ends[:0]
    for n in range(2, min(max_n, num - 1) + 1):
        matched = matched[matched >= n - 1]
        matched = matched[tokens[matched - (n - 1)] == tokens[num - n]]
        if not matched.size:
            break
        longest = n
        if n >= min_n:
            best = matched
    if not best.size or longest < min_n:
        return []
    start = int(best[0]) + 1
    return tokens[start:start + k].tolist()
