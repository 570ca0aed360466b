#!/usr/bin/env python3
"""Serving speed of the CPU weight formats: fp32, `--quantization int8` and bf16, measured with `shuttle bench`,
optionally against llama.cpp's llama-server on the same model and beside CPU-bound neighbours.

One `shuttle serve` per setting (--settings, names from SETTINGS, the server's default thread count) on --model, and
one llama-server per --peers precision (the model converted by llama.cpp's converter to f32, bf16 or q8_0 GGUF;
continuous batching with max(--concurrency) slots and one thread per core this script may use), all started first
(each loads its model once) and left running; then --rounds rounds, each running capacity/bench_serve.py's workload
at every --concurrency against every server in turn, so a machine's slow minute falls on all of them alike. With
--hogs N each round runs every server twice, alone and beside N CPU-bound processes (busy loops, each in a session
of its own, stopped by PID). Each run is --prompts-per-slot x concurrency random token-id prompts of --input-len
tokens (range ratio 0: fixed lengths) with --output-len tokens each (ignore_eos, greedy), one connection per
request (llama-server closes a connection after each streamed response). Reported per server, condition and
concurrency: the median over rounds of the output token throughput, TPOT and TTFT, the throughput ratio to the
first server, and beside hogs the slowdown against alone. No assertions: it prints a table and writes JSON.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/bench_cpu_dtypes.py --model /tmp/shuttle-models/llama-110m --json /tmp/dtypes.json
    bash scripts/dev/build_llama_server.sh      # once, optional: llama-server as a peer
    .venv/bin/python scripts/dev/bench_cpu_dtypes.py --model /tmp/shuttle-models/llama-110m --peers f32 bf16 q8_0 \
        --hogs 2 --json /tmp/dtypes.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

from bench_threads import start_hogs, stop_hogs  # scripts/dev, this script's own directory
from llama_server import LLAMA_SERVER, LlamaServer, convert_to_gguf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.capacity.bench_serve import random_workload, run_benchmark, served_vocab_size, summarize  # noqa: E402
from shuttle.launcher.local_server import ShuttleServer  # noqa: E402

SETTINGS = {
    "default": [],  # the server's own choice (--dtype auto: fp32 on a CPU without bf16 matrix units)
    "fp32": ["--dtype", "float32"],
    "int8": ["--dtype", "float32", "--quantization", "int8"],
    "bf16": ["--dtype", "bfloat16"],
    "bf16+int8": ["--dtype", "bfloat16", "--quantization", "int8"],
}


def bench_once(url: str, concurrency: int, args, vocab: int, seed: int) -> dict:
    specs = random_workload(args.prompts_per_slot * concurrency, args.input_len, args.output_len, 0.0, 0, vocab, seed)
    results, duration = asyncio.run(run_benchmark(url, specs, float("inf"), concurrency, seed, progress=False,
                                                  keep_alive=False))
    return summarize(results, duration, None, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/shuttle-models/llama-110m")
    parser.add_argument("--settings", nargs="+", default=["fp32", "int8", "bf16"], choices=sorted(SETTINGS))
    parser.add_argument("--peers", nargs="*", default=[], choices=["f32", "bf16", "q8_0"],
                        help="llama-server on the model converted to these GGUF types")
    parser.add_argument("--hogs", type=int, default=0, help="also run every round beside this many busy loops")
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per concurrency slot and run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=None,
                        help="prompt token ids below this (default: the vocab_size shuttle reports)")
    parser.add_argument("--json", type=Path, default=None, help="write the runs and the table here")
    args = parser.parse_args()
    conditions = ["alone"] + ([f"beside {args.hogs} hogs"] if args.hogs else [])
    runs: list[dict] = []
    if not Path(args.model, "config.json").exists():
        parser.error(f"{args.model} is not a model directory (no config.json)")
    try:  # the peers' files before any server starts, so that a missing build fails at once
        ggufs = {outtype: convert_to_gguf(args.model, outtype) for outtype in args.peers}
        if args.peers and not LLAMA_SERVER.exists():
            raise RuntimeError(f"{LLAMA_SERVER} is missing: run scripts/dev/build_llama_server.sh")
    except RuntimeError as exc:
        parser.error(str(exc))
    with ExitStack() as stack:
        servers = {}
        for name in args.settings:  # the server's own thread count: one per core it may use
            servers[name] = stack.enter_context(ShuttleServer(*SETTINGS[name], "--max-num-seqs",
                                                              str(max(args.concurrency)), model_dir=args.model,
                                                              start_timeout=600, worker_threads=None))
            print(f"{name}: {servers[name].url} ({' '.join(SETTINGS[name])})", flush=True)
        vocab = args.vocab or asyncio.run(served_vocab_size(next(iter(servers.values())).url, None))
        for outtype in args.peers:
            name = f"llama-server {outtype}"
            servers[name] = stack.enter_context(LlamaServer(
                ggufs[outtype], slots=max(args.concurrency),
                context_per_slot=args.input_len + args.output_len + 16, threads=len(os.sched_getaffinity(0))))
            print(f"{name}: {servers[name].url} ({' '.join(servers[name].command[1:])})", flush=True)
        for server in servers.values():  # warm-up: first steps of every shape class
            bench_once(server.url, min(args.concurrency), args, vocab, seed=99)
        for r in range(args.rounds):
            for condition in conditions:
                hogs = start_hogs(args.hogs) if condition != "alone" else []
                try:
                    for concurrency in args.concurrency:
                        for name, server in servers.items():
                            s = bench_once(server.url, concurrency, args, vocab, seed=r)
                            runs.append({"setting": name, "condition": condition, "concurrency": concurrency,
                                         "round": r, "output_tok_s": s["output_token_throughput"],
                                         "tpot_ms": s["tpot_ms"]["median"], "ttft_ms": s["ttft_ms"]["median"],
                                         "output_tokens": s["total_output_tokens"], "failed": s["failed"]})
                            print(f"round {r} {condition} c={concurrency} {name}: "
                                  f"{s['output_token_throughput']:.1f} tok/s, TPOT {s['tpot_ms']['median']:.1f} ms, "
                                  f"{s['total_output_tokens']} tokens, failed {s['failed']}", flush=True)
                finally:
                    stop_hogs(hogs)
    table = summary_table(runs, list(servers), conditions, args.concurrency)
    print(f"\n{Path(args.model).name}: medians of {args.rounds} interleaved rounds; {args.input_len}-token prompts, "
          f"{args.output_len} output tokens, {args.prompts_per_slot} x concurrency prompts per run")
    first = next(iter(servers))
    print(f"| server | condition | concurrency | output tok/s | vs {first} | vs alone | median TPOT ms "
          f"| median TTFT ms | failed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['setting']} | {row['condition']} | {row['concurrency']} | {row['output_tok_s']:.0f} "
              f"| {row['vs_first']:.2f}x | {row['vs_alone']:.2f}x | {row['tpot_ms']:.0f} | {row['ttft_ms']:.0f} "
              f"| {row['failed']} |")
    if args.json:
        args.json.write_text(json.dumps({"table": table, "runs": runs}, indent=1))
    return 0


def summary_table(runs: list[dict], names: list[str], conditions: list[str], concurrencies: list[int]) -> list[dict]:
    """One row per (condition, concurrency, server): medians over rounds; vs_first is the throughput over the first
    server's in the same condition and concurrency, vs_alone over the same server's alone; failed is summed."""
    table = []
    for condition in conditions:
        for concurrency in concurrencies:
            for name in names:
                mine = [x for x in runs if (x["setting"], x["condition"], x["concurrency"]) ==
                        (name, condition, concurrency)]
                row = {"setting": name, "condition": condition, "concurrency": concurrency,
                       "failed": sum(x["failed"] for x in mine),
                       **{k: statistics.median(x[k] for x in mine) for k in ("output_tok_s", "tpot_ms", "ttft_ms")}}
                table.append(row)
    for row in table:
        first = next(x for x in table if (x["condition"], x["concurrency"]) == (row["condition"], row["concurrency"]))
        alone = next(x for x in table if (x["setting"], x["condition"], x["concurrency"]) ==
                     (row["setting"], conditions[0], row["concurrency"]))
        row["vs_first"] = row["output_tok_s"] / first["output_tok_s"]
        row["vs_alone"] = row["output_tok_s"] / alone["output_tok_s"]
    return table


if __name__ == "__main__":
    sys.exit(main())
