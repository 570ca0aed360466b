"""Prompt-lookup drafts: a sequence's next tokens guessed from an earlier occurrence of its last tokens."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft token ids: the tokens that followed the earliest earlier occurrence of the longest suffix of
    `token_ids` (prompt + output) between `min_n` and `max_n` tokens long; [] when no such suffix occurred before.

    The earliest occurrence leaves the most tokens after it to propose. Cost: O(len * n) per suffix length tried.
    """
    num = len(token_ids)
    if k < 1 or num < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # windows of tokens[:-1] never include the suffix itself, so a hit is an earlier occurrence
        windows = sliding_window_view(tokens[:-1], n)
        hits = np.flatnonzero((windows == tokens[num - n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start:start + k].tolist()
    return []
