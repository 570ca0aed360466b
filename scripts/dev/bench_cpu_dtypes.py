#!/usr/bin/env python3
"""Serving speed of the CPU weight formats: fp32, `--quantization int8` and bf16, measured with `shuttle bench`.

One `shuttle serve` per setting (--settings, names from SETTINGS) on --model, all started first (each loads and
checks its model once) and left running; then --rounds rounds, each running capacity/bench_serve.py's workload at
every --concurrency against every setting in turn, so a machine's slow minute falls on all settings alike. Each run
is --prompts-per-slot x concurrency random token-id prompts of --input-len tokens (range ratio 0: fixed lengths)
with --output-len tokens each (ignore_eos, greedy). Reported per setting and concurrency: the median over rounds
of the output token throughput, TPOT and TTFT, and the throughput ratio to the first setting. No assertions: it
prints a table and writes JSON.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/bench_cpu_dtypes.py --model /tmp/shuttle-models/llama-110m --json /tmp/dtypes.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from capacity.bench_serve import random_workload, run_benchmark, summarize  # noqa: E402
from launcher.local_server import ShuttleServer  # noqa: E402

SETTINGS = {
    "fp32": ["--dtype", "float32"],
    "int8": ["--dtype", "float32", "--quantization", "int8"],
    "bf16": ["--dtype", "bfloat16"],
    "bf16+int8": ["--dtype", "bfloat16", "--quantization", "int8"],
}


def bench_once(url: str, concurrency: int, args, vocab: int, seed: int) -> dict:
    specs = random_workload(args.prompts_per_slot * concurrency, args.input_len, args.output_len, 0.0, 0, vocab, seed)
    results, duration = asyncio.run(run_benchmark(url, specs, float("inf"), concurrency, seed, progress=False))
    return summarize(results, duration, None, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/shuttle-models/llama-110m")
    parser.add_argument("--settings", nargs="+", default=["fp32", "int8", "bf16"], choices=sorted(SETTINGS))
    parser.add_argument("--concurrency", nargs="+", type=int, default=[16, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompts-per-slot", type=int, default=2, help="prompts per concurrency slot and run")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32000, help="prompt token ids below this")
    parser.add_argument("--json", type=Path, default=None, help="write the runs and the table here")
    args = parser.parse_args()
    runs: list[dict] = []
    with ExitStack() as stack:
        servers = {}
        for name in args.settings:  # the server's own thread count: one per core it may use
            servers[name] = stack.enter_context(ShuttleServer(*SETTINGS[name], "--max-num-seqs",
                                                              str(max(args.concurrency)), model_dir=args.model,
                                                              start_timeout=600, worker_threads=None))
            print(f"{name}: {servers[name].url} ({' '.join(SETTINGS[name])})", flush=True)
        for name, server in servers.items():  # warm-up: first steps of every shape class
            bench_once(server.url, min(args.concurrency), args, args.vocab, seed=99)
        for r in range(args.rounds):
            for concurrency in args.concurrency:
                for name, server in servers.items():
                    s = bench_once(server.url, concurrency, args, args.vocab, seed=r)
                    runs.append({"setting": name, "concurrency": concurrency, "round": r,
                                 "output_tok_s": s["output_token_throughput"], "tpot_ms": s["tpot_ms"]["median"],
                                 "ttft_ms": s["ttft_ms"]["median"], "failed": s["failed"]})
                    print(f"round {r} c={concurrency} {name}: {s['output_token_throughput']:.1f} tok/s, "
                          f"TPOT {s['tpot_ms']['median']:.1f} ms, failed {s['failed']}", flush=True)
    table = []
    for concurrency in args.concurrency:
        base = None
        for name in args.settings:
            mine = [x for x in runs if x["setting"] == name and x["concurrency"] == concurrency]
            row = {"setting": name, "concurrency": concurrency,
                   **{k: statistics.median(x[k] for x in mine) for k in ("output_tok_s", "tpot_ms", "ttft_ms")}}
            base = base or row["output_tok_s"]
            row["vs_first"] = row["output_tok_s"] / base
            table.append(row)
    print(f"\n{Path(args.model).name}: medians of {args.rounds} interleaved rounds; {args.input_len}-token prompts, "
          f"{args.output_len} output tokens, {args.prompts_per_slot} x concurrency prompts per run")
    print(f"| setting | concurrency | output tok/s | vs {args.settings[0]} | median TPOT ms | median TTFT ms |")
    print("|---|---|---|---|---|---|")
    for row in table:
        print(f"| {row['setting']} | {row['concurrency']} | {row['output_tok_s']:.0f} | {row['vs_first']:.2f}x "
              f"| {row['tpot_ms']:.0f} | {row['ttft_ms']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"table": table, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
