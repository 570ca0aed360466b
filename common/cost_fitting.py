"""The numerics of fitting step costs (common/step_cost.py, capacity/serving_fit.py): non-negative least squares,
and how much of served steps' spread persists from step to step."""

from __future__ import annotations


def jitter_persistence(log_ratio, seconds) -> tuple[float, float]:
    """How much of served steps' spread persists, and for how long: (jitter_slow_share, jitter_memory_s).

    log_ratio: [n] float64, log(served / predicted) of consecutive steps; seconds: [n] their served durations.
    The share is the mean autocorrelation at lags 1-3 (an independent factor per step has none); the memory is the
    integral time scale of the autocorrelation (the sum of the correlations, over the share, up to the first lag
    where it is no longer positive: the time constant of an exponential decay) times the mean step. Fewer than
    40 steps, or a share under 0.05, give (0, 0): independent steps."""
    import numpy as np

    r = np.asarray(log_ratio, dtype=np.float64)
    r = r - r.mean()
    variance = float(np.mean(r * r))
    if len(r) < 40 or variance <= 0:
        return 0.0, 0.0
    lags = range(1, min(len(r) // 4, 1000))  # a served log may hold a day of steps: the decay is long over by then
    correlation = [float(np.mean(r[:-lag] * r[lag:])) / variance for lag in lags]
    share = min(1.0, sum(correlation[:3]) / 3)
    if share < 0.05:
        return 0.0, 0.0
    positive = correlation[:next((i for i, c in enumerate(correlation) if c <= 0), len(correlation))]
    return share, float(sum(positive) / share * np.mean(seconds))


def nonnegative_least_squares(a, b):
    """argmin ||a c - b|| subject to c >= 0, by Lawson and Hanson's active-set method ("Solving Least Squares
    Problems", 1974, ch. 23). a: [m, n] float64 array, b: [m]. Returns c [n]. Columns are scaled to unit norm
    first, so features of very different magnitudes (tokens vs token pairs) converge alike."""
    import numpy as np

    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    a = a / scale
    m, n = a.shape
    passive = np.zeros(n, dtype=bool)
    c = np.zeros(n)
    gradient = a.T @ (b - a @ c)
    for _ in range(3 * n):
        if passive.all() or gradient[~passive].max(initial=-np.inf) <= 1e-12:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            trial = np.zeros(n)
            trial[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (trial[passive] > 0).all():
                c = trial
                break
            # step from c towards trial until the first passive coefficient reaches zero, then drop it
            shrinking = passive & (trial <= 0)
            alpha = np.min(c[shrinking] / (c[shrinking] - trial[shrinking] + 1e-300))
            c = c + alpha * (trial - c)
            passive &= c > 1e-15
            c[~passive] = 0.0
        gradient = a.T @ (b - a @ c)
    return c / scale
