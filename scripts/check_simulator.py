#!/usr/bin/env python3
"""Set the simulator's prediction next to a real bench_serve.py run of the same workload.

Takes bench_serve.py's workload flags and `shuttle serve` flags, simulates the workload with the profile, serves
the model for real with the same flags (and --step-log), runs bench_serve.py, and prints p50/p99 TTFT and ITL side
by side with the verdict: within 15% or 20 ms, whichever is larger; then the real server's steps next to what the
profile predicts for the same shapes, which tells a wrong step model from what happens around the steps.
--repeats runs the real side that many times, each on a fresh server, and compares with the median of the runs
(all runs are printed): the p99 of a short run is a handful of requests, and this machine's speed drifts between
runs.

On a machine whose other tenants come and go, the speed of the same server changes from one minute to the next;
--recalibrate redoes calibrate.py's real-server stage (three short runs of its own workload, not this one) on top
of the profile's in-process fit before each real run, and predicts that run with it, so that each calibration and
its measurement share one window. --measure-capacity follows each real run with one that sends every request at
once, whose throughput is the capacity then: it says how near saturation the offered rate really was.

A small monitor process (capacity/machine_speed.py, SpeedMonitor: about 2% of a core) times a fixed unit of work
throughout each real run, and again during the calibration the prediction came from (the profile's
speed_reference_cpu_s); the same predictions are then repeated given the machine's speed during the run, relative
to the calibration's, replayed in step with it: a second table that tells what the simulator gets wrong from what
the machine did differently between calibration and run.

    .venv/bin/python scripts/check_simulator.py --model ../shared/models/stories260K \\
        --profile profiles/stories260K.json --num-prompts 1500 --rate-fraction 0.9 --repeats 3
    .venv/bin/python scripts/check_simulator.py --model /tmp/shuttle-models/llama-110m \\
        --profile profiles/llama-110m.json --num-prompts 64 --max-concurrency 16 --input-len 256 --range-ratio 1.0 \\
        --output-len 32 --max-num-seqs 64 --repeats 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402
import simulate  # noqa: E402
from capacity.machine_speed import SPEED_INTERVAL_S, SpeedMonitor, with_speed_trace  # noqa: E402
from common.arg_types import positive, positive_number  # noqa: E402
from common.step_cost import StepCostModel  # noqa: E402
from scheduler.step_log import read_step_log  # noqa: E402

TOLERANCE = 0.15
FLOOR_MS = 20.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_config_args(parser)
    simulate.add_workload_args(parser)
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", type=Path, default=Path("bench_results/check_simulator.json"))
    parser.add_argument("--recalibrate", type=positive, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="redo the real-server calibration stage at these two concurrencies before each "
                             "real run")
    parser.add_argument("--repeats", type=positive, default=1,
                        help="real runs, each on a fresh server; the measured value is their median (the p99 of a "
                             "short run is a few requests, and this machine's speed drifts between runs)")
    parser.add_argument("--sim-repeats", type=positive, default=5,
                        help="simulations with different step-jitter seeds; the prediction is their median")
    parser.add_argument("--rate-fraction", type=positive_number, default=None,
                        help="instead of --request-rate: this share of the capacity the simulator predicts")
    parser.add_argument("--measure-capacity", action="store_true",
                        help="after each real run, one more on a fresh server with every request sent at once: the "
                             "capacity measured, to set the offered rate against (how near saturation it was)")
    args = parser.parse_args(argv)
    profile = simulate.load_profile(parser, args.profile)
    simulate.load_workload(parser, args, profile)  # a bad trace or too long a request: said now, not mid-run
    simulate.require_model_dir(parser, args.model)
    serve_flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
                   "--kv-cache-memory", str(args.kv_cache_memory)]
    load_before = os.getloadavg()
    predictions, runs, capacities = [], [], []
    for i in range(args.repeats):
        if args.recalibrate:  # each real run right after its own serving-stage calibration
            import calibrate
            predictions.append(predict(args, calibrate.serve_check(args.model, profile.in_process(),
                                                                   args.recalibrate)))
        else:  # one profile: one prediction for every run
            predictions.append(predictions[-1] if predictions else predict(args, profile))
        simulated, rate, _ = predictions[-1]
        bench_argv = ["--num-prompts", str(args.num_prompts), "--request-rate", str(rate),
                      "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                      "--range-ratio", str(args.range_ratio), "--seed", str(args.seed), "--no-progress"]
        if args.max_concurrency:
            bench_argv += ["--max-concurrency", str(args.max_concurrency)]
        runs.append(measure(args, serve_flags, bench_argv, args.json.with_suffix(f".bench{i}.json"),
                            predictions[-1][2].meta.get("speed_reference_cpu_s")))
        if args.measure_capacity:
            at_once = [*bench_argv[:2], "--request-rate", "inf", *bench_argv[4:]]
            capacities.append(measure(args, serve_flags, at_once, args.json.with_suffix(f".capacity{i}.json"))[0])
    load_after = os.getloadavg()
    rows, ok = compare("predicted", [simulated for simulated, _, _ in predictions], [m for m, _, _ in runs])
    given_speed = [predict_given_speed(args, rate, cost, speeds)
                   for (_, rate, cost), (_, _, speeds) in zip(predictions, runs) if speeds]
    rows_given_speed = []
    if len(given_speed) == len(runs):
        for (_, _, speeds) in runs:
            print(f"machine speed during the run, relative to its calibration's: mean {statistics.fmean(speeds):.2f}, "
                  f"min {min(speeds):.2f}, max {max(speeds):.2f}")
        rows_given_speed, _ = compare("given speed", given_speed, [m for m, _, _ in runs])
    steps = served_steps([(step, cost) for (_, served, _), (_, _, cost) in zip(runs, predictions) for step in served])
    for kind, row in steps.items():
        print(f"served {kind} steps: {row['count']}, mean {row['measured_ms']:.2f} ms, the profile predicts "
              f"{row['predicted_ms']:.2f} ms for the same shapes")
    throughput = statistics.median(measured["request_throughput"] for measured, _, _ in runs)
    predicted = statistics.median(summary["request_throughput"] for simulated, _, _ in predictions
                                  for summary in simulated)
    print(f"throughput req/s: predicted {predicted:.2f}, measured {throughput:.2f}; "
          f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    for i, capacity in enumerate(capacities):
        rate = predictions[i][1]
        print(f"run {i + 1}: offered {rate:.2f} req/s; capacity measured right after (every request at once) "
              f"{capacity['request_throughput']:.2f} req/s: the run offered {rate / capacity['request_throughput']:.2f}"
              f"x of it")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "predicted": [{"request_rate": rate, "simulations": simulated}
                                                                for simulated, rate, _ in predictions],
                                     "measured": [m for m, _, _ in runs],
                                     "rows_given_speed": rows_given_speed,
                                     "speed_during_runs": [speeds for _, _, speeds in runs],
                                     "capacity_measured": [c["request_throughput"] for c in capacities],
                                     "served_steps": steps,
                                     "load_average": [load_before[0], load_after[0]],
                                     "config": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0 if ok else 1


def compare(title: str, predicted: list[list[dict]], measured: list[dict]) -> tuple[list[dict], bool]:
    """Print p50/p99 TTFT and ITL predicted (per run, the median of its simulations' summaries) next to measured
    (bench_serve summaries), each the median over the runs, with the verdict. Returns the rows and whether all
    are within 15% or 20 ms."""
    rows, ok = [], True
    print(f"{'':<10}{title + ' ms':>14}{'measured ms':>14}{'error':>10}  within 15% or 20 ms"
          + ("  (medians of the runs; each run #: predicted / measured)" if len(measured) > 1 else ""))
    for metric in ("ttft", "itl"):
        for stat in ("median", "p99"):
            each = [m[f"{metric}_ms"][stat] for m in measured]
            each_predicted = [statistics.median(summary[f"{metric}_ms"][stat] for summary in simulated)
                              for simulated in predicted]
            p, m = statistics.median(each_predicted), statistics.median(each)
            within = abs(p - m) <= max(TOLERANCE * m, FLOOR_MS)
            ok &= within
            rows.append({"metric": f"{metric} {stat}", "predicted_ms": p, "measured_ms": m, "runs_ms": each,
                         "runs_predicted_ms": each_predicted, "within": within})
            name = f"{metric.upper()} {'p50' if stat == 'median' else stat}"
            print(f"{name:<10}{p:>14.1f}{m:>14.1f}{100 * (p - m) / m if m else 0:>9.1f}%  {'yes' if within else 'NO'}"
                  + ("   " + ", ".join(f"{a:.1f} / {b:.1f}" for a, b in zip(each_predicted, each))
                     if len(measured) > 1 else ""))
    return rows, ok


def predict(args, cost: StepCostModel) -> tuple[list[dict], float, StepCostModel]:
    """The workload simulated with --sim-repeats jitter seeds, at --request-rate or --rate-fraction of the
    capacity the simulator predicts with this cost model: (summaries, request rate, the cost model)."""
    rate = args.request_rate
    if args.rate_fraction:  # near saturation, wherever saturation is on this machine now
        saturated = simulate.build_simulator(args, cost).run(simulate.build_workload(args, cost, float("inf")))
        rate = round(args.rate_fraction * saturated.summary()["request_throughput"], 2)
        print(f"predicted capacity {saturated.summary()['request_throughput']:.2f} req/s; rate {rate}")
    workload = simulate.build_workload(args, cost, rate)
    return [simulate.build_simulator(args, cost, seed=seed).run(workload).summary()
            for seed in range(args.sim_repeats)], rate, cost


def predict_given_speed(args, rate: float, cost: StepCostModel, speeds: list[float]) -> list[dict]:
    """The run simulated as predict() did, given the machine's speed measured alongside it (relative to the
    calibration's) instead of the calibration's own trace, replayed in step with the run: --sim-repeats summaries."""
    traced = with_speed_trace(cost, speeds, SPEED_INTERVAL_S)
    workload = simulate.build_workload(args, cost, rate)
    return [simulate.build_simulator(args, traced, seed=seed, speed_start=0).run(workload).summary()
            for seed in range(args.sim_repeats)]


def measure(args, serve_flags: list[str], bench_argv: list[str], out: Path,
            reference_cpu_s: float | None = None) -> tuple[dict, list, list[float]]:
    """One real run on a fresh server (as the simulation starts: empty cache, nothing in flight): bench_serve.py's
    summary, the server's steps (--step-log) and, given the speed monitor's reference of the calibration, the
    machine's speed during the run relative to it (capacity/machine_speed.py; [] without a reference)."""
    from tests.server import ShuttleServer

    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "steps.jsonl"
        server = ShuttleServer(*serve_flags, "--step-log", str(log_path), model_dir=Path(args.model),
                               start_timeout=600)
        try:
            # without a reference there is nothing to trace against: no monitor (a process and its CPU) then
            with SpeedMonitor() if reference_cpu_s else contextlib.nullcontext() as monitor:
                start = time.monotonic()
                bench_serve.main(["--url", server.url, *bench_argv, "--result-json", str(out)])
                end = time.monotonic()
        finally:
            server.stop()
        speeds = monitor.trace(start, end, SPEED_INTERVAL_S, reference_cpu_s) if monitor else []
        return json.loads(out.read_text()), read_step_log(log_path), speeds


def served_steps(served: list[tuple]) -> dict[str, dict]:
    """The real servers' steps (their --step-log), each against the prediction of the cost model its run was
    predicted with, decode-only steps and steps with prefill work apart: tells a wrong step model from what happens
    around the steps. served: (ServedStep, StepCostModel) pairs."""
    kinds: dict[str, dict] = {}
    for kind, chosen in (("decode-only", [(s, c) for s, c in served if s.num_prefill_seqs == 0]),
                         ("prefill", [(s, c) for s, c in served if s.num_prefill_seqs > 0])):
        if chosen:
            kinds[kind] = {"count": len(chosen), "measured_ms": 1e3 * sum(s.seconds for s, _ in chosen) / len(chosen),
                           "predicted_ms": 1e3 * sum(c.predict(s.shape) for s, c in chosen) / len(chosen)}
    return kinds


if __name__ == "__main__":
    sys.exit(main())
