"""How long one step takes, as a function of its shape and the hardware: the cost model behind the simulator and
SLO admission.

A step's wall time on the worker is a roofline (Williams, Waterman and Patterson, "Roofline: an insightful visual
performance model for multicore architectures", CACM 52(4), 2009) plus fixed costs, combined with non-negative
coefficients fitted on the serving machine:

    seconds = c_step                                  fixed cost per step (launch, packing, messaging, Python)
            + c_sequence * sequences                  per-sequence bookkeeping (metadata, block tables)
            + c_prefill_sequence * prefill sequences  what a prompt's chunk costs beyond that (a CPU backend attends
                                                      prefill rows one sequence at a time, decodes in one kernel)
            + c_token    * tokens                     per-token work that is neither FLOPs nor weight reads
            + c_dense    * max(dense FLOPs / peak FLOP/s, dense bytes / bandwidth)
            + c_prefill_attention * prefill attention FLOPs / peak FLOP/s
            + c_decode_attention  * max(decode attention FLOPs / peak, KV bytes read / bandwidth)

The dense part is every linear layer for every token (weights read once per step, so a step of decodes is
memory-bound and a long prefill compute-bound) and the LM head at the sampled rows; the attention parts count token
pairs (a prefill chunk of q tokens over a context of k: q x k pairs; a decode reads its whole context once). The
FLOPs and bytes come from the model's shape (Roofline: hidden size, layers, heads, KV heads, head dim, MLP width,
vocabulary, dtype) and the device's peak FLOP/s and memory bandwidth (measured on the serving machine, or a
datasheet's: capacity/hardware.py), so the three c_ of the roofline terms are dimensionless (1 / the efficiency
reached) and carry over between devices of a kind, while the fixed costs are the host's. Without a Roofline (an
online fit of a server that was given no profile) each roofline term is its raw count instead: tokens, token pairs,
context tokens, at one second per unit. Coefficients are fitted by non-negative least squares on relative error (a
1 ms decode step matters as much as a 500 ms prefill) from the real ModelRunner (`shuttle calibrate`) or, online,
from the server's own steps (scheduler/admission.py). No torch here: the scheduler process uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

FEATURES = ("step", "sequence", "prefill_sequence", "token", "dense", "prefill_attention", "decode_attention")


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one step computes. Counts are tokens or sequences; attention terms are token pairs.

    Attributes:
        num_tokens: tokens scheduled in the step (prefill chunks + decodes).
        num_prefill_seqs: sequences computing more than one token.
        num_decode_seqs: sequences computing exactly one token.
        prefill_attention: sum over prefill sequences of chunk length x context length after the chunk.
        decode_attention: sum over decode sequences of their context length.
        num_sampled: sequences that sample a token (logits rows).
    """

    num_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    prefill_attention: int = 0
    decode_attention: int = 0
    num_sampled: int = 0


@dataclass(frozen=True, slots=True)
class Roofline:
    """A model's shape on a device: what turns a StepShape into FLOPs, bytes and roofline seconds.

    Attributes:
        hidden, layers, heads, kv_heads, head_dim, intermediate, vocab: the model's dimensions (a gated MLP of
            width `intermediate`, as Llama's).
        dtype_bytes: bytes per weight and per KV element.
        peak_flops: the device's dense FLOP/s in that dtype.
        bandwidth: the device's memory bandwidth in bytes/s.
        device: the device's name (what measured or specified the two peaks).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int
    peak_flops: float
    bandwidth: float
    device: str = ""

    def __post_init__(self):
        bad = [f"{name} {getattr(self, name)!r}" for name in _ROOFLINE_NUMBERS if not getattr(self, name) > 0]
        if bad:
            raise ValueError(f"a roofline needs positive dimensions and peaks, got {', '.join(bad)}")

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer's linear maps (q, k, v, o and the gated MLP's three)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def dense_flops(self, shape: StepShape) -> float:
        """2 FLOPs per weight per token, and the LM head at the sampled rows."""
        return 2.0 * (shape.num_tokens * self.layers * self.layer_params + shape.num_sampled * self.hidden * self.vocab)

    def dense_bytes(self, shape: StepShape) -> float:
        """Every weight read once per step, the step's K and V written, and the logits of the sampled rows."""
        weights = (self.layers * self.layer_params + self.hidden * self.vocab) * self.dtype_bytes
        return float(weights + shape.num_tokens * self.kv_bytes_per_token + 4 * shape.num_sampled * self.vocab)

    def attention_flops(self, pairs: int) -> float:
        """Q K^T and P V: 2 x 2 FLOPs per (query, key) pair per head dimension, over all heads and layers."""
        return 4.0 * self.layers * self.heads * self.head_dim * pairs

    def seconds(self, shape: StepShape) -> tuple[float, float, float]:
        """Roofline seconds of the (dense, prefill attention, decode attention) parts of a step."""
        dense = max(self.dense_flops(shape) / self.peak_flops, self.dense_bytes(shape) / self.bandwidth)
        prefill = self.attention_flops(shape.prefill_attention) / self.peak_flops
        decode = max(self.attention_flops(shape.decode_attention) / self.peak_flops,
                     shape.decode_attention * self.kv_bytes_per_token / self.bandwidth)
        return dense, prefill, decode

    def to_json(self) -> dict:
        return {name: getattr(self, name) for name in (*_ROOFLINE_NUMBERS, "device")}

    @staticmethod
    def from_json(data: dict) -> "Roofline":
        """Raises ValueError or TypeError on a missing or bad entry."""
        numbers: dict[str, Any] = {name: (int if name in _ROOFLINE_INTS else float)(data[name])
                                   for name in _ROOFLINE_NUMBERS}  # by field name: the ints and the floats
        return Roofline(**numbers, device=str(data.get("device", "")))


_ROOFLINE_INTS = ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "dtype_bytes")
_ROOFLINE_NUMBERS = (*_ROOFLINE_INTS, "peak_flops", "bandwidth")


def features(shape: StepShape, roofline: Roofline | None) -> tuple[float, ...]:
    """The regressors in FEATURES order (the first is the constant 1); without a roofline its three terms are the
    raw counts (tokens, prefill pairs, decode context tokens)."""
    if roofline is None:
        dense, prefill, decode = float(shape.num_tokens), float(shape.prefill_attention), float(shape.decode_attention)
    else:
        dense, prefill, decode = roofline.seconds(shape)
    return (1.0, float(shape.num_prefill_seqs + shape.num_decode_seqs), float(shape.num_prefill_seqs),
            float(shape.num_tokens), dense, prefill, decode)


def shape_of(chunks: Iterable[tuple[int, int, bool]]) -> StepShape:
    """The shape of a step from its sequences' (start, num_new, samples): tokens [start, start + num_new) are
    computed, attending over start + num_new tokens of context."""
    tokens = prefill = decode = prefill_attn = decode_attn = sampled = 0
    for start, num_new, samples in chunks:
        tokens += num_new
        context = start + num_new
        if num_new == 1:
            decode += 1
            decode_attn += context
        else:
            prefill += 1
            prefill_attn += num_new * context
        sampled += samples
    return StepShape(tokens, prefill, decode, prefill_attn, decode_attn, sampled)


@dataclass
class StepCostModel:
    """Seconds per step from its StepShape, plus the fixed latencies around steps that clients feel.

    Attributes:
        coefficients: each of FEATURES' coefficient (all >= 0): seconds per step, sequence and token; the roofline
            terms' multipliers (or, without a roofline, seconds per token, pair and context token).
        roofline: the model on the device (None: raw counts, as an online fit without a profile has).
        scheduler_s: scheduler CPU seconds per step (plan + settle), spent while the worker runs the step before
            (hidden with two steps in flight unless it exceeds the step).
        scheduler_sequence_s: and per sequence of the step (the scheduler books and settles each one).
        client_s: seconds a token spends between the worker and its client, added to each token time.
        spread: how much one step's time varies around the prediction for its shape on the calibrated machine:
            quantiles of (a step's seconds / the median seconds of its shape) at probabilities (i + 0.5) / n,
            ascending (`shuttle calibrate` measures them; empty: every step takes exactly its prediction). The
            simulator draws each step's factor from them (capacity/simulator.py); `predict` never uses them.
        meta: where and how it was measured (model, dtype, threads, rmse).

    Raises:
        ValueError: an unknown feature, a negative coefficient or latency, or a spread that is not ascending
            positive factors.
    """

    coefficients: dict[str, float]
    roofline: Roofline | None = None
    scheduler_s: float = 0.0
    scheduler_sequence_s: float = 0.0
    client_s: float = 0.0
    spread: tuple[float, ...] = ()
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost model features {sorted(unknown)}; known: {FEATURES}")
        negative = [name for name in _SCALARS if not getattr(self, name) >= 0]
        negative += [f"coefficient {name}" for name, c in self.coefficients.items() if not c >= 0]
        if negative:  # every one is seconds: a negative one is a bad file
            raise ValueError(f"negative or missing values: {', '.join(negative)}")
        self.spread = tuple(float(q) for q in self.spread)
        if not all(q > 0 for q in self.spread) or list(self.spread) != sorted(self.spread):
            raise ValueError(f"spread must be ascending positive factors, got {list(self.spread)}")
        self._weights = tuple(float(self.coefficients.get(name, 0.0)) for name in FEATURES)

    def predict(self, shape: StepShape) -> float:
        """Seconds the worker takes for a step of this shape (0 for an empty step)."""
        if shape.num_tokens == 0:
            return 0.0
        return sum(w * x for w, x in zip(self._weights, features(shape, self.roofline)))

    def scheduler_seconds(self, shape: StepShape) -> float:
        """The scheduler's CPU seconds to plan and settle a step of this shape."""
        return self.scheduler_s + self.scheduler_sequence_s * (shape.num_prefill_seqs + shape.num_decode_seqs)

    def spread_factor(self, u: float) -> float:
        """The step-time factor at probability `u` in [0, 1) of the spread (linear between its quantiles, its
        ends held beyond them); 1.0 without a spread."""
        spread = self.spread
        if not spread:
            return 1.0
        x = u * len(spread) - 0.5  # quantile i sits at probability (i + 0.5) / n
        i = min(max(int(math.floor(x)), 0), len(spread) - 1)
        j = min(i + 1, len(spread) - 1)
        w = min(max(x - i, 0.0), 1.0)
        return spread[i] + (spread[j] - spread[i]) * w

    def decode_run(self, num_seqs: int, context_sum: int, num_steps: int) -> float:
        """Seconds for `num_steps` consecutive decode steps of `num_seqs` sequences whose contexts sum to
        `context_sum` in the first step and grow by one token each per step (closed form of the sum)."""
        if num_steps <= 0 or num_seqs <= 0:
            return 0.0
        first = self.predict(StepShape(num_seqs, 0, num_seqs, 0, context_sum, num_seqs))
        # per step, from longer contexts: the decode attention term is linear in the context
        growth = self.predict(StepShape(num_seqs, 0, num_seqs, 0, context_sum + num_seqs, num_seqs)) - first
        return num_steps * first + growth * num_steps * (num_steps - 1) / 2

    # ---- persistence ------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"coefficients": dict(self.coefficients), **{name: getattr(self, name) for name in _SCALARS},
                "roofline": self.roofline.to_json() if self.roofline else None,
                "spread": [round(q, 4) for q in self.spread], "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @staticmethod
    def load(path: str | Path) -> "StepCostModel":
        """Read a profile written by `save()`.

        Raises:
            ValueError: the file cannot be read, is not JSON, or is not a valid profile (the message says which
                and names the file).
        """
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ValueError(f"cannot read the step-cost profile {str(path)!r}: {exc.strerror or exc}") from None
        except ValueError as exc:
            raise ValueError(f"{path} is not JSON: {exc}") from None
        try:
            if not isinstance(data, dict) or not isinstance(data.get("coefficients"), dict):
                raise ValueError("it holds no `coefficients` object")
            if not data["coefficients"]:  # every step would take no time: nothing it predicts would mean anything
                raise ValueError("its `coefficients` object is empty")
            floats = {name: float(data[name]) for name in _SCALARS if name in data}
            roofline = Roofline.from_json(data["roofline"]) if data.get("roofline") is not None else None
            return StepCostModel({name: float(c) for name, c in data["coefficients"].items()}, roofline,
                                 spread=tuple(data.get("spread", ())), meta=dict(data.get("meta", {})), **floats)
        except (ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path} is not a step-cost profile (`shuttle calibrate` writes them): {exc}") from None

    # ---- fitting ----------------------------------------------------------------------------------------

    @staticmethod
    def fit(shapes: Sequence[StepShape], seconds: Sequence[float], **kwargs) -> "StepCostModel":
        """Non-negative least squares on relative error: minimise sum(((x_i . c) - y_i) / y_i)^2 with c >= 0.

        Features that never vary in the data (all zero) get coefficient 0. Other keyword arguments go to the
        model (roofline, scheduler_s, scheduler_sequence_s, client_s, spread, meta); meta gains the fit's relative RMS
        error ("rel_rmse").

        Raises:
            ValueError: fewer measurements than features, or a non-positive duration.
        """
        import numpy as np  # only the fit needs them
        from scipy.optimize import nnls

        if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} (shape, seconds) pairs, got {len(shapes)}")
        y = np.asarray(seconds, dtype=np.float64)
        if (y <= 0).any():
            raise ValueError("step durations must be positive")
        roofline = kwargs.get("roofline")
        x = np.asarray([features(s, roofline) for s in shapes], dtype=np.float64) / y[:, None]  # relative-error rows
        # columns scaled to unit norm: features of very different magnitudes (tokens vs token pairs) alike
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale, np.ones_like(y))[0] / scale
        model = StepCostModel(dict(zip(FEATURES, (float(c) for c in coef))), **kwargs)
        predicted = np.asarray([model.predict(s) for s in shapes])
        model.meta = {**model.meta, "rel_rmse": float(math.sqrt(float(np.mean(((predicted - y) / y) ** 2)))),
                      "num_measurements": len(shapes)}
        return model


_SCALARS = ("scheduler_s", "scheduler_sequence_s", "client_s")


def spread_of(ratios: Sequence[float], quantiles: int = 40) -> tuple[float, ...]:
    """The `spread` of step times from their ratios to their shape's median: `quantiles` values at probabilities
    (i + 0.5) / quantiles, read from the sorted ratios by linear interpolation (empty for no ratios)."""
    ordered = sorted(ratios)
    if not ordered:
        return ()
    last = len(ordered) - 1
    out = []
    for i in range(quantiles):
        x = (i + 0.5) / quantiles * last
        lo = int(math.floor(x))
        hi = min(lo + 1, last)
        out.append(ordered[lo] + (ordered[hi] - ordered[lo]) * (x - lo))
    return tuple(out)


def fit_scheduler_seconds(shapes: Sequence[StepShape], seconds: Sequence[float]) -> tuple[float, float]:
    """(seconds per step, seconds per sequence) of the scheduler's plan + settle, by non-negative least squares on
    relative error over measured steps (scipy.optimize.nnls); (0, 0) for no steps."""
    import numpy as np
    from scipy.optimize import nnls

    y = np.asarray(seconds, dtype=np.float64)
    keep = y > 0
    if not keep.any():
        return 0.0, 0.0
    x = np.asarray([(1.0, s.num_prefill_seqs + s.num_decode_seqs) for s in shapes], dtype=np.float64)[keep]
    x, y = x / y[keep][:, None], np.ones(int(keep.sum()))
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    per_step, per_sequence = nnls(x / scale, y)[0] / scale
    return float(per_step), float(per_sequence)
