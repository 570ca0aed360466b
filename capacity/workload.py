"""Workloads for the simulator: when requests arrive and how long their prompts and outputs are.

Arrivals are Poisson (exponential gaps) or bursty (gamma gaps with shape `burstiness` < 1: the same mean rate,
more clustered; vLLM's benchmark uses the same parametrisation), or given by a JSONL trace. A closed-loop
workload (`max_concurrency`) sends a request only while fewer than that many are unfinished, as
`shuttle bench --max-concurrency` does.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Annotated

import msgspec
from msgspec import Meta

# A trace line's arrival bound and default output length (see TraceLine).
MAX_TRACE_ARRIVAL_S = 1e9
DEFAULT_TRACE_OUTPUT_LEN = 128


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


class TraceLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a JSONL trace; a key not declared here is refused, not ignored.

    Attributes:
        prompt: the prompt's token ids; or `prompt_len`: its length in tokens (random distinct ids).
        output_len: tokens to generate (`max_tokens` is the same field under the OpenAI name; default 128).
        arrival: seconds from the start (finite, at most 1e9 s: beyond it a float's step is no longer far below a
            millisecond); None: the line comes at the command's `--request-rate`.
        ttft_slo_ms: the request's own TTFT objective in ms, at most a day as a request's (0: the server's).
    """

    prompt: list[Annotated[int, Meta(ge=0)]] | None = None
    prompt_len: Annotated[int, Meta(ge=1)] | None = None
    output_len: Annotated[int, Meta(ge=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    arrival: Annotated[float, Meta(ge=0.0, le=MAX_TRACE_ARRIVAL_S)] | None = None
    ttft_slo_ms: Annotated[float, Meta(ge=0.0, le=86_400_000.0)] = 0.0


def _trace_line(text: str) -> TraceLine:
    """Decode one trace line. Raises ValueError: not a JSON object of TraceLine's fields, or a length given twice."""
    try:
        line = msgspec.json.decode(text, type=TraceLine)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ValueError(str(exc)) from None
    if (line.prompt is None) == (line.prompt_len is None):
        raise ValueError("needs one of `prompt` (a list of token ids) and `prompt_len`, not "
                         + ("both" if line.prompt is not None else "neither"))
    if line.prompt == []:
        raise ValueError("`prompt` is empty")
    if line.output_len is not None and line.max_tokens is not None:
        raise ValueError("gives both `output_len` and `max_tokens`, which are the same field")
    return line


def from_trace(path: str, rate: float | None = None, burstiness: float = 1.0, seed: int = 0,
               vocab_size: int = 32000) -> list[SimRequest]:
    """Read a JSONL trace: one `TraceLine` object per line. Lines without `arrival` get arrivals at `rate` (all at
    once if rate is None).

    Raises:
        ValueError: the file cannot be read or holds no request, or a line is not a JSON object of TraceLine's
            fields in their ranges (the message gives the file and line).
    """
    rng = random.Random(seed + 3)
    items = []
    try:
        lines = open(path).read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the trace {path!r}: {getattr(exc, 'strerror', None) or exc}") from None
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            line = _trace_line(text)
        except ValueError as exc:
            raise ValueError(f"{path}:{number}: {exc}") from None
        if line.prompt is not None:
            ids = line.prompt
        else:  # _trace_line: prompt_len is given when prompt is not
            ids = [1] + [rng.randrange(3, vocab_size) for _ in range(int(line.prompt_len or 1) - 1)]
        output_len = line.output_len or line.max_tokens or DEFAULT_TRACE_OUTPUT_LEN
        items.append((line.arrival, ids, output_len, line.ttft_slo_ms))
    if not items:
        raise ValueError(f"{path}: no requests in the trace")
    times = arrivals(len(items), rate or float("inf"), burstiness, seed)
    return [SimRequest(a if a is not None else t, ids, o, slo) for (a, ids, o, slo), t in zip(items, times)]
