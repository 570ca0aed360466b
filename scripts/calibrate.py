#!/usr/bin/env python3
"""Calibrate the step-cost model of a model on this machine and save it as a JSON profile.

Runs the real ModelRunner in process over a grid of step shapes (decode batches over contexts, prefill chunks;
see capacity/calibrate.py) and fits the cost model. Then (unless --no-serve) it serves the model for real and runs
a short bench_serve.py load (closed loop, --serve-concurrency streams of short prompts) next to the simulation of
the same workload, and fits the two things a process-local measurement cannot see: how much slower steps run
when the frontend and the clients share the machine's cores (one factor on every coefficient), and the latency a
token spends between the worker and the client (client_s). It prints each measurement and the fit, and writes:

    .venv/bin/python scripts/calibrate.py --model ../shared/models/stories260K --out profiles/stories260K.json
    .venv/bin/python scripts/calibrate.py --model /tmp/shuttle-models/llama-110m --out profiles/llama-110m.json

The profile feeds scripts/simulate.py, scripts/tune.py and `shuttle serve --step-cost-profile`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402
import simulate  # noqa: E402
from capacity.calibrate import Calibrator  # noqa: E402
from common.step_cost import FEATURES, StepCostModel  # noqa: E402


def serve_check(model_dir: str, model: StepCostModel, concurrencies: list[int], num_prompts: int, input_len: int,
                output_len: int) -> StepCostModel:
    """Fit the serving corrections from real server runs at a low and a high concurrency.

    The mean time per output token (TPOT, averaged over requests) of a decode-bound run is about one step as the
    clients see it (the median ITL is not: a busy frontend delivers tokens in clumps): f x (in-process step) + e,
    where f is how much slower
    (or faster) the worker's work runs beside the frontend and the clients than alone, and e what a served step
    costs on top (sockets, the scheduler's and frontend's turns on the cores). Two runs give f and e (f >= 0.3,
    e >= 0); the median TTFT of the low-concurrency run then gives client_s. Each run has 4 requests per stream,
    so that its medians are the steady state's, not the first burst's. Returns the corrected model;
    meta["serve_check"] holds both runs, measured and simulated."""
    from tests.server import ShuttleServer

    runs = []
    server = ShuttleServer(model_dir=Path(model_dir), start_timeout=600)
    try:
        for concurrency in concurrencies:
            argv = ["--num-prompts", str(max(num_prompts, 4 * concurrency)), "--max-concurrency", str(concurrency),
                    "--input-len", str(input_len), "--output-len", str(output_len), "--range-ratio", "0.5",
                    "--seed", str(99 + concurrency)]  # one server: other prompts each run, or the prefix cache hits
            out = Path(f"bench_results/calibrate_serve_{concurrency}.json")
            bench_serve.main(["--url", server.url, *argv, "--result-json", str(out), "--no-progress"])
            runs.append((concurrency, argv, json.loads(out.read_text())))
    finally:
        server.stop()

    def simulated(candidate: StepCostModel, argv: list[str]) -> dict:
        sim_args = _sim_parser().parse_args(["--profile", "-", *argv])
        return simulate.build_simulator(sim_args, candidate).run(
            simulate.build_workload(sim_args, candidate)).summary()

    base = StepCostModel(dict(model.coefficients), model.scheduler_s, 0.0, dict(model.meta))
    (b_low, m_low), (b_high, m_high) = [(simulated(base, argv)["tpot_ms"]["mean"] / 1000,
                                         measured["tpot_ms"]["mean"] / 1000) for _, argv, measured in runs]
    f = (m_high - m_low) / (b_high - b_low) if b_high > b_low else m_high / b_high
    e = m_low - f * b_low
    if f < 0.3 or model.coefficients["step"] * f + e < 0:  # meaningless: a pure factor through both instead
        f, e = max((b_low * m_low + b_high * m_high) / (b_low ** 2 + b_high ** 2), 0.3), 0.0
    coefficients = {k: v * f for k, v in model.coefficients.items()}
    coefficients["step"] += e
    corrected = StepCostModel(coefficients, model.scheduler_s, 0.0, dict(model.meta))
    low, high = runs
    corrected.client_s = max(0.0, (low[2]["ttft_ms"]["median"] - simulated(corrected, low[1])["ttft_ms"]["median"])
                             / 1000)
    # the tail: the jitter whose simulated p99 ITL at the high concurrency comes closest to the measured one
    target = high[2]["itl_ms"]["p99"]
    errors = []
    for sigma in (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0):
        corrected.jitter = sigma
        errors.append((abs(simulated(corrected, high[1])["itl_ms"]["p99"] - target), sigma))
    corrected.jitter = min(errors)[1]
    report = []
    for concurrency, argv, measured in runs:
        check = simulated(corrected, argv)
        report.append({"concurrency": concurrency, "workload": argv,
                       "measured": {k: measured[f"{k}_ms"]["median"] for k in ("ttft", "itl", "tpot")},
                       "simulated": {k: check[f"{k}_ms"]["median"] for k in ("ttft", "itl", "tpot")}})
        print(f"serve check at concurrency {concurrency}: TPOT mean measured {measured['tpot_ms']['mean']:.1f} / "
              f"simulated {check['tpot_ms']['mean']:.1f} ms, ITL p50 {measured['itl_ms']['median']:.1f} / "
              f"{check['itl_ms']['median']:.1f} ms, TTFT p50 {measured['ttft_ms']['median']:.1f} / "
              f"{check['ttft_ms']['median']:.1f} ms")
    corrected.meta.update(serving_factor=f, serving_step_s=e, serve_check=report)
    print(f"serving: steps run {f:.2f}x their in-process time + {e * 1e3:.2f} ms; "
          f"client latency {corrected.client_s * 1e3:.2f} ms; step jitter sigma {corrected.jitter:.1f}")
    return corrected


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
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="largest chunk measured")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="largest decode batch measured")
    parser.add_argument("--repeats", type=int, default=5, help="decode steps per configuration (median kept)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--no-serve", action="store_true", help="skip the real-server stage (factor 1, client 0)")
    parser.add_argument("--serve-only", action="store_true",
                        help="keep the in-process fit already in --out and redo only the real-server stage")
    parser.add_argument("--serve-concurrency", type=int, nargs=2, default=[8, 128],
                        help="the low and the high concurrency of the two real-server runs")
    parser.add_argument("--serve-prompts", type=int, default=96)
    parser.add_argument("--serve-input-len", type=int, default=64)
    parser.add_argument("--serve-output-len", type=int, default=48)
    args = parser.parse_args(argv)
    start = time.time()
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs", flush=True)
    if args.serve_only:
        previous = StepCostModel.load(args.out)
        model = StepCostModel(previous.meta["in_process_coefficients"], previous.scheduler_s, 0.0, previous.meta)
    else:
        calibrator = Calibrator(args.model, args.dtype, args.max_model_len, attention_backend=args.attention_backend)
        model, measurements = calibrator.calibrate(args.max_num_batched_tokens, args.max_num_seqs, args.repeats,
                                                   progress=lambda line: print(line, flush=True))
        print(f"{'measurement':<60}{'ms':>10}{'fit ms':>10}")
        for m in measurements:
            print(f"{m.label:<60}{m.seconds * 1e3:10.2f}{model.predict(m.shape) * 1e3:10.2f}")
        model.meta["in_process_coefficients"] = dict(model.coefficients)
        del calibrator  # its model and cache: the server stage needs the memory and the cores
    if not args.no_serve:
        model = serve_check(args.model, model, args.serve_concurrency, args.serve_prompts, args.serve_input_len,
                            args.serve_output_len)
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
