#!/usr/bin/env python3
"""shuttle bf16 against fp32 on the CPU, through `shuttle bench`, in interleaved rounds.

Two servers of the same model stay up side by side (`--dtype float32` and `--dtype bfloat16`, each with
--worker-threads as given); each round benches one, then the other, with the same requests (`shuttle bench`,
capacity/bench_serve.py), so load from the rest of a shared machine falls on both alike. The idle server's threads
sleep (OMP_WAIT_POLICY=PASSIVE, docs/operations.md), so it costs the running one little. Prints a row per round and
the median ratio bf16 / fp32 of output throughput and of median TPOT.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m
    .venv/bin/python scripts/dev/bench_bf16.py --model /tmp/shuttle-models/llama-110m --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.launcher.local_server import ShuttleServer  # noqa: E402

DTYPES = ("float32", "bfloat16")


def bench(url: str, args, out: Path) -> dict:
    subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "bench", "--url", url, "--num-prompts",
                    str(args.num_prompts),
                    "--max-concurrency", str(args.concurrency), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--no-progress", "--result-json", str(out)],
                   cwd=REPO, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--worker-threads", type=int, default=0, help="0: the server's default (one per core)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    threads = None if args.worker_threads == 0 else args.worker_threads
    servers = {}
    try:
        for dtype in DTYPES:
            servers[dtype] = ShuttleServer("--dtype", dtype, "--kv-cache-memory", "2GiB", "--max-num-seqs",
                                           str(args.concurrency), model_dir=args.model, cwd=REPO,
                                           worker_threads=threads)
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            bench(servers["float32"].url, args, Path(tmp) / "warm.json")  # first-use costs out of the rounds
            bench(servers["bfloat16"].url, args, Path(tmp) / "warm.json")
            for r in range(args.rounds):
                row = {"round": r}
                for dtype in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                    summary = bench(servers[dtype].url, args, Path(tmp) / f"{dtype}-{r}.json")
                    row[dtype] = {"output_tok_s": summary["output_token_throughput"],
                                  "tpot_p50_ms": summary["tpot_ms"]["median"],
                                  "ttft_p50_ms": summary["ttft_ms"]["median"],
                                  "failed": summary["failed"]}
                row["throughput_ratio"] = row["bfloat16"]["output_tok_s"] / row["float32"]["output_tok_s"]
                row["tpot_ratio"] = row["float32"]["tpot_p50_ms"] / row["bfloat16"]["tpot_p50_ms"]
                rows.append(row)
                print(f"round {r}: fp32 {row['float32']['output_tok_s']:.1f} tok/s (TPOT p50 "
                      f"{row['float32']['tpot_p50_ms']:.0f} ms), bf16 {row['bfloat16']['output_tok_s']:.1f} tok/s "
                      f"(TPOT p50 {row['bfloat16']['tpot_p50_ms']:.0f} ms): bf16/fp32 throughput "
                      f"{row['throughput_ratio']:.2f}x, TPOT {row['tpot_ratio']:.2f}x", flush=True)
        print(f"median bf16/fp32: output throughput {statistics.median(r['throughput_ratio'] for r in rows):.2f}x, "
              f"TPOT {statistics.median(r['tpot_ratio'] for r in rows):.2f}x over {len(rows)} rounds")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    finally:
        for server in servers.values():
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
