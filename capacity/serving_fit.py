"""Fits of the simulator's shared cores (capacity/shared_cores.py) to real server runs, for scripts/calibrate.py:
each process's CPU seconds per unit of work, the worker's own share of a served step, and the weights with which
the OS shares the cores among the processes."""

from __future__ import annotations

import dataclasses
import math
import os

from common.cost_fitting import nonnegative_least_squares
from common.step_cost import StepCostModel

WEIGHT_GRID = (1.0, 1.5, 2.0, 3.0)


def fit_worker_work(model: StepCostModel, steps: dict[str, list], simulated_run, iterations: int = 3) -> StepCostModel:
    """With shared cores, the share of the served fit's decode and prefill time that is the worker's own work
    (cpu_decode_factor, cpu_prefill_factor), such that the simulated runs' steps, slowed by the sharing, last
    relative to the served fit (model.predict of each step's shape) what the real servers' logged steps last
    relative to it (decode-only steps for the one, steps with prefill work for the other): a fixed-point iteration
    on the ratio of those ratios, as a step's served time depends on everything else running. Relative to the
    prediction, not as plain means, because the simulated runs need not have the real ones' mix of steps: with
    fewer decode-only steps at a large batch and more small ones, the plain means match only when each step is too
    slow (measured on stories260K here: simulated steps 12% slower than their served prediction while the real
    ones matched theirs, and the capacity predicted that much lower).
    The worker's measured CPU seconds cannot be used for it: they include its I/O threads, which work beside the
    step, and a step's CPU time grows with its neighbours' use of the caches. steps: run name -> its served steps
    (--step-log); simulated_run as fit_cpu_weights'."""
    if not model.cores:
        return model

    def ratios(pairs) -> tuple[float, float]:  # (sum of served / sum of predicted) for decode-only, with prefill
        sums = {False: [0.0, 0.0], True: [0.0, 0.0]}
        for shape, seconds in pairs:
            if shape.num_tokens:
                totals = sums[shape.num_prefill_seqs > 0]
                totals[0] += seconds
                totals[1] += model.predict(shape)
        return tuple(served / predicted if predicted > 0 else math.nan for served, predicted in sums.values())

    measured = ratios([(s.shape, s.seconds) for run in steps.values() for s in run])
    for _ in range(iterations):
        simulated = ratios([(s.shape, s.seconds) for name in steps for s in simulated_run(model, name)[0].served])
        decode, prefill = (m / s if m > 0 and s > 0 else 1.0 for m, s in zip(measured, simulated))
        model = dataclasses.replace(model, cpu_decode_factor=model.cpu_decode_factor * decode,
                                    cpu_prefill_factor=model.cpu_prefill_factor * prefill)
    return model


def fit_cpu_weights(model: StepCostModel, waits: dict[str, dict[str, float]], simulated_run) -> StepCostModel:
    """The processes' weights on the shared cores (cpu_weights, the frontend's fixed at 1), by one pass of
    coordinate search over WEIGHT_GRID for the worker's, the client's and the scheduler's: the simulated seconds per
    second each of the worker, the frontend and the client waits for a core, against those measured in the same
    runs (squared differences summed over runs and processes). The scheduler's own measured wait is left out of
    the objective: it is the latency of its many short wake-ups, which processor sharing does not model.
    simulated_run(model, run name) -> (SimResult, {process: wait seconds per second})."""
    def error(weights: dict[str, float]) -> float:
        candidate = dataclasses.replace(model, cpu_weights=weights)
        total = 0.0
        for name, measured in waits.items():
            simulated = simulated_run(candidate, name)[1]
            total += sum((simulated[p] - measured[p]) ** 2 for p in ("worker", "frontend", "client"))
        return total

    best = {"worker": 1.0, "client": 1.0, "scheduler": 1.0}
    best_error = error(best)
    for process in tuple(best):
        for weight in WEIGHT_GRID:
            trial = {**best, process: weight}
            if trial != best and (trial_error := error(trial)) < best_error:
                best, best_error = trial, trial_error
    return dataclasses.replace(model, cpu_weights=best,
                               meta={**model.meta, "cpu_weights_rms_wait": math.sqrt(best_error / (3 * len(waits)))})


def fit_cpu(model: StepCostModel, runs: dict[str, tuple[dict, list, dict[str, float]]]) -> StepCostModel:
    """The processes' CPU seconds per unit of work, fitted over the real runs by non-negative least squares (each
    run's CPU seconds relative to its own total, so that a short run counts as much as a long one), for the
    simulator's shared cores: the frontend per request in (ingress_s), per token out (egress_s) and per step's
    results (egress_step_s); the client per request and per token; the scheduler per step (scheduler_s). runs:
    name -> (bench_serve summary, the run's served steps, CPU seconds per process)."""
    import numpy as np

    def fit(process: str, columns) -> list[float]:
        x = np.asarray([columns(summary, served) for summary, served, _ in runs.values()], dtype=np.float64)
        y = np.asarray([max(cpu[process], 1e-6) for _, _, cpu in runs.values()], dtype=np.float64)
        return [float(c) for c in nonnegative_least_squares(x / y[:, None], np.ones_like(y))]

    ingress, egress, egress_step = fit("frontend", lambda summary, served: (
        summary["completed"], summary["total_output_tokens"], len(served)))
    client_request, client_token = fit("client", lambda summary, _: (summary["completed"],
                                                                       summary["total_output_tokens"]))
    steps = sum(len(served) for _, served, _ in runs.values())
    return dataclasses.replace(
        model, cores=float(len(os.sched_getaffinity(0))), ingress_s=ingress, egress_s=egress,
        egress_step_s=egress_step, client_cpu_request_s=client_request, client_cpu_token_s=client_token,
        scheduler_s=sum(cpu["scheduler"] for *_, cpu in runs.values()) / max(steps, 1))
