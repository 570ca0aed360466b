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

A served step also shares the machine with the frontend, the scheduler and the clients. calibrate.py's serving stage
measures how much that changes each kind of work, and the model keeps the in-process fit and those corrections
apart:

    served seconds = decode_factor  x (c_step + decode terms + c_sampled x sampled rows)
                   + prefill_factor x (c_token x prompt tokens + c_prefill x prefill sequences + prefill attention
                                       + c_token_squared x tokens x prompt tokens)
                   + serving_step_s + serving_token_s x sampled rows

(decode terms: (c_token + c_decode) per decode sequence and the decode attention). Decode steps read every weight
for a few rows and are memory-bound; prefill chunks are compute-bound: beside a busy frontend they slow down by
different amounts, so one factor for both mispredicts one of them. And every sampled token is then streamed by the
frontend to its client, work that competes with the worker for the cores while the next steps run.

This is the roofline-free form of the models in the literature on LLM serving simulators (Vidur, Agrawal et al.
2024; DistServe's latency model, Zhong et al. 2024): linear in tokens, with an attention term quadratic in the
chunk. Coefficients are fitted by non-negative least squares on relative error (a 1 ms decode step matters as
much as a 500 ms prefill) from measurements of the real ModelRunner (scripts/calibrate.py) or, online, from the
server's own steps (scheduler/admission.py). No torch here: the scheduler process uses it.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from common.cost_fitting import jitter_persistence, nonnegative_least_squares

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
        coefficients: seconds per unit of each of FEATURES (all >= 0), as the worker takes them alone.
        scheduler_s: scheduler CPU seconds per step (plan + settle + encode), spent while the worker runs the
            step before (hidden with two steps in flight unless it exceeds the step).
        client_s: seconds a token spends between the worker and the client (IPC, detokenize, HTTP), added to
            each token time; TTFT also pays what the request's way in costs beyond ingress_s.
        ingress_s: frontend seconds per arriving request (HTTP, tokenization, submit), one request at a time:
            requests sent together reach the scheduler ingress_s apart.
        egress_s: frontend seconds per output token (detokenize, stream), in the same queue as the ingress.
        jitter: sigma of the log-normal factor (mean 1) by which the simulator scales each step: a shared
            machine's steps spread around their prediction (served stories260K steps at 0.9x capacity: measured /
            predicted 0.6 at p10, 1.2 at p90, 1.6-2.0 at p99, alike for decode and prefill steps of every size);
            0 gives every step its predicted time.
        jitter_slow_share: the share of that spread (of the variance of its log) that persists from one step to
            the next: the machine's speed drifting as its other tenants come and go, which makes a run of slow
            steps and queues near saturation; 0 draws each step's factor afresh. Served stories260K steps: lag-1
            correlation 0.63, still 0.56 ten steps on.
        jitter_memory_s: how long the persistent part lasts: its correlation between steps t seconds apart is
            exp(-t / jitter_memory_s).
        meta: where and how it was measured (model, machine, load average, threads, rmse).
        decode_factor: served / in-process time of a step's fixed and decode work (dimensionless).
        prefill_factor: served / in-process time of its prefill work: prompt tokens, prefill sequences and their
            attention (dimensionless).
        serving_step_s: seconds a served step costs on top of its work (sockets, the other processes' turns).
        serving_token_s: seconds each sampled token adds to a served step (the frontend and the clients streaming
            it, on the cores the worker shares).
        cores: the cores the worker, the scheduler, the frontend and the client share; 0: each has its own. With
            cores, the simulator runs each process's CPU seconds (worker_seconds, scheduler_s, ingress_s, egress_s,
            egress_step_s, client_cpu_*) on them shared (capacity/shared_cores.py), so that a step is slowed while
            the frontend and the client stream the tokens of the step before, as far as the cores are oversubscribed.
        cpu_decode_factor: with cores, the share of a served step's fixed and decode time (decode_factor,
            serving_step_s, serving_token_s) that is the worker's own work, the rest having been waits for a core
            at the calibration's load (dimensionless, about 0.9).
        cpu_prefill_factor: the same for its prefill time.
        egress_step_s: frontend CPU seconds per step's results (receiving, decoding and dispatching them), before
            its egress_s per token.
        client_cpu_request_s: CPU seconds the benchmark client spends per request (with cores: it shares them).
        client_cpu_token_s: CPU seconds the benchmark client spends per token it reads.
        cpu_weights: with cores, each process's weight when more of them have work than there are cores
            ("worker", "scheduler", "frontend", "client"; 1 where absent): the OS does not share the cores
            equally (stories260K served at 40 req/s on 2 cores: the worker waited for a core 0.13 s per second,
            the frontend 0.32 s, the client 0.11 s, from /proc/PID/task/*/schedstat); fitted so that the simulated
            waits match the measured ones.
        speed_trace: the machine's speed measured over time (capacity/machine_speed.py), relative to its mean,
            one value per speed_interval_s: a shared host slows every process alike for seconds at a time (a
            Python-bound probe on this machine: about 0.55-0.7x for 2-8 s, every 15-30 s), which at 0.9x of the
            mean capacity makes the queues of the real runs' tails. The simulator replays it, from a point its seed
            draws, scaling every process's work on the shared cores; empty: constant speed.
        speed_interval_s: seconds each value of speed_trace lasts.
    """

    coefficients: dict[str, float]
    scheduler_s: float = 0.0
    client_s: float = 0.0
    meta: dict = field(default_factory=dict)
    jitter: float = 0.0
    decode_factor: float = 1.0
    prefill_factor: float = 1.0
    serving_step_s: float = 0.0
    serving_token_s: float = 0.0
    ingress_s: float = 0.0
    egress_s: float = 0.0
    jitter_slow_share: float = 0.0
    jitter_memory_s: float = 0.0
    cores: float = 0.0
    cpu_decode_factor: float = 1.0
    cpu_prefill_factor: float = 1.0
    egress_step_s: float = 0.0
    client_cpu_request_s: float = 0.0
    client_cpu_token_s: float = 0.0
    cpu_weights: dict = field(default_factory=dict)
    speed_trace: list = field(default_factory=list)
    speed_interval_s: float = 0.0

    def __post_init__(self):
        unknown = set(self.coefficients) - set(FEATURES)
        if unknown:
            raise ValueError(f"unknown cost model features {sorted(unknown)}; known: {FEATURES}")
        negative = [name for name in _SCALARS if not getattr(self, name) >= 0]
        negative += [f"coefficient {name}" for name, c in self.coefficients.items() if not c >= 0]
        negative += [f"cpu weight {name}" for name, w in self.cpu_weights.items() if not w > 0]
        if negative:  # every one is seconds, a factor, a count of cores or a weight: a negative one is a bad file
            raise ValueError(f"negative or missing values: {', '.join(negative)}")
        if self.speed_trace and (self.speed_interval_s <= 0 or min(self.speed_trace) <= 0):
            raise ValueError(f"a speed trace needs a positive interval and positive speeds, got "
                             f"{self.speed_interval_s} s and a minimum of {min(self.speed_trace)}")
        c = {name: float(self.coefficients.get(name, 0.0)) for name in FEATURES}
        # The split of the module docstring, one in-process weight per feature for each part: num_tokens counts
        # prompt tokens and decode tokens alike, so a decode sequence's c_token moves to the decode part.
        self._decode_weights = (c["step"], 0.0, 0.0, c["decode_seq"] + c["token"], 0.0, c["decode_attention"],
                                c["sampled"], 0.0)
        self._prefill_weights = (0.0, c["token"], c["prefill_seq"], -c["token"], c["prefill_attention"], 0.0, 0.0,
                                 c["token_squared"])
        serving = (self.serving_step_s, 0.0, 0.0, 0.0, 0.0, 0.0, self.serving_token_s, 0.0)
        self._weights = tuple(self.decode_factor * d + self.prefill_factor * p + s
                              for d, p, s in zip(self._decode_weights, self._prefill_weights, serving))
        # with shared cores, the worker's own share of each part of the served prediction (worker_seconds)
        self._worker_weights = tuple(self.cpu_decode_factor * (self.decode_factor * d + s)
                                     + self.cpu_prefill_factor * self.prefill_factor * p
                                     for d, p, s in zip(self._decode_weights, self._prefill_weights, serving))

    def in_process(self) -> "StepCostModel":
        """The worker alone: the same coefficients and scheduler time, without the serving corrections, the
        client latency or the jitter (what calibrate.py's serving stage starts from)."""
        return StepCostModel(dict(self.coefficients), self.scheduler_s, 0.0, dict(self.meta))

    def parts(self, shape: StepShape) -> tuple[float, float]:
        """In-process seconds of a step split as the serving factors see it: (fixed + decode work, prefill work)."""
        x = shape.features()
        return (sum(w * v for w, v in zip(self._decode_weights, x)),
                sum(w * v for w, v in zip(self._prefill_weights, x)))

    def fit_serving(self, shapes: Sequence[StepShape], seconds: Sequence[float]) -> "StepCostModel":
        """This model with its serving corrections fitted to served steps (scheduler/step_log.py).

        served seconds ~ decode_factor x decode part + prefill_factor x prefill part + serving_step_s
        + serving_token_s x sampled rows, by non-negative least squares on error relative to the prediction (each
        step counts alike; reweighted four times); a part that no step has keeps factor 1. Decode sequences all
        sample, so the decode factor and the per-token term can trade against each other; their sum over a step,
        the prediction, is what the fit pins down. The jitter is the spread of what remains: half the distance
        between the 16th and 84th percentiles of log(served / fitted), the standard deviation for a log-normal
        factor (served stories260K steps: p99 1.7x the fit, as sigma 0.26 gives), robust to a few
        outliers; how much of it persists from step to step, and how long, is jitter_persistence's (the steps in
        the order they ran). Steps without tokens are left out. meta gains the fit's relative RMS error
        ("serving_rel_rmse") and the step count.

        Raises:
            ValueError: fewer than 3 steps, or a non-positive duration.
        """
        import numpy as np

        if len(shapes) != len(seconds):
            raise ValueError("need one duration per step")
        # a plan with no tokens only tells the worker which requests ended: not a step the model predicts
        shapes, seconds = zip(*[(s, t) for s, t in zip(shapes, seconds) if s.num_tokens]) or ((), ())
        y = np.asarray(seconds, dtype=np.float64)
        if len(y) < 3 or (y <= 0).any():
            raise ValueError("need at least 3 served steps with positive durations")
        base = self.in_process()
        x = np.asarray([(*base.parts(s), 1.0, s.num_sampled) for s in shapes], dtype=np.float64)
        weights = 1.0 / y
        for _ in range(4):
            fd, fp, per_step, per_token = nonnegative_least_squares(x * weights[:, None], y * weights)
            # Relative to the prediction, not to the noisy observation: dividing by y pulls the fit down by
            # about 2 sigma^2 (17% at sigma 0.3); weights from the last fit leave the mean unbiased.
            weights = 1.0 / np.maximum(x @ np.array([fd, fp, per_step, per_token]), 1e-9)
        if not x[:, 0].any():
            fd = 1.0
        if not x[:, 1].any():
            fp = 1.0
        fitted = dataclasses.replace(self, decode_factor=float(fd), prefill_factor=float(fp),
                                     serving_step_s=float(per_step), serving_token_s=float(per_token))
        predicted = np.asarray([fitted.predict(s) for s in shapes])
        log_ratio = np.log(y / np.maximum(predicted, 1e-9))
        q16, q84 = np.percentile(log_ratio, [16, 84])
        fitted.jitter = float(max(q84 - q16, 0.0) / 2)
        fitted.jitter_slow_share, fitted.jitter_memory_s = jitter_persistence(log_ratio, y)
        fitted.meta = {**fitted.meta, "num_served_steps": len(y),
                       "serving_rel_rmse": float(math.sqrt(float(np.mean(((predicted - y) / y) ** 2))))}
        return fitted

    def predict(self, shape: StepShape) -> float:
        """Seconds the worker takes for a step of this shape (0 for an empty step)."""
        if shape.num_tokens == 0:
            return 0.0
        return sum(w * x for w, x in zip(self._weights, shape.features()))

    def worker_seconds(self, shape: StepShape) -> float:
        """What the simulator runs on the worker for a step: with shared `cores`, the served prediction's decode
        part (with serving_step_s and serving_token_s) times cpu_decode_factor plus its prefill part times
        cpu_prefill_factor (the waits for a core that the served fit averages over are then the sharing's to add);
        else predict(shape)."""
        if not self.cores:
            return self.predict(shape)
        if shape.num_tokens == 0:
            return 0.0
        return sum(w * x for w, x in zip(self._worker_weights, shape.features()))

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
                "cpu_weights": dict(self.cpu_weights), "speed_trace": list(self.speed_trace), "meta": self.meta}

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
            floats = {name: float(data[name]) for name in _SCALARS if name in data}  # older profiles lack some
            weights = {name: float(w) for name, w in dict(data.get("cpu_weights", {})).items()}
            return StepCostModel({name: float(c) for name, c in data["coefficients"].items()},
                                 meta=dict(data.get("meta", {})), cpu_weights=weights,
                                 speed_trace=[float(v) for v in data.get("speed_trace", [])], **floats)
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
        import numpy as np  # only the fit needs it

        if len(shapes) != len(seconds) or len(shapes) < len(FEATURES):
            raise ValueError(f"need at least {len(FEATURES)} (shape, seconds) pairs, got {len(shapes)}")
        y = np.asarray(seconds, dtype=np.float64)
        if (y <= 0).any():
            raise ValueError("step durations must be positive")
        x = np.asarray([s.features() for s in shapes], dtype=np.float64) / y[:, None]  # relative-error rows
        coef = nonnegative_least_squares(x, np.ones_like(y))
        model = StepCostModel(dict(zip(FEATURES, (float(c) for c in coef))), **kwargs)
        predicted = np.asarray([model.predict(s) for s in shapes])
        model.meta = {**model.meta, "rel_rmse": float(math.sqrt(float(np.mean(((predicted - y) / y) ** 2)))),
                      "num_measurements": len(shapes)}
        return model


_SCALARS = tuple(f.name for f in dataclasses.fields(StepCostModel)
                 if f.name not in ("coefficients", "meta", "cpu_weights", "speed_trace"))
