"""`shuttle tune`: choose max_num_batched_tokens and max_num_seqs for given objectives: sweep them (and the request
rate) with the simulator, plot the trade-off, verify the best few with real `shuttle bench` runs, and recommend one.

For every (budget, seqs, rate) the simulator (`shuttle simulate`: the real Scheduler, a calibrated step-cost
profile, `shuttle bench`'s workload) predicts throughput, p99 TTFT, p99 ITL and goodput: requests per second whose
TTFT is within --ttft-slo-ms and whose mean inter-token time (TPOT) is within --itl-slo-ms, as `shuttle bench`
counts it. A setting "meets the objectives" at a rate when at least --attainment of its requests are good. The
settings are ranked by their most goodput at any rate where they meet the objectives; each is recommended at an
operating rate with headroom (the highest swept rate within --headroom of that rate where it still meets them),
since a machine's speed drifts and latency near saturation is steep. The best --verify candidates are then served
for real (`shuttle serve` with those flags, on free ports) and measured with `shuttle bench` on the same workload
at that rate.

Plots (PNG, in --out; matplotlib, the optional extra `tune`): pareto.png (throughput vs p99 TTFT and vs p99 ITL for
each token budget; lines join each budget's Pareto-optimal points), timeline.png (queue length and KV usage over
time for the recommendation, and at 1.5x its rate, where the queue grows).

    shuttle tune --model ../shared/models/stories260K --profile profiles/stories260K.json \\
        --ttft-slo-ms 500 --itl-slo-ms 50 --num-prompts 400
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from shuttle.capacity import bench_serve, simulate
from shuttle.common.arg_types import count, positive, positive_number, unit_fraction
from shuttle.common.config import SchedulerConfig
from shuttle.launcher.local_server import ShuttleServer
from shuttle.scheduler.step_cost import StepCostModel


@dataclass
class Point:
    """One simulated (budget, seqs, rate) and what it predicts."""

    max_num_batched_tokens: int
    max_num_seqs: int
    rate: float
    summary: dict

    @property
    def throughput(self) -> float:
        return self.summary["request_throughput"]

    @property
    def goodput(self) -> float:
        return self.summary["goodput"] or 0.0

    @property
    def attainment(self) -> float:
        done = self.summary["completed"]
        return self.goodput * self.summary["duration_s"] / done if done else 0.0

    def flags(self) -> list[str]:
        return ["--max-num-batched-tokens", str(self.max_num_batched_tokens), "--max-num-seqs", str(self.max_num_seqs)]

    def row(self) -> dict:
        return {"max_num_batched_tokens": self.max_num_batched_tokens, "max_num_seqs": self.max_num_seqs,
                "request_rate": self.rate, "throughput": self.throughput, "goodput": self.goodput,
                "attainment": self.attainment, "ttft_p99_ms": self.summary["ttft_ms"]["p99"],
                "itl_p99_ms": self.summary["itl_ms"]["p99"], "ttft_p50_ms": self.summary["ttft_ms"]["median"],
                "itl_p50_ms": self.summary["itl_ms"]["median"]}


def sweep(args: argparse.Namespace, cost: StepCostModel) -> list[Point]:
    points = []
    for budget, seqs, rate in itertools.product(args.budgets, args.seqs, args.rates):
        simulator = simulate.build_simulator(args, cost, max_num_seqs=seqs, max_num_batched_tokens=budget)
        result = simulator.run(simulate.build_workload(args, cost, rate))
        points.append(Point(budget, seqs, rate, result.summary(args.ttft_slo_ms, args.itl_slo_ms)))
    return points


def pareto(points: list[Point], latency) -> list[Point]:
    """Points no other point beats on both throughput (higher) and latency (lower), by throughput."""
    front = [p for p in points if not any(q.throughput >= p.throughput and latency(q) < latency(p)
                                          or q.throughput > p.throughput and latency(q) <= latency(p)
                                          for q in points)]
    return sorted(front, key=lambda p: p.throughput)


def _pyplot():
    """matplotlib's pyplot drawing to files, or SystemExit naming the extra that installs it."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("shuttle tune: its plots need matplotlib: pip install 'shuttle[tune]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_pareto(points: list[Point], best: Point, args: argparse.Namespace, path: Path) -> None:
    plt = _pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    metrics = (("ttft_ms", "p99 TTFT (ms)", args.ttft_slo_ms), ("itl_ms", "p99 ITL (ms)", args.itl_slo_ms))
    for ax, (key, label, slo) in zip(axes, metrics):
        def latency(p, key=key):
            return p.summary[key]["p99"]
        for budget in args.budgets:
            mine = [p for p in points if p.max_num_batched_tokens == budget]
            line, = ax.plot([p.throughput for p in pareto(mine, latency)],
                            [latency(p) for p in pareto(mine, latency)], marker="o", label=f"budget {budget}")
            ax.scatter([p.throughput for p in mine], [latency(p) for p in mine], s=10, alpha=0.35,
                       color=line.get_color())
        ax.scatter([best.throughput], [latency(best)], s=160, facecolors="none", edgecolors="black", linewidths=2,
                   label="recommended")
        if slo:
            ax.axhline(slo, color="gray", linestyle="--", linewidth=1, label="objective")
        ax.set_yscale("log")
        ax.set_xlabel("throughput (requests/s)")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"simulated: {Path(args.model).name}, every (max_num_seqs, rate) per token budget; lines: "
                 f"Pareto fronts", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_timeline(args: argparse.Namespace, cost: StepCostModel, best: Point, path: Path) -> None:
    plt = _pyplot()

    fig, axes = plt.subplots(2, 1, figsize=(9, 5), sharex=True)
    for rate, style in ((best.rate, "-"), (1.5 * best.rate, "--")):
        simulator = simulate.build_simulator(args, cost, max_num_seqs=best.max_num_seqs,
                                             max_num_batched_tokens=best.max_num_batched_tokens)
        result = simulator.run(simulate.build_workload(args, cost, rate))
        samples = simulate.timeline(result, points=600)
        t = [s["t"] for s in samples]
        axes[0].plot(t, [s["waiting"] for s in samples], style, label=f"{rate:.1f} req/s waiting")
        axes[0].plot(t, [s["running"] for s in samples], style, alpha=0.6, label=f"{rate:.1f} req/s running")
        axes[1].plot(t, [100 * s["kv_usage"] for s in samples], style, label=f"{rate:.1f} req/s")
    axes[0].set_ylabel("requests")
    axes[1].set_ylabel("KV blocks in use (%)")
    axes[1].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"simulated queue and KV usage: max_num_batched_tokens {best.max_num_batched_tokens}, "
                 f"max_num_seqs {best.max_num_seqs}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def verify(args: argparse.Namespace, point: Point) -> dict:
    """Serve the point's flags for real and run `shuttle bench` on the same workload; returns its summary."""
    with ShuttleServer(*point.flags(), "--kv-cache-memory", str(args.kv_cache_memory), model_dir=Path(args.model),
                       start_timeout=600) as server:
        out = Path(args.out) / f"bench_{point.max_num_batched_tokens}_{point.max_num_seqs}.json"
        argv = ["--url", server.url, "--num-prompts", str(args.num_prompts), "--request-rate", str(point.rate),
                "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--range-ratio",
                str(args.range_ratio), "--seed", str(args.seed), "--ttft-slo-ms", str(args.ttft_slo_ms),
                "--tpot-slo-ms", str(args.itl_slo_ms), "--result-json", str(out), "--no-progress"]
        if args.max_concurrency:
            argv += ["--max-concurrency", str(args.max_concurrency)]
        bench_serve.main(argv)
        return json.loads(out.read_text())


def limit_warnings(args, points: list, choice: dict, capacity: float | None) -> list[str]:
    """What makes the recommended rate doubtful: the setting met the objectives at the highest rate swept (its
    limit was not found), or the rate is above the capacity the simulator predicts (a run too short for a queue
    to build: every request is served before the overload shows)."""
    warnings = []
    key = (choice["max_num_batched_tokens"], choice["max_num_seqs"])
    top = max(args.rates)
    if any((p.max_num_batched_tokens, p.max_num_seqs) == key and p.rate == top and p.attainment >= args.attainment
           for p in points):
        warnings.append(f"this setting met the objectives at the highest rate swept ({top} req/s): its limit lies "
                        f"above; sweep higher --rates to find it")
    if capacity is not None and choice["request_rate"] > capacity:
        warnings.append(f"{choice['request_rate']} req/s is above the predicted capacity ({capacity:.1f} req/s): "
                        f"with {args.num_prompts} prompts the queue has no time to build; use more --num-prompts")
    return warnings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shuttle tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    simulate.add_config_args(parser)
    simulate.add_workload_args(parser)
    parser.add_argument("--model", required=True, help="model directory (for the real verification runs)")
    parser.add_argument("--budgets", type=positive, nargs="+", default=[128, 256, 512, 1024, 2048],
                        help="max_num_batched_tokens values")
    parser.add_argument("--seqs", type=positive, nargs="+", default=[8, 16, 32, 64, 128], help="max_num_seqs values")
    parser.add_argument("--rates", type=positive_number, nargs="+", default=None,
                        help="request rates (req/s); default: 15 steps of a tenth of the predicted capacity, up to "
                             "1.5x it")
    parser.add_argument("--ttft-slo-ms", type=positive_number, required=True)
    parser.add_argument("--itl-slo-ms", type=positive_number, required=True,
                        help="objective on each request's mean ITL (TPOT)")
    parser.add_argument("--attainment", type=unit_fraction, default=0.9,
                        help="share of good requests a setting must reach")
    parser.add_argument("--verify", type=count, default=2, help="candidates measured with real `shuttle bench` runs")
    parser.add_argument("--headroom", type=unit_fraction, default=0.8,
                        help="operate at most at this share of the highest rate that meets the objectives")
    parser.add_argument("--out", default="bench_results/tune")
    # swept over --budgets and --seqs: given as flags they would be overridden without a word
    parser.set_defaults(max_num_batched_tokens=None, max_num_seqs=None)
    args = parser.parse_args(argv)
    for flag, sweep_flag in (("--max-num-batched-tokens", "--budgets"), ("--max-num-seqs", "--seqs")):
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is not None:
            parser.error(f"{flag}: tune sweeps it; give the values to try with {sweep_flag}")
        setattr(args, name, getattr(SchedulerConfig(), name))  # the capacity run's: serve's default
    cost = simulate.load_profile(parser, args.profile)
    simulate.load_workload(parser, args, cost)  # a bad trace or too long a request: said now, not after the sweep
    simulate.require_model_dir(parser, args.model)  # the verification runs serve it, the plot names it
    _pyplot()  # and so is a missing matplotlib, before the sweep
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        parser.error(f"--out {args.out}: cannot make it ({exc.strerror or exc})")
    started = time.perf_counter()
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    capacity = None
    if args.rates is None:  # capacity: everything at once on the default budgets
        saturated = simulate.build_simulator(args, cost).run(simulate.build_workload(args, cost, float("inf")))
        capacity = saturated.summary()["request_throughput"]
        args.rates = [round(capacity * f / 10, 2) for f in range(1, 16)]
        print(f"predicted capacity {capacity:.1f} req/s; rates {args.rates}")
    points = sweep(args, cost)
    print(f"simulated {len(points)} settings x {args.num_prompts} requests in {time.perf_counter() - started:.1f} s")
    meeting = [p for p in points if p.attainment >= args.attainment]
    if not meeting:
        print("no setting meets the objectives at any rate swept; lower the rates or relax the objectives")
        return 1
    ranked = sorted(meeting, key=lambda p: (-p.goodput, p.summary["ttft_ms"]["p99"]))
    best = ranked[0]
    print(f"{'budget':>7}{'seqs':>6}{'rate':>8}{'thru':>8}{'goodput':>9}{'attain':>8}{'TTFT p99':>10}{'ITL p99':>9}")
    for p in ranked[:10]:
        r = p.row()
        print(f"{r['max_num_batched_tokens']:>7}{r['max_num_seqs']:>6}{r['request_rate']:>8.2f}{r['throughput']:>8.2f}"
              f"{r['goodput']:>9.2f}{r['attainment']:>8.2f}{r['ttft_p99_ms']:>10.1f}{r['itl_p99_ms']:>9.1f}")
    candidates, seen = [], set()
    for p in ranked:  # distinct settings in goodput order, each at its operating rate (with headroom)
        key = (p.max_num_batched_tokens, p.max_num_seqs)
        if key not in seen:
            seen.add(key)
            within = [q for q in meeting if (q.max_num_batched_tokens, q.max_num_seqs) == key
                      and q.rate <= args.headroom * p.rate]
            candidates.append(max(within, key=lambda q: q.rate) if within else p)
    best = candidates[0]
    plot_pareto(points, best, args, out / "pareto.png")
    plot_timeline(args, cost, best, out / "timeline.png")
    print(f"wrote {out / 'pareto.png'} and {out / 'timeline.png'}")
    verified = []
    for p in candidates[:args.verify]:
        print(f"verifying max_num_batched_tokens {p.max_num_batched_tokens}, max_num_seqs {p.max_num_seqs} at "
              f"{p.rate} req/s with shuttle bench (load average {os.getloadavg()[0]:.2f})", flush=True)
        measured = verify(args, p)
        done = measured["completed"]
        attained = measured["goodput"] * measured["duration_s"] / done if done else 0.0
        verified.append({**p.row(), "measured": {
            "throughput": measured["request_throughput"], "goodput": measured["goodput"], "attainment": attained,
            "ttft_p50_ms": measured["ttft_ms"]["median"], "ttft_p99_ms": measured["ttft_ms"]["p99"],
            "itl_p50_ms": measured["itl_ms"]["median"], "itl_p99_ms": measured["itl_ms"]["p99"]},
            "meets_objectives": attained >= args.attainment})
    if verified:
        print(f"{'setting':<22}{'':>10}{'goodput':>9}{'attain':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}"
              f"{'ITL p99':>9}")
        for v in verified:
            name = f"{v['max_num_batched_tokens']}/{v['max_num_seqs']} @{v['request_rate']}"
            m = v["measured"]
            print(f"{name:<22}{'predicted':>10}{v['goodput']:>9.2f}{v['attainment']:>8.2f}{v['ttft_p50_ms']:>10.1f}"
                  f"{v['ttft_p99_ms']:>10.1f}{v['itl_p50_ms']:>9.1f}{v['itl_p99_ms']:>9.1f}")
            print(f"{'':<22}{'measured':>10}{m['goodput']:>9.2f}{m['attainment']:>8.2f}{m['ttft_p50_ms']:>10.1f}"
                  f"{m['ttft_p99_ms']:>10.1f}{m['itl_p50_ms']:>9.1f}{m['itl_p99_ms']:>9.1f}")
    confirmed = [v for v in verified if v["meets_objectives"]]
    choice = max(confirmed, key=lambda v: v["measured"]["goodput"]) if confirmed else (verified or [best.row()])[0]
    status = "measured and meets the objectives" if confirmed else (
        "NOT confirmed by the real runs" if verified else "not verified")
    print(f"recommendation ({status}): --max-num-batched-tokens {choice['max_num_batched_tokens']} "
          f"--max-num-seqs {choice['max_num_seqs']} at up to {choice['request_rate']} req/s "
          f"(TTFT objective {args.ttft_slo_ms} ms, ITL objective {args.itl_slo_ms} ms, attainment "
          f"{args.attainment:.0%})")
    for warning in limit_warnings(args, points, choice, capacity):
        print(f"warning: {warning}")
    (out / "tune.json").write_text(json.dumps({
        "points": [p.row() for p in points], "recommendation": choice, "verified": verified,
        "objectives": {"ttft_slo_ms": args.ttft_slo_ms, "itl_slo_ms": args.itl_slo_ms,
                       "attainment": args.attainment}, "load_average": os.getloadavg()[0]}, indent=2))
    print(f"wrote {out / 'tune.json'}; load average {os.getloadavg()[0]:.2f}")
    return 0 if confirmed or not verified else 1
