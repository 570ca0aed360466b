#!/usr/bin/env python3
"""What placing the serving groups with Ray costs: `shuttle bench` against `--data-parallel-size 2` with
`--distributed-executor-backend ray` and with `mp`, on the same machine, interleaved rounds.

A local Ray cluster (ray.cluster_utils: one head node, started and stopped by this script) serves the Ray rounds. Each
round starts the server, times its start-up (launch to the ready line), runs `shuttle bench` (random prompts of
fixed lengths, ignore_eos, the total output checked to be exactly what was asked) and stops the server by PID.
Prints output tokens/s, TTFT and ITL p50/p99 per round, the median ratio Ray / mp, and writes JSON. Figures are
ratios from one run on a quiet machine; the absolute times depend on the host.

    .venv/bin/python scripts/dev/bench_ray.py --model ../shared/models/stories260K
    .venv/bin/python scripts/dev/bench_ray.py --model /tmp/shuttle-models/llama-110m --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.launcher.local_server import ShuttleServer  # noqa: E402


def run_round(backend: str, args: argparse.Namespace, address: str) -> dict:
    """Start the server on `backend`, bench it, stop it: the round's figures."""
    flags = ["--data-parallel-size", "2", "--worker-threads", str(args.threads), "--kv-cache-memory", "256MiB",
             "--distributed-executor-backend", backend] + (["--ray-address", address] if backend == "ray" else [])
    began = time.monotonic()
    server = ShuttleServer(*flags, model_dir=args.model, worker_threads=None, start_timeout=300,
                           stderr=args.log)  # the processes' lines, off this table
    start_s = time.monotonic() - began
    try:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "bench", "--url", server.url,
                            "--num-prompts", str(args.num_prompts), "--max-concurrency", str(args.concurrency),
                            "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                            "--range-ratio", "0",
                            "--seed", str(args.seed), "--result-json", out.name, "--no-progress"],
                           check=True, capture_output=True, text=True)
            result = json.loads(Path(out.name).read_text())
    finally:
        server.stop()
    expected = args.num_prompts * args.output_len
    if result["failed"] or result["total_output_tokens"] != expected:
        raise SystemExit(f"{backend}: {result['failed']} failed, {result['total_output_tokens']} of {expected} tokens")
    return {"backend": backend, "start_s": start_s, "output_tok_s": result["output_token_throughput"],
            "ttft_p50_ms": result["ttft_ms"]["median"], "ttft_p99_ms": result["ttft_ms"]["p99"],
            "itl_p50_ms": result["itl_ms"]["median"], "itl_p99_ms": result["itl_ms"]["p99"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="worker threads per rank (a Ray bundle's CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_ray.json")
    parser.add_argument("--log", default="bench_ray.log", help="where the servers' processes log")
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2 * args.threads, "include_dashboard": False})
    rows = []
    try:
        for r in range(args.rounds):
            order = ("mp", "ray") if r % 2 == 0 else ("ray", "mp")  # interleaved: drift hits both alike
            for backend in order:
                row = {"round": r, **run_round(backend, args, cluster.address)}
                rows.append(row)
                print(f"round {r} {backend:>3}: {row['output_tok_s']:8.1f} output tok/s, "
                      f"start {row['start_s']:5.1f} s, "
                      f"TTFT p50/p99 {row['ttft_p50_ms']:.0f}/{row['ttft_p99_ms']:.0f} ms, ITL p50/p99 "
                      f"{row['itl_p50_ms']:.1f}/{row['itl_p99_ms']:.1f} ms", flush=True)
    finally:
        cluster.shutdown()

    def median(backend: str, key: str) -> float:
        return statistics.median(row[key] for row in rows if row["backend"] == backend)

    keys = ("output_tok_s", "start_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    summary = {key: {"mp": median("mp", key), "ray": median("ray", key), "ray_over_mp": median("ray", key) /
                     median("mp", key)} for key in keys}
    print(f"\n| figure (median of {args.rounds} rounds) | mp | ray | ray / mp |\n|---|---|---|---|")
    for key in keys:
        s = summary[key]
        print(f"| {key} | {s['mp']:.1f} | {s['ray']:.1f} | {s['ray_over_mp']:.2f}x |")
    Path(args.out).write_text(json.dumps({"args": vars(args), "rounds": rows, "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
