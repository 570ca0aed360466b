"""SLO-aware admission: refuse at arrival a request whose first token would come too late anyway.

With `--ttft-slo-ms` (or a request's own `ttft_slo_ms`), each arriving request gets a predicted time to first
token: the steps needed before it has a running slot and its prompt is prefilled, each step's duration from the
step-cost model (scheduler/step_cost.py). When that prediction already exceeds the objective, waiting cannot help:
the request is answered at once with 503 and a Retry-After of the predicted time until a newcomer would meet the
objective again (the queue ahead has drained that much), instead of waiting in vain and making everyone behind it
late too. Without an objective nothing is refused here.

The prediction replays the scheduler's rules on a light copy of its state (numbers, not Request objects):
running requests first (a decode costs one token, a prompt is chunked into what is left of the token budget),
then waiting ones in rank order while a slot (max_num_seqs) and KV blocks for prompt + expected output remain.
Stretches of steps where only decodes run are summed in closed form (StepCostModel.decode_run), so a prediction
costs a few iterations per request ahead, not one per step. Output lengths are expected to be max_tokens times
the ratio finished requests actually reached (1 until one finishes): EOS ends most text early.

The cost model is a calibrated profile (`--step-cost-profile`, written by `shuttle calibrate`) or, without one,
the same model fitted online to this server's own measured steps; until enough steps were measured (and with no
profile) every request is admitted.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from shuttle.scheduler.request import Request
from shuttle.scheduler.scheduled_step import ScheduledStep
from shuttle.scheduler.step_cost import StepCostModel, StepShape, shape_of
from shuttle.scheduler.ttft_replay import AdmissionView, Replay, Seq

MIN_ONLINE_STEPS = 32  # steps measured before the online model predicts anything
ONLINE_WINDOW = 512  # most recent measured steps the online model is fitted to
REFIT_EVERY = 64  # steps between online refits
HEADROOM = 0.95  # admit when the prediction is within this share of the objective: room for its own error
MAX_ITERATIONS = 4000  # bound on one prediction's work; past it the rest is extrapolated


@dataclass(frozen=True, slots=True)
class Verdict:
    """A refusal: the predicted TTFT (seconds from now) and when to retry (seconds, >= 1). `unattainable`: even on
    an idle server its prompt's prefill alone would miss the objective (predicted_ttft_s is then that idle
    prediction), so no retry can help."""

    predicted_ttft_s: float
    retry_after_s: float
    unattainable: bool = False


class SloAdmission:
    """Predicts queueing delay and refuses requests that would miss their TTFT objective.

    Args:
        default_slo_ms: the server's objective (0: only requests carrying their own are checked).
        cost: a calibrated step-cost model, or None to fit one online from measured steps.
        clock: monotonic seconds (the simulator passes its virtual clock).
    """

    def __init__(self, default_slo_ms: float = 0.0, cost: StepCostModel | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.default_slo_ms = default_slo_ms
        self.cost = cost
        self.online = cost is None
        self.clock = clock
        self.output_ratio = 1.0  # finished outputs / max_tokens, a moving average
        self._observed: deque[tuple[StepShape, float]] = deque(maxlen=ONLINE_WINDOW)
        self._since_fit = 0
        self._planned: dict[int, tuple[float, float]] = {}  # step id -> (planned at, predicted seconds)
        self._newest_step: tuple[int, frozenset[str]] | None = None  # the last planned step (id, requests) unsettled
        self._last_settled = 0.0
        self.num_refused = 0
        # Steps are watched only once an objective exists (the server's, or the first request carrying one), so
        # a server without objectives does exactly what it did before.
        self.armed = default_slo_ms > 0

    # ---- hooks the scheduler calls ------------------------------------------------------------------

    def on_planned(self, step: ScheduledStep) -> None:
        if not self.armed or step.is_empty:  # an empty plan is never sent, so never settled: nothing in flight
            return
        if len(self._planned) >= 4:  # a step that failed is never settled: forget it
            del self._planned[next(iter(self._planned))]
        self._planned[step.plan.step_id] = (self.clock(), self.cost.predict(_shape(step)) if self.cost else 0.0)
        self._newest_step = (step.plan.step_id, frozenset(step.scheduled))

    def on_settled(self, step: ScheduledStep) -> None:
        """Measure the step (from when it could start: planned, or the previous step's end) for the online fit."""
        if not self.armed:
            return
        now = self.clock()
        planned_at, _ = self._planned.pop(step.plan.step_id, (now, 0.0))
        if self._newest_step is not None and self._newest_step[0] == step.plan.step_id:
            self._newest_step = None
        began, self._last_settled = max(planned_at, self._last_settled), now
        if self.online and now > began and step.scheduled:
            self._observed.append((_shape(step), now - began))
            self._since_fit += 1
            if len(self._observed) >= MIN_ONLINE_STEPS and (self.cost is None or self._since_fit >= REFIT_EVERY):
                self._refit()

    def on_finished(self, request: Request) -> None:
        if self.armed and request.sampling.max_tokens > 0 and request.output_token_ids:
            ratio = min(1.0, len(request.output_token_ids) / request.sampling.max_tokens)
            self.output_ratio += 0.05 * (ratio - self.output_ratio)

    def check(self, view: AdmissionView, request: Request, slo_ms: float) -> Verdict | None:
        """A Verdict when `request` (not yet queued) would miss its objective, else None (admit).
        `slo_ms` is the request's own objective (0: the server's default)."""
        slo_ms = slo_ms or self.default_slo_ms
        if slo_ms <= 0:
            return None
        self.armed = True
        if self.cost is None:
            return None
        slo_s = slo_ms / 1000
        predicted = self.predict_ttft(view, request, horizon_s=max(2 * slo_s, slo_s + 1.0))
        if predicted <= slo_s * HEADROOM:
            return None
        self.num_refused += 1
        alone = self.predict_ttft(dataclasses.replace(view, running=(), waiting=()), request, in_flight=False)
        if alone > slo_s * HEADROOM:  # a Retry-After would send it back forever (a batch job, a background response)
            return Verdict(alone, 0.0, unattainable=True)
        return Verdict(predicted, max(1.0, math.ceil(predicted - slo_s)))

    # ---- the prediction -------------------------------------------------------------------------------

    def predict_ttft(self, view: AdmissionView, request: Request, horizon_s: float = math.inf,
                     in_flight: bool = True) -> float:
        """Predicted seconds from now until `request`'s first token reaches its client, if it were queued now
        behind the requests that rank before it: the scheduler's rules replayed step by step on the step-cost model
        (tests/unit/test_ttft_prediction.py checks them against the simulator). Past `horizon_s` the remaining
        queue is extrapolated at the admission rate seen so far. `in_flight=False` leaves out the steps already
        sent (for a prediction on an idle server: `view` without requests)."""
        cost = self.cost
        assert cost is not None  # a prediction needs the step-cost model (check() asks only with one)
        # a newcomer ranks behind every queued request of the same rank (the queue keeps arrival order among ties)
        ahead = sorted((r for r in view.waiting if r.rank <= request.rank and r is not request), key=_rank)
        target = self._seq(request)
        target.target = True
        in_newest_step = self._newest_step[1] if self._newest_step is not None else frozenset()
        replay = Replay(view, [self._seq(r) for r in view.running], [*map(self._seq, ahead), target], in_newest_step)
        queue_len = len(replay.queue)
        now = self._in_flight_remaining() if in_flight else 0.0
        for _ in range(MAX_ITERATIONS):
            chunks, computed = replay.compose()
            if not chunks and replay.lingering:  # only finished requests hold the slots: free after this turn
                replay.release(replay.lingering)
                replay.lingering = []
                continue
            if not chunks:
                break  # nothing can run: the prediction cannot go on (a request larger than the cache)
            if replay.only_decodes_ahead():  # until the next request finishes: that stretch in closed form
                now += replay.decode_stretch(cost)
            else:
                now += cost.predict(shape_of(chunks))
                if replay.advance(computed):
                    return now + cost.client_s
            replay.end_step()
            if now > horizon_s:
                break
        admitted = queue_len - len(replay.queue)
        if now <= 0:  # the model predicts no time for any of it: it knows nothing about waiting here
            return 0.0
        if admitted <= 0:
            return now * (queue_len + 1)
        return now * queue_len / admitted + cost.client_s  # the rest of the queue at the rate seen so far

    def _seq(self, request: Request) -> Seq:
        """A request as the prediction sees it: tokens booked but not computed are prefill (prompt chunks or a
        recompute after preemption); expected outputs still to sample."""
        to_compute = request.num_tokens_booked - request.num_computed_tokens
        outputs_so_far = len(request.output_token_ids) + request.num_output_placeholders
        expected = max(1.0, request.sampling.max_tokens * self.output_ratio)
        remaining = max(expected - outputs_so_far, 0.0)
        # prompt chunks (or a recompute) left, however short (a one-token prompt too); the step that ends them samples
        if to_compute > 1 or request.num_computed_tokens < len(request.prompt_token_ids):
            return Seq(to_compute, remaining, request.num_computed_tokens, request_id=request.request_id)
        # decoding: one token per step
        return Seq(0, remaining, request.num_computed_tokens, request_id=request.request_id)

    def _in_flight_remaining(self) -> float:
        """Predicted seconds until the steps already sent are done (their tokens are booked already)."""
        if not self._planned:
            return 0.0
        now = self.clock()
        start = max(min(at for at, _ in self._planned.values()), self._last_settled)
        return max(start + sum(seconds for _, seconds in self._planned.values()) - now, 0.0)

    def _refit(self) -> None:
        shapes, seconds = zip(*self._observed)
        try:
            fitted = StepCostModel.fit(list(shapes), list(seconds))
        except ValueError:
            return
        self.cost = fitted
        self._since_fit = 0


def _rank(request: Request):
    return request.rank


def _shape(step: ScheduledStep) -> StepShape:
    return shape_of((e.start, e.num_new, e.samples) for e in step.scheduled.values())


def make_admission(slo_ms: float, profile: str, clock: Callable[[], float] = time.monotonic) -> SloAdmission:
    """The admission controller for a server process: with the calibrated profile at `profile` when given.

    Raises:
        OSError, ValueError: the profile cannot be read.
    """
    return SloAdmission(slo_ms, StepCostModel.load(profile) if profile else None, clock)


__all__ = ("AdmissionView", "SloAdmission", "Verdict", "make_admission")
