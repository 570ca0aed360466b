"""Workloads for the simulator: when requests arrive and how long their prompts and outputs are.

Arrivals are Poisson (exponential gaps) or bursty (gamma gaps with shape `burstiness` < 1: the same mean rate,
more clustered; vLLM's benchmark uses the same parametrisation), or given by a JSONL trace. A closed-loop
workload (`max_concurrency`) sends a request only while fewer than that many are unfinished, as
`shuttle bench --max-concurrency` does.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass(slots=True)
class SimRequest:
    """One request of a workload.

    Attributes:
        arrival: seconds from the start when the client sends it (with max_concurrency: the earliest it may).
        prompt_token_ids: the prompt (its content matters only to the prefix cache).
        output_len: tokens it generates (max_tokens, with ignore_eos).
        ttft_slo_ms: the request's own TTFT objective (0: the server's).
    """

    arrival: float
    prompt_token_ids: list[int]
    output_len: int
    ttft_slo_ms: float = 0.0


def arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (seconds) of `n` requests at mean `rate` per second; rate inf means all at time 0.
    burstiness 1 is Poisson; below 1 burstier, above 1 more regular (gamma-distributed gaps).

    Raises:
        ValueError: rate or burstiness not positive.
    """
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive, got {rate} and {burstiness}")
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed)
    times, now = [], 0.0
    for _ in range(n):
        times.append(now)
        now += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def uniform_lengths(n: int, mean: int, range_ratio: float, seed: int) -> list[int]:
    """Lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1 (`shuttle bench`'s distribution)."""
    rng = random.Random(seed)
    return [max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio)))) for _ in range(n)]


def synthetic(n: int, rate: float, input_len: int, output_len: int, range_ratio: float = 0.5,
              burstiness: float = 1.0, vocab_size: int = 32000, seed: int = 0) -> list[SimRequest]:
    """`n` requests with random distinct prompts and uniform lengths, arriving at `rate` per second."""
    times = arrivals(n, rate, burstiness, seed)
    prompts = uniform_lengths(n, input_len, range_ratio, seed + 1)
    outputs = uniform_lengths(n, output_len, range_ratio, seed + 2)
    rng = random.Random(seed + 3)
    return [SimRequest(t, [1] + [rng.randrange(3, vocab_size) for _ in range(p)], o)
            for t, p, o in zip(times, prompts, outputs)]


def from_trace(path: str, rate: float | None = None, burstiness: float = 1.0, seed: int = 0,
               vocab_size: int = 32000) -> list[SimRequest]:
    """Read a JSONL trace: one object per line with the prompt (`prompt` as token ids, or `prompt_len`), the
    output length (`output_len` or `max_tokens`, default 128), optionally `arrival` seconds and `ttft_slo_ms`.
    Lines without `arrival` get arrivals at `rate` (all at once if rate is None).

    Raises:
        ValueError: the file cannot be read or holds no request, or a line is not a JSON object, names no prompt,
            or has a field that is not a number in its range (the message gives the file and line).
    """
    rng = random.Random(seed + 3)
    items = []
    try:
        lines = open(path).read().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read the trace {path!r}: {exc.strerror or exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{number}: not a JSON object")

        def number_of(field: str, default, kind, least: float):  # called in this iteration only
            try:
                value = kind(item.get(field, default))  # noqa: B023
            except (TypeError, ValueError):
                value = None
            if value is None or not value >= least:
                raise ValueError(f"{path}:{number}: `{field}` must be a number >= {least}, "  # noqa: B023
                                 f"got {item.get(field)!r}")  # noqa: B023
            return value

        prompt = item.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
            ids = list(prompt)
        elif "prompt_len" in item:
            ids = [1] + [rng.randrange(3, vocab_size) for _ in range(number_of("prompt_len", None, int, 1) - 1)]
        else:
            raise ValueError(f"{path}:{number}: needs `prompt` (a list of token ids) or `prompt_len`")
        output_field = "output_len" if "output_len" in item else "max_tokens"
        items.append((number_of("arrival", 0.0, float, 0.0) if "arrival" in item else None, ids,
                      number_of(output_field, 128, int, 1), number_of("ttft_slo_ms", 0.0, float, 0.0)))
    if not items:
        raise ValueError(f"{path}: no requests in the trace")
    times = arrivals(len(items), rate or float("inf"), burstiness, seed)
    return [SimRequest(a if a is not None else t, ids, o, slo) for (a, ids, o, slo), t in zip(items, times)]
