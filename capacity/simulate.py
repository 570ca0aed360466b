"""`shuttle simulate`: predict what a workload will feel like on a configuration, without a model: the real
Scheduler in virtual time (capacity/simulator.py) with a calibrated step-cost profile (`shuttle calibrate`). Prints
`shuttle bench`'s table (TTFT, TPOT, ITL, e2e percentiles, throughput, goodput) plus preemptions and the queue, and
writes JSON with queue length and KV usage over time.

By default the workload is `shuttle bench`'s own (same generator, same seed, same Poisson arrivals), so a
prediction can be set next to a real run flag for flag:

    shuttle simulate --profile profiles/stories260K.json --num-prompts 10000 --request-rate 40
    shuttle bench --num-prompts 10000 --request-rate 40      # the real thing, against a running server
    shuttle simulate --profile profiles/llama-110m.json --max-concurrency 16 --input-len 256 --range-ratio 0.9 \\
        --num-prompts 64

--burstiness < 1 draws bursty (gamma) arrivals instead; --trace reads a JSONL trace (capacity/workload.py). The
flag and profile helpers here serve `shuttle tune` and scripts/dev/compare_inprocess.py too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from typing import cast

from shuttle.capacity import bench_serve
from shuttle.capacity.simulator import SimResult, Simulator
from shuttle.capacity.workload import SimRequest, arrivals, from_trace
from shuttle.common.arg_types import add_config_options, output_file, positive, positive_number
from shuttle.common.capacity import kv_blocks_for_memory
from shuttle.common.config import CacheConfig, SchedulerConfig
from shuttle.common.errors import ModelDirError
from shuttle.common.model_config import ModelConfig
from shuttle.common.model_dir import check_model_dir
from shuttle.scheduler.step_cost import StepCostModel


def bench_serve_workload(num_prompts: int, request_rate: float, input_len: int, output_len: int, range_ratio: float,
                         shared_prefix_len: int, vocab_size: int, seed: int,
                         burstiness: float = 1.0) -> list[SimRequest]:
    """`shuttle bench`'s random workload and its arrivals: request k is sent after k exponential gaps drawn from
    random.Random(seed + 1) (gamma gaps with another burstiness)."""
    specs = bench_serve.random_workload(num_prompts, input_len, output_len, range_ratio, shared_prefix_len,
                                        vocab_size, seed)
    if burstiness != 1.0:
        times = arrivals(num_prompts, request_rate, burstiness, seed + 1)
    else:
        rng, now, times = random.Random(seed + 1), 0.0, []
        for _ in specs:
            times.append(now)
            if request_rate != float("inf"):
                now += rng.expovariate(request_rate)
    # random_workload's prompts are token ids, never text
    return [SimRequest(t, cast(list[int], spec.prompt), spec.max_tokens) for t, spec in zip(times, specs)]


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """The serving flags the simulation honours, declared and named as in `shuttle serve`."""
    parser.add_argument("--profile", required=True, help="step-cost profile JSON from `shuttle calibrate`")
    parser.add_argument("--max-model-len", type=positive, default=None, help="default: the profile's")
    add_config_options(parser, SchedulerConfig, ["max_num_seqs", "max_num_batched_tokens", "max_waiting_requests",
                                                 "scheduling_policy", "async_scheduling"])
    add_config_options(parser, CacheConfig, ["block_size", "num_kv_blocks", "kv_cache_memory",
                                             "enable_prefix_caching"])


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    bench_serve.add_request_shape_args(parser)
    parser.add_argument("--burstiness", type=positive_number, default=1.0,
                        help="1: Poisson; < 1 burstier (gamma gaps)")
    parser.add_argument("--trace", default=None, help="JSONL trace instead of random prompts (capacity/workload.py)")


def build_simulator(args: argparse.Namespace, cost: StepCostModel, ttft_slo_ms: float = 0.0,
                    max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None) -> Simulator:
    """A Simulator for the flags (budgets overridable for sweeps); KV blocks as the worker would size them."""
    max_model_len = args.max_model_len or cost.meta["max_model_len"]
    blocks = kv_blocks(args, cost)
    config = SchedulerConfig(max_num_seqs=max_num_seqs or args.max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens or args.max_num_batched_tokens,
                             max_waiting_requests=args.max_waiting_requests,
                             scheduling_policy=args.scheduling_policy, async_scheduling=args.async_scheduling,
                             ttft_slo_ms=ttft_slo_ms)
    return Simulator(config, blocks, args.block_size, max_model_len, cost,
                     enable_prefix_caching=args.enable_prefix_caching, max_concurrency=args.max_concurrency,
                     seed=args.seed)


def kv_blocks(args: argparse.Namespace, cost: StepCostModel) -> int:
    """The KV cache's blocks for the flags, as the worker would size them (--num-kv-blocks, else
    --kv-cache-memory at the profile's bytes per token)."""
    return args.num_kv_blocks or kv_blocks_for_memory(args.kv_cache_memory, cost.meta["kv_bytes_per_token"],
                                                      args.block_size)


def build_workload(args: argparse.Namespace, cost: StepCostModel,
                   request_rate: float | None = None) -> list[SimRequest]:
    rate = args.request_rate if request_rate is None else request_rate
    if args.trace:
        return from_trace(args.trace, rate if rate != float("inf") else None, args.burstiness, args.seed,
                          cost.meta.get("vocab_size", 32000))
    return bench_serve_workload(args.num_prompts, rate, args.input_len, args.output_len, args.range_ratio,
                                args.shared_prefix_len, cost.meta.get("vocab_size", 32000), args.seed, args.burstiness)


def load_profile(parser: argparse.ArgumentParser, path: str) -> StepCostModel:
    """The --profile, or a one-line usage error (exit 2) naming what is wrong with it."""
    try:
        cost = StepCostModel.load(path)
    except ValueError as exc:
        parser.error(str(exc))
    missing = [key for key in ("max_model_len", "kv_bytes_per_token") if key not in cost.meta]
    if missing:
        parser.error(f"{path}: its meta lacks {', '.join(missing)}, which the simulation needs (`shuttle calibrate` "
                     f"writes them)")
    return cost


def require_model_dir(parser: argparse.ArgumentParser, model_dir: str, max_model_len: int | None = None) -> None:
    """The model directory a command serves for real (`shuttle serve`'s check), or a one-line usage error (exit 2)
    before any work."""
    try:
        check_model_dir(model_dir)
        ModelConfig.from_dir(model_dir, max_model_len)
    except ModelDirError as exc:
        parser.error(str(exc))


def load_workload(parser: argparse.ArgumentParser, args: argparse.Namespace, cost: StepCostModel,
                  request_rate: float | None = None) -> list[SimRequest]:
    """build_workload, or a one-line usage error (exit 2): a bad trace, a --max-model-len past the profile's (the
    model's, which the server would refuse), or a request longer than max_model_len or than the whole KV cache
    (which a real server would refuse with 400, and the simulated scheduler could never place)."""
    if args.max_model_len is not None and args.max_model_len > cost.meta["max_model_len"]:
        parser.error(f"--max-model-len {args.max_model_len} exceeds the profile's {cost.meta['max_model_len']} (the "
                     f"model's, as calibrated)")
    try:
        workload = build_workload(args, cost, request_rate)
    except ValueError as exc:
        parser.error(str(exc))
    max_model_len = args.max_model_len or cost.meta["max_model_len"]
    longest = max(workload, key=lambda w: len(w.prompt_token_ids) + w.output_len)
    needed = len(longest.prompt_token_ids) + longest.output_len
    if needed > max_model_len:
        parser.error(f"the workload's longest request ({len(longest.prompt_token_ids)} prompt + {longest.output_len} "
                     f"output tokens) exceeds max_model_len {max_model_len}: shorten --input-len, --output-len or "
                     f"--range-ratio (or the trace)")
    cache_tokens = kv_blocks(args, cost) * args.block_size
    if needed > cache_tokens:
        parser.error(f"the workload's longest request ({needed} tokens) needs more KV cache than the whole cache "
                     f"holds ({cache_tokens} tokens): raise --num-kv-blocks or --kv-cache-memory")
    return workload


def print_summary(summary: dict) -> None:
    bench_serve.print_table({**summary, "failed": summary["failed"] + summary["refused"], "errors": []})
    print(f"{'steps':<28}{summary['num_steps']:>12}   preemptions {summary['num_preemptions']}, "
          f"refused {summary['refused']}, most waiting {summary['max_waiting']}, "
          f"most KV in use {100 * summary['max_kv_usage']:.1f}%")


def timeline(result: SimResult, points: int = 400) -> list[dict]:
    """Queue length, running and KV usage over time, thinned to about `points` samples."""
    stride = max(1, len(result.samples) // points)
    return [{"t": s.time, "waiting": s.num_waiting, "running": s.num_running, "kv_usage": s.kv_usage}
            for s in result.samples[::stride]]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shuttle simulate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(parser)
    add_workload_args(parser)
    parser.add_argument("--ttft-slo-ms", type=positive_number, default=None,
                        help="goodput objective; with --slo-admission also the server's --ttft-slo-ms")
    parser.add_argument("--tpot-slo-ms", "--itl-slo-ms", dest="tpot_slo_ms", type=positive_number, default=None)
    parser.add_argument("--slo-admission", action="store_true", help="simulate `shuttle serve --ttft-slo-ms`")
    parser.add_argument("--result-json", default="bench_results/simulate.json", type=output_file)
    args = parser.parse_args(argv)
    if args.slo_admission and args.ttft_slo_ms is None:
        parser.error("--slo-admission needs --ttft-slo-ms (the objective the simulated server admits by)")
    cost = load_profile(parser, args.profile)
    workload = load_workload(parser, args, cost)
    simulator = build_simulator(args, cost, args.ttft_slo_ms if args.slo_admission and args.ttft_slo_ms else 0.0)
    start = time.perf_counter()
    result = simulator.run(workload)
    elapsed = time.perf_counter() - start
    summary = result.summary(args.ttft_slo_ms, args.tpot_slo_ms)
    print_summary(summary)
    print(f"simulated {len(workload)} requests in {elapsed:.2f} s (load average {os.getloadavg()[0]:.2f})")
    if args.result_json:  # its folder made by the parser (output_file)
        config = {k: v for k, v in vars(args).items()}
        config["request_rate"] = str(args.request_rate)
        with open(args.result_json, "w") as f:
            json.dump({**summary, "config": config, "timeline": timeline(result)}, f, indent=2)
        print(f"wrote {args.result_json}")
    return 0
