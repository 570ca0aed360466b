#!/usr/bin/env python3
"""Judge a step-cost profile and the simulator against the in-process engine on this machine.

Serves a workload (`shuttle bench`'s, as `shuttle simulate` builds it) with the in-process engine: the real
Scheduler and ModelRunner in one loop, in real time, one step in flight, no HTTP (capacity/calibrate.py's
Calibrator.serve). Then it simulates the same workload with the profile, and prints

- each step's predicted time against its measured one, for decode steps and for steps with prefill apart: the
  median and p90 of |predicted / measured - 1| and the median ratio;
- TTFT and ITL p50 and p99, measured and simulated, and the gap; and simulated again with every step exactly its
  prediction (the profile's spread left out), to show what the spread adds.

Nothing is fitted to the run. --rounds repeats calibration, serving and simulation and reports the median gaps,
since on a shared machine the drift between a calibration and the run after it decides much of a round's gap. On a
shared machine whose speed drifts, --recalibrate first measures the grid
(`shuttle calibrate`'s) in the same process and uses that profile, so that both see the same load; --load sets the
request rate to that share of the simulator's saturated throughput (everything sent at once). For example, near
saturation of stories260K:

    OMP_NUM_THREADS=1 .venv/bin/python scripts/dev/compare_inprocess.py --model ../shared/models/stories260K \\
        --profile profiles/stories260K.json --recalibrate /tmp/stories260K.json --load 0.8 --num-prompts 300 \\
        --num-kv-blocks 4096
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shuttle.capacity import simulate  # noqa: E402
from shuttle.capacity.calibrate import Calibrator  # noqa: E402
from shuttle.common.arg_types import positive, positive_number  # noqa: E402
from shuttle.scheduler.step_cost import StepCostModel, StepShape  # noqa: E402


def step_errors(cost: StepCostModel, steps: list[tuple[StepShape, float]]) -> dict[str, dict]:
    """For decode-only steps, steps with prefill only, mixed steps (prefill chunks and decodes) and all: count,
    median and p90 of |predicted / measured - 1|, the median of predicted / measured, and the time-weighted ratio
    (predicted seconds summed over measured seconds summed: near saturation, what decides how fast the queue
    drains)."""
    report = {}
    for kind, chosen in (("decode", [s for s in steps if s[0].num_prefill_seqs == 0]),
                         ("prefill", [s for s in steps if s[0].num_prefill_seqs > 0 and s[0].num_decode_seqs == 0]),
                         ("mixed", [s for s in steps if s[0].num_prefill_seqs > 0 and s[0].num_decode_seqs > 0]),
                         ("all", steps)):
        ratios = sorted(cost.predict(shape) / seconds for shape, seconds in chosen)
        errors = sorted(abs(r - 1) for r in ratios)
        measured = sum(seconds for _, seconds in chosen)
        report[kind] = {"steps": len(ratios),
                        "median_abs_error": statistics.median(errors) if errors else None,
                        "p90_abs_error": errors[int(0.9 * (len(errors) - 1))] if errors else None,
                        "median_ratio": statistics.median(ratios) if ratios else None,
                        "time_weighted_ratio": sum(cost.predict(shape) for shape, _ in chosen) / measured
                        if measured else None,
                        "measured_s": measured}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_config_args(parser)
    simulate.add_workload_args(parser)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default=None, help="default: the profile's")
    parser.add_argument("--recalibrate", type=Path, default=None, metavar="OUT",
                        help="measure the grid first and use (and write) that profile instead of --profile's fit")
    parser.add_argument("--load", type=positive_number, default=None,
                        help="request rate as this share of the simulated saturated throughput (overrides "
                             "--request-rate)")
    parser.add_argument("--rounds", type=positive, default=1,
                        help="repeat calibrate (with --recalibrate), serve and simulate; report each and the "
                             "median gaps")
    parser.add_argument("--result-json", default="bench_results/compare_inprocess.json")
    args = parser.parse_args(argv)
    cost = simulate.load_profile(parser, args.profile)
    simulate.require_model_dir(parser, args.model, args.max_model_len)
    simulate.load_workload(parser, args, cost)  # a bad workload is said before any work
    args.async_scheduling = False  # the in-process loop has one step in flight
    blocks = simulate.build_simulator(args, cost).scheduler.kv.pool.num_blocks
    max_model_len = args.max_model_len or cost.meta["max_model_len"]
    grid_blocks = 128 * -(-min(max_model_len, 2048) // args.block_size) + 16  # what the grid needs (Calibrator)
    calibrator = Calibrator(args.model, args.dtype or cost.meta.get("dtype", "float32"), max_model_len,
                            args.block_size, num_kv_blocks=max(blocks, grid_blocks if args.recalibrate else 0))
    rounds = [one_round(args, calibrator, cost, blocks, i) for i in range(args.rounds)]
    if args.rounds > 1:
        for key, label in (("gaps", "with the profile's spread"), ("gaps_without_spread", "without it")):
            print(f"median over {args.rounds} rounds, {label}: " + ", ".join(
                f"{name} {100 * statistics.median(r[key][name] for r in rounds):+.1f}%" for name in rounds[0][key]))
        print("time-weighted step ratio " + ", ".join(f"{r['steps']['all']['time_weighted_ratio']:.3f}"
                                                     for r in rounds))
    if args.result_json:
        Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_json).write_text(json.dumps({"rounds": rounds}, indent=2) + "\n")
        print(f"wrote {args.result_json}")
    return 0


def one_round(args, calibrator: Calibrator, cost: StepCostModel, blocks: int, index: int) -> dict:
    """Calibrate (with --recalibrate), serve the workload in process, simulate it; print and return the step
    errors and the latency gaps."""
    if args.recalibrate:
        cost, _ = calibrator.calibrate(2048, 128, progress=lambda line: None)
        path = args.recalibrate if index == 0 else args.recalibrate.with_suffix(f".{index}.json")
        cost.save(path)
        print(f"recalibrated: relative RMS error {cost.meta['rel_rmse']:.3f} over the grid; wrote {path}",
              flush=True)
    if args.load:
        saturated = simulate.build_simulator(args, cost).run(simulate.build_workload(args, cost, float("inf")))
        args.request_rate = args.load * saturated.summary()["request_throughput"]
        print(f"request rate {args.request_rate:.2f} req/s: {args.load} x the simulated saturated throughput")
    workload = simulate.build_workload(args, cost)
    simulator = simulate.build_simulator(args, cost)
    print(f"serving {len(workload)} requests in process ({blocks} KV blocks)", flush=True)
    measured = calibrator.serve(workload, simulator.config, blocks)
    simulated = simulator.run(workload).summary()
    # the same simulation with every step exactly its prediction: what the profile's spread adds
    steady = simulate.build_simulator(args, dataclasses.replace(cost, spread=())).run(workload).summary()
    real = measured.result.summary()
    steps = step_errors(cost, measured.steps)
    for kind, row in steps.items():
        if row["steps"]:
            print(f"{kind} steps: {row['steps']}, |predicted / measured - 1| median {row['median_abs_error']:.3f}, "
                  f"p90 {row['p90_abs_error']:.3f}; median ratio {row['median_ratio']:.3f}, time-weighted "
                  f"{row['time_weighted_ratio']:.3f} over {row['measured_s']:.2f} s")
    gaps, steady_gaps = {}, {}
    print(f"{'':<10}{'measured ms':>14}{'simulated ms':>14}{'gap':>8}{'without spread':>16}{'gap':>8}")
    for metric in ("ttft", "itl"):
        for stat in ("median", "p99"):
            a, b, c = (x[f"{metric}_ms"][stat] for x in (real, simulated, steady))
            gaps[f"{metric}_{stat}"] = b / a - 1 if a else None
            steady_gaps[f"{metric}_{stat}"] = c / a - 1 if a else None
            print(f"{metric + ' ' + stat:<10}{a:14.2f}{b:14.2f}{100 * (b / a - 1) if a else 0:7.1f}%"
                  f"{c:16.2f}{100 * (c / a - 1) if a else 0:7.1f}%")
    print(f"throughput {real['request_throughput']:.2f} req/s measured, {simulated['request_throughput']:.2f} "
          f"simulated; {real['num_steps']} / {simulated['num_steps']} steps", flush=True)
    return {"request_rate": args.request_rate, "measured": real, "simulated": simulated, "gaps": gaps,
            "gaps_without_spread": steady_gaps, "steps": steps}


if __name__ == "__main__":
    sys.exit(main())
