#!/usr/bin/env python3
"""Set the simulator's prediction next to a real bench_serve.py run of the same workload (issue 12 acceptance 2).

Takes bench_serve.py's workload flags and `shuttle serve` flags, simulates the workload with the profile, serves
the model for real with the same flags, runs bench_serve.py, and prints p50/p99 TTFT and ITL side by side with
the verdict: within 15% or 20 ms, whichever is larger.

On a machine whose other tenants come and go, the speed of the same server changes from one minute to the next;
--recalibrate first redoes calibrate.py's real-server stage (two short runs of its own workload, not this one)
on top of the profile's in-process fit, so that calibration and measurement share one window.

    .venv/bin/python scripts/check_simulator.py --model ../shared/models/stories260K \\
        --profile profiles/stories260K.json --num-prompts 400 --request-rate 30
    .venv/bin/python scripts/check_simulator.py --model /tmp/shuttle-models/llama-110m \\
        --profile profiles/llama-110m.json --num-prompts 64 --max-concurrency 16 --input-len 256 --range-ratio 1.0
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_serve  # noqa: E402
import simulate  # noqa: E402
from common.step_cost import StepCostModel  # noqa: E402

TOLERANCE = 0.15
FLOOR_MS = 20.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_config_args(parser)
    simulate.add_workload_args(parser)
    parser.add_argument("--model", required=True)
    parser.add_argument("--json", type=Path, default=Path("bench_results/check_simulator.json"))
    parser.add_argument("--recalibrate", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="redo the real-server calibration stage at these two concurrencies first")
    parser.add_argument("--rate-fraction", type=float, default=None,
                        help="instead of --request-rate: this share of the capacity the simulator predicts")
    args = parser.parse_args(argv)
    cost = StepCostModel.load(args.profile)
    if args.recalibrate:
        import calibrate
        base = StepCostModel(cost.meta["in_process_coefficients"], cost.scheduler_s, 0.0, cost.meta)
        cost = calibrate.serve_check(args.model, base, args.recalibrate, 32, 64, 48)
    if args.rate_fraction:  # near saturation, wherever saturation is on this machine now
        saturated = simulate.build_simulator(args, cost).run(simulate.build_workload(args, cost, float("inf")))
        args.request_rate = round(args.rate_fraction * saturated.summary()["request_throughput"], 2)
        print(f"predicted capacity {saturated.summary()['request_throughput']:.2f} req/s; rate {args.request_rate}")
    predicted = simulate.build_simulator(args, cost).run(simulate.build_workload(args, cost)).summary()
    serve_flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
                   str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
                   "--kv-cache-memory", str(args.kv_cache_memory)]
    bench_argv = ["--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate),
                  "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                  "--range-ratio", str(args.range_ratio), "--seed", str(args.seed), "--no-progress"]
    if args.max_concurrency:
        bench_argv += ["--max-concurrency", str(args.max_concurrency)]
    from tests.server import ShuttleServer

    load_before = os.getloadavg()
    server = ShuttleServer(*serve_flags, model_dir=Path(args.model), start_timeout=600)
    try:
        out = args.json.with_suffix(".bench.json")
        bench_serve.main(["--url", server.url, *bench_argv, "--result-json", str(out)])
        measured = json.loads(out.read_text())
    finally:
        server.stop()
    load_after = os.getloadavg()
    rows, ok = [], True
    print(f"{'':<10}{'predicted ms':>14}{'measured ms':>14}{'error':>10}  within 15% or 20 ms")
    for metric in ("ttft", "itl"):
        for stat in ("median", "p99"):
            p, m = predicted[f"{metric}_ms"][stat], measured[f"{metric}_ms"][stat]
            within = abs(p - m) <= max(TOLERANCE * m, FLOOR_MS)
            ok &= within
            rows.append({"metric": f"{metric} {stat}", "predicted_ms": p, "measured_ms": m, "within": within})
            name = f"{metric.upper()} {'p50' if stat == 'median' else stat}"
            print(f"{name:<10}{p:>14.1f}{m:>14.1f}{100 * (p - m) / m if m else 0:>9.1f}%  {'yes' if within else 'NO'}")
    print(f"throughput req/s: predicted {predicted['request_throughput']:.2f}, measured "
          f"{measured['request_throughput']:.2f}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"rows": rows, "predicted": predicted, "measured": measured,
                                     "load_average": [load_before[0], load_after[0]],
                                     "config": {k: str(v) for k, v in vars(args).items()}}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
