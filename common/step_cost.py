"""How long one step takes, as a function of its shape: the cost model behind the simulator and SLO admission.

A step's wall time on the worker is modelled as a non-negative linear combination of what it computes:

    seconds = c_step                                   fixed cost per step (launch, packing, messaging, Python)
            + c_token     * tokens                     linear layers, norms, RoPE: every scheduled token
            + c_prefill   * prefill sequences          per-sequence attention set-up of a prefill chunk
            + c_decode    * decode sequences           per-sequence cost of a decode (paged kernel, bookkeeping)
            + c_prefill_attention * sum(q_i * k_i)     prefill attention: chunk length q times context k
            + c_decode_attention  * sum(k_i)           decode attention reads the whole context once
            + c_sampled   * sampled rows               LM head at sampling positions + the sampler
            + c_token_squared * tokens * prompt tokens  larger prefill steps cost more per token

This is the roofline-free form of the models in the literature on LLM serving simulators (Vidur, Agrawal et al.
2024; DistServe's latency model, Zhong et al. 2024): linear in tokens, with an attention term quadratic in the
chunk. Coefficients are fitted by non-negative least squares on relative error (a 1 ms decode step matters as
much as a 500 ms prefill) from measurements of the real ModelRunner (scripts/calibrate.py) or, online, from the
server's own steps (scheduler/admission.py). No torch here: the scheduler process uses it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence


FEATURES = ("step", "token", "prefill_seq", "decode_seq", "prefill_attention", "decode_attention", "sampled",
            "token_squared")


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

    def features(self) -> tuple[float, ...]:
        """The regressors in FEATURES order (the first is the constant 1).

        The last, tokens x prompt tokens (0 for a step of decodes, tokens squared for a step of prompts), is why a
        step of prompts costs more per token the larger it is: its activations (tokens x the MLP's width) outgrow
        the CPU's caches. Measured in process on the 110M shape here: 2.7 ms per token in a step of 1,016 tokens,
        3.0 in one of 2,048, with about the same attention pairs (1.0M); the served first steps of a burst ran
        25-36% over a model without it."""
        prompt_tokens = self.num_tokens - self.num_decode_seqs
        return (1.0, self.num_tokens, self.num_prefill_seqs, self.num_decode_seqs, self.prefill_attention,
                self.decode_attention, self.num_sampled, float(self.num_tokens * prompt_tokens))


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
        coefficients: seconds per unit of each of FEATURES (all >= 0), as the worker takes them.
        scheduler_s: scheduler CPU seconds per step (plan + settle), spent while the worker runs the step before
            (hidden with two steps in flight unless it exceeds the step).
        client_s: seconds a token spends between the worker and its client, added to each token time.
        meta: where and how it was measured (model, dtype, threads, rmse).

    Raises:
        ValueError: an unknown feature, or a negative coefficient or latency.
    """

    coefficients: dict[str, float]
    scheduler_s: float = 0.0
    client_s: float = 0.0
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost model features {sorted(unknown)}; known: {FEATURES}")
        negative = [name for name in _SCALARS if not getattr(self, name) >= 0]
        negative += [f"coefficient {name}" for name, c in self.coefficients.items() if not c >= 0]
        if negative:  # every one is seconds: a negative one is a bad file
            raise ValueError(f"negative or missing values: {', '.join(negative)}")
        self._weights = tuple(float(self.coefficients.get(name, 0.0)) for name in FEATURES)

    def predict(self, shape: StepShape) -> float:
        """Seconds the worker takes for a step of this shape (0 for an empty step)."""
        if shape.num_tokens == 0:
            return 0.0
        return sum(w * x for w, x in zip(self._weights, shape.features()))

    def decode_run(self, num_seqs: int, context_sum: int, num_steps: int) -> float:
        """Seconds for `num_steps` consecutive decode steps of `num_seqs` sequences whose contexts sum to
        `context_sum` in the first step and grow by one token each per step (closed form of the sum)."""
        if num_steps <= 0 or num_seqs <= 0:
            return 0.0
        first = self.predict(StepShape(num_seqs, 0, num_seqs, 0, context_sum, num_seqs))
        growth = self._weights[FEATURES.index("decode_attention")] * num_seqs  # per step, from longer contexts
        return num_steps * first + growth * num_steps * (num_steps - 1) / 2

    # ---- persistence ------------------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"coefficients": dict(self.coefficients), **{name: getattr(self, name) for name in _SCALARS},
                "meta": self.meta}

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
            floats = {name: float(data[name]) for name in _SCALARS if name in data}
            return StepCostModel({name: float(c) for name, c in data["coefficients"].items()},
                                 meta=dict(data.get("meta", {})), **floats)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path} is not a step-cost profile (scripts/calibrate.py writes them): {exc}") from None

    # ---- fitting ----------------------------------------------------------------------------------------

    @staticmethod
    def fit(shapes: Sequence[StepShape], seconds: Sequence[float], **kwargs) -> "StepCostModel":
        """Non-negative least squares on relative error: minimise sum(((x_i . c) - y_i) / y_i)^2 with c >= 0.

        Features that never vary in the data (all zero) get coefficient 0. Other keyword arguments go to the
        model (scheduler_s, client_s, meta); meta gains the fit's relative RMS error ("rel_rmse").

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
        x = np.asarray([s.features() for s in shapes], dtype=np.float64) / y[:, None]  # relative-error rows
        # columns scaled to unit norm: features of very different magnitudes (tokens vs token pairs) alike
        scale = np.linalg.norm(x, axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale, np.ones_like(y))[0] / scale
        model = StepCostModel(dict(zip(FEATURES, (float(c) for c in coef))), **kwargs)
        predicted = np.asarray([model.predict(s) for s in shapes])
        model.meta = {**model.meta, "rel_rmse": float(math.sqrt(float(np.mean(((predicted - y) / y) ** 2)))),
                      "num_measurements": len(shapes)}
        return model


_SCALARS = ("scheduler_s", "client_s")
