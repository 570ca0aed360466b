#!/usr/bin/env python3
"""Calibrate the step-cost model of a model on this machine and save it as a JSON profile.

Runs the real ModelRunner in process over a grid of step shapes (decode batches over contexts, prefill chunks;
see capacity/calibrate.py) and fits the cost model. Then (unless --no-serve) it serves the model for real with
`--step-log` and runs three short bench_serve.py loads (closed loop: short prompts at the two --serve-concurrency
values, and long prompts with two output tokens at the low one), and fits to the steps the server logged what a
process-local measurement cannot see: how much slower decode work and prefill work run when the frontend and the
clients share the machine's cores (decode_factor, prefill_factor, serving_step_s, serving_token_s) and how much
served steps spread (jitter); from each process's CPU time and waits for a core, what the frontend, the client
and the scheduler spend per request, token and step, the worker's own share of a served step, and how the OS shares
the cores among them (the simulator's shared cores, capacity/shared_cores.py); and the latency left between the
worker and the client (client_s) from the first run's median TTFT. While the server runs, a small monitor
process traces the machine's speed (capacity/machine_speed.py): the simulator replays that trace on every process,
and check_simulator.py measures later runs against its mean (meta speed_reference_cpu_s). It prints each measurement, the fit and each run
measured next to simulated, and writes:

    .venv/bin/python scripts/calibrate.py --model ../shared/models/stories260K --out profiles/stories260K.json
    .venv/bin/python scripts/calibrate.py --model /tmp/shuttle-models/llama-110m --out profiles/llama-110m.json

The profile feeds scripts/simulate.py, scripts/tune.py and `shuttle serve --step-cost-profile`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The in-process grid runs with the torch threads of the servers the serving stage starts (tests/server.py: one,
# unless OMP_NUM_THREADS says otherwise): the serving factors are then the cost of serving, not of a thread count.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import bench_serve  # noqa: E402
import simulate  # noqa: E402
from capacity import machine_speed  # noqa: E402
from capacity.calibrate import Calibrator  # noqa: E402
from capacity.serving_fit import fit_cpu, fit_cpu_weights, fit_worker_work  # noqa: E402
from common.arg_types import positive  # noqa: E402
from common.step_cost import FEATURES, StepCostModel  # noqa: E402
from scheduler.step_log import read_step_log  # noqa: E402


def serve_check(model_dir: str, model: StepCostModel, concurrencies: list[int], num_prompts: int = 32,
                input_len: int = 128, output_len: int = 64, prefill_len: int | None = None) -> StepCostModel:
    """Fit the serving corrections from three real server runs: decode-heavy at a low and a high concurrency, and
    prefill-heavy (prompts of ~prefill_len tokens, 2 output tokens) at the low one.

    The server logs every step it runs with its served duration (`--step-log`, scheduler/step_log.py), and
    StepCostModel.fit_serving fits decode_factor, prefill_factor and serving_step_s to those steps, and the jitter
    to what they leave unexplained. What the steps cannot show is fitted from the processes' CPU seconds
    (/proc/PID/stat) and waits for a core (/proc/PID/task/*/schedstat) in each run, for the simulator's shared
    cores: fit_cpu (the frontend's, the client's and the scheduler's CPU seconds per request, token and step),
    fit_worker_work (the worker's own share of a served step) and fit_cpu_weights (how the cores are shared);
    then the latency between the worker and the client (client_s), what the low-concurrency run's median TTFT has
    beyond the simulated one. Each run has 4 requests per stream, so that its medians are the steady state's, not the first
    burst's. A monitor process (capacity/machine_speed.py) traces the machine's speed through the three runs; the
    fits see its mean, and the trace, relative to that mean, goes into the model afterwards (speed_trace; meta
    speed_reference_cpu_s is the monitor's unit at that mean). Returns the corrected model; meta["serve_check"]
    holds each run, measured and simulated."""
    from tests.server import ShuttleServer

    low_c, high_c = concurrencies
    max_len = int(model.meta.get("max_model_len", 2048))
    prefill_len = min(prefill_len or 4 * input_len, (max_len - 8) * 2 // 3)  # range 0.5: the longest is 1.5x
    workloads = {name: ["--num-prompts", str(max(num_prompts, 4 * c)), "--max-concurrency", str(c),
                        "--input-len", str(n_in), "--output-len", str(n_out), "--range-ratio", "0.5",
                        "--seed", str(seed)]  # one server: other prompts each run, or the prefix cache hits
                 for name, c, n_in, n_out, seed in (("low", low_c, input_len, output_len, 99 + low_c),
                                                    ("high", high_c, input_len, output_len, 99 + high_c),
                                                    ("prefill", low_c, prefill_len, 2, 7 + low_c))}
    measured: dict[str, dict] = {}
    steps: dict[str, list] = {}
    log_path = Path("bench_results/calibrate_steps.jsonl")  # kept: the served steps the fit saw
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.unlink(missing_ok=True)
    cpu_s: dict[str, dict[str, float]] = {}  # per run: CPU seconds of each process, and of the client (this one)
    waits: dict[str, dict[str, float]] = {}  # per run: seconds per second each waited for a core (None: unknown)
    windows = []  # each run's (start, end) in time.monotonic(): the speed monitor's reference is theirs
    server = ShuttleServer("--step-log", str(log_path), model_dir=Path(model_dir), start_timeout=600)
    try:
        seen = 0
        with machine_speed.SpeedMonitor() as monitor:
            for name, argv in workloads.items():
                out = Path(f"bench_results/calibrate_serve_{name}.json")
                pids = {**server.pids, "client": os.getpid()}
                before, start = process_usage(pids), time.perf_counter()
                windows.append([time.monotonic()])
                bench_serve.main(["--url", server.url, *argv, "--result-json", str(out), "--no-progress"])
                windows[-1].append(time.monotonic())
                after, wall = process_usage(pids), time.perf_counter() - start
                cpu_s[name] = {process: after[process][0] - before[process][0] for process in pids}
                waits[name] = {process: None if after[process][1] is None else
                               (after[process][1] - before[process][1]) / wall for process in pids}
                measured[name] = json.loads(out.read_text())
                logged = read_step_log(log_path)
                steps[name], seen = logged[seen:], len(logged)
    finally:
        server.stop()
    reference_cpu_s = monitor.reference_cpu_s(windows, machine_speed.SPEED_INTERVAL_S)

    def simulated_run(candidate: StepCostModel, name: str) -> tuple:
        """The run simulated: (SimResult, seconds per second each process waited for a core)."""
        sim_args = _sim_parser().parse_args(["--profile", "-", *workloads[name]])
        simulator = simulate.build_simulator(sim_args, candidate)
        result = simulator.run(simulate.build_workload(sim_args, candidate))
        return result, {process: wait / max(result.duration, 1e-9)
                        for process, wait in simulator.cores.wait_seconds.items()}

    def simulated(candidate: StepCostModel, name: str) -> dict:
        return simulated_run(candidate, name)[0].summary()

    served = [step for run in steps.values() for step in run]
    corrected = model.in_process().fit_serving([s.shape for s in served], [s.seconds for s in served])
    corrected = fit_cpu(corrected, {name: (measured[name], steps[name], cpu_s[name]) for name in workloads})
    corrected.meta.update(cpu_s=cpu_s, run_queue_wait=waits)
    corrected = fit_worker_work(corrected, steps, simulated_run)
    if all(wait is not None for run in waits.values() for wait in run.values()):
        corrected = fit_cpu_weights(corrected, waits, simulated_run)
        corrected = fit_worker_work(corrected, steps, simulated_run, iterations=2)
    no_jitter = dataclasses.replace(corrected, jitter=0.0)
    corrected.client_s = max(0.0, (measured["low"]["ttft_ms"]["median"]
                                   - simulated(no_jitter, "low")["ttft_ms"]["median"]) / 1000)
    if reference_cpu_s:
        interval = machine_speed.SPEED_INTERVAL_S
        speeds = [v for a, b in windows for v in monitor.trace(a, b, interval, reference_cpu_s)]
        print(f"machine speed through the runs, relative to its mean: min {min(speeds):.2f}, max {max(speeds):.2f} "
              f"(per {interval:g} s)")
        corrected = machine_speed.with_speed_trace(corrected, speeds, interval)
        # a run measured later with the monitor is replayed relative to the speed the fits saw
        corrected.meta["speed_reference_cpu_s"] = reference_cpu_s
    report = []
    for name, argv in workloads.items():
        check, real = simulated(corrected, name), measured[name]
        step_ms = [1e3 * sum(s.seconds for s in steps[name]) / max(len(steps[name]), 1),
                   1e3 * sum(corrected.predict(s.shape) for s in steps[name]) / max(len(steps[name]), 1)]
        keys = ("ttft", "itl", "tpot")
        report.append({"run": name, "workload": argv, "served_step_ms": step_ms,
                       "measured": {k: {s: real[f"{k}_ms"][s] for s in ("median", "p99")} for k in keys},
                       "simulated": {k: {s: check[f"{k}_ms"][s] for s in ("median", "p99")} for k in keys}})
        print(f"serve check, {name} run (concurrency {argv[3]}, input {argv[5]}, output {argv[7]}): measured / "
              f"predicted ms: {len(steps[name])} steps, mean {step_ms[0]:.2f} / {step_ms[1]:.2f}; TPOT mean "
              f"{real['tpot_ms']['mean']:.1f} / {check['tpot_ms']['mean']:.1f}, ITL p50 "
              f"{real['itl_ms']['median']:.1f} / {check['itl_ms']['median']:.1f}, p99 {real['itl_ms']['p99']:.1f} / "
              f"{check['itl_ms']['p99']:.1f}; TTFT p50 {real['ttft_ms']['median']:.1f} / "
              f"{check['ttft_ms']['median']:.1f}, p99 {real['ttft_ms']['p99']:.1f} / {check['ttft_ms']['p99']:.1f}")
    corrected.meta.update(serve_check=report)
    print(f"serving: decode work {corrected.decode_factor:.2f}x its in-process time + "
          f"{corrected.serving_step_s * 1e3:.2f} ms per step + {corrected.serving_token_s * 1e6:.1f} us per sampled "
          f"token, prefill work {corrected.prefill_factor:.2f}x (relative "
          f"RMS error {corrected.meta['serving_rel_rmse']:.3f} over {len(served)} steps); frontend "
          f"{corrected.ingress_s * 1e3:.2f} ms per request on its way in, {corrected.egress_s * 1e6:.1f} us per token "
          f"and {corrected.egress_step_s * 1e3:.2f} ms per step out; client {corrected.client_cpu_request_s * 1e3:.2f} "
          f"ms per request, {corrected.client_cpu_token_s * 1e6:.1f} us per token; the worker's own work "
          f"{corrected.cpu_decode_factor:.2f}x (decode) and {corrected.cpu_prefill_factor:.2f}x (prefill) its "
          f"served time; scheduler {corrected.scheduler_s * 1e3:.2f} ms per step; {corrected.cores:g} cores "
          f"shared with weights {corrected.cpu_weights}; client latency "
          f"{corrected.client_s * 1e3:.2f} ms; step jitter sigma {corrected.jitter:.2f}, "
          + (f"the machine's speed replayed from a {len(corrected.speed_trace) * corrected.speed_interval_s:g} s trace"
             if corrected.speed_trace else
             f"{100 * corrected.jitter_slow_share:.0f}% of it persisting ~{corrected.jitter_memory_s:.2f} s"))
    return corrected


def process_usage(pids: dict[str, int]) -> dict[str, tuple[float, float | None]]:
    """(CPU seconds, seconds waiting for a core) of each process so far (bench_serve.py's readers of /proc)."""
    return {name: (bench_serve.cpu_seconds(pid), bench_serve.run_queue_wait_seconds(pid)) for name, pid in pids.items()}


def _sim_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    simulate.add_config_args(parser)
    simulate.add_workload_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON profile goes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=positive, default=None)
    parser.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="largest chunk measured")
    parser.add_argument("--max-num-seqs", type=positive, default=128, help="largest decode batch measured")
    parser.add_argument("--repeats", type=positive, default=5, help="decode steps per configuration (median kept)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-serve", action="store_true", help="skip the real-server stage (factor 1, client 0)")
    parser.add_argument("--serve-only", action="store_true",
                        help="keep the in-process fit already in --out and redo only the real-server stage")
    parser.add_argument("--serve-concurrency", type=positive, nargs=2, default=[8, 128],
                        help="the low and the high concurrency of the two real-server runs")
    parser.add_argument("--serve-prompts", type=positive, default=96)
    parser.add_argument("--serve-input-len", type=positive, default=128,
                        help="mean prompt of the two decode-heavy runs (bench_serve.py's default; use your workload's)")
    parser.add_argument("--serve-output-len", type=positive, default=64,
                        help="mean output of the two decode-heavy runs (bench_serve.py's default; use your workload's)")
    parser.add_argument("--serve-prefill-len", type=positive, default=None,
                        help="mean prompt of the prefill-heavy run (default 4x --serve-input-len, at most 2/3 of "
                             "max_model_len)")
    args = parser.parse_args(argv)
    simulate.require_model_dir(parser, args.model, args.max_model_len)
    if args.serve_only and args.no_serve:
        parser.error("--serve-only and --no-serve exclude each other")
    if args.serve_only:  # the in-process fit it keeps must be there and readable
        try:
            StepCostModel.load(args.out)
        except ValueError as exc:
            parser.error(f"--serve-only keeps the in-process fit of an existing --out profile: {exc}")
    start = time.time()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    if args.serve_only:
        model = StepCostModel.load(args.out).in_process()
    else:
        calibrator = Calibrator(args.model, args.dtype, args.max_model_len, attention_backend=args.attention_backend)
        model, measurements = calibrator.calibrate(args.max_num_batched_tokens, args.max_num_seqs, args.repeats,
                                                   progress=lambda line: print(line, flush=True))
        print(f"{'measurement':<60}{'ms':>10}{'fit ms':>10}")
        for m in measurements:
            print(f"{m.label:<60}{m.seconds * 1e3:10.2f}{model.predict(m.shape) * 1e3:10.2f}")
        del calibrator  # its model and cache: the server stage needs the memory and the cores
    if not args.no_serve:
        model = serve_check(args.model, model, args.serve_concurrency, args.serve_prompts, args.serve_input_len,
                            args.serve_output_len, args.serve_prefill_len)
    model.meta["load_average_at_end"] = os.getloadavg()[0]
    model.meta["seconds"] = round(time.time() - start, 1)
    print("coefficients: " + ", ".join(f"{name} {model.coefficients[name]:.3g}" for name in FEATURES))
    print(f"relative RMS error {model.meta['rel_rmse']:.3f}; scheduler {model.scheduler_s * 1e3:.3f} ms/step; "
          f"load average {model.meta['load_average_at_start']:.2f} -> {model.meta['load_average_at_end']:.2f}")
    model.save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
