"""Time the CPU paged decode kernel (worker/decode_kernel.py) per partition length.

For each (batch, context) shape, random K/V (float32, or --cache-dtype bfloat16) scattered over shuffled blocks of
a 110M Llama's geometry (12 heads of 64 by default) are attended by one query per sequence, once with the whole
context as one work item per sequence ("whole": the kernel's parallelism before partitions) and once per
--partitions length. Each cell is the best of --repeats passes of --calls calls, in milliseconds per call; the last
column is the largest difference from the whole-context result.

    .venv/bin/python scripts/dev/bench_decode_kernel.py --threads 2
    .venv/bin/python scripts/dev/bench_decode_kernel.py --shapes 1x4000 64x1000 --partitions 64 128 256

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from shuttle.worker import decode_kernel

WHOLE = 1 << 30  # longer than any context: one work item per sequence


def make_case(batch: int, context: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int = 0,
              dtype: torch.dtype = torch.float32):
    """Query [batch, heads, head_dim] and caches [blocks + 1, block_size, kv_heads, head_dim] in `dtype`, block table,
    lengths."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-context // block_size)
    blocks = batch * per_seq + 1
    key_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(blocks, block_size, kv_heads, head_dim, generator=gen)
    table = torch.randperm(blocks - 1, generator=gen).view(batch, per_seq).to(torch.int32)
    query = torch.randn(batch, heads, head_dim, generator=gen)
    query, key_cache, value_cache = (t.to(dtype) for t in (query, key_cache, value_cache))
    return query, key_cache, value_cache, table, torch.full((batch,), context, dtype=torch.int32)


def time_call(case, partition: int, calls: int, repeats: int) -> tuple[float, torch.Tensor]:
    """Best-of-repeats milliseconds per call, and the output."""
    scale = case[0].shape[-1] ** -0.5
    out = decode_kernel.paged_decode(*case, scale, None, None, None, partition=partition)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            decode_kernel.paged_decode(*case, scale, None, None, None, partition=partition)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--shapes", nargs="+", default=["1x300", "1x500", "1x2000", "4x400", "16x400", "64x400"],
                        help="BATCHxCONTEXT")
    parser.add_argument("--partitions", nargs="+", type=int, default=[64, 128, 256, 512])
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=12)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", default="bench_results/bench_decode_kernel.json")
    args = parser.parse_args()
    dtype = getattr(torch, args.cache_dtype)
    decode_kernel.warm_up(args.threads, (dtype,))
    print(f"paged decode, {args.heads} heads ({args.kv_heads} KV) of {args.head_dim}, {args.cache_dtype} cache, "
          f"{args.threads} threads; ms per call (best of {args.repeats} x {args.calls})")
    header = f"{'batch':>6} {'context':>8} {'whole':>8}" + "".join(f" {'p' + str(p):>8}" for p in args.partitions)
    print(header + f" {'max diff':>9}")
    results = []
    for shape in args.shapes:
        batch, context = (int(part) for part in shape.split("x"))
        case = make_case(batch, context, args.heads, args.kv_heads, args.head_dim, args.block_size, dtype=dtype)
        whole_ms, whole_out = time_call(case, WHOLE, args.calls, args.repeats)
        row = {"batch": batch, "context": context, "whole_ms": whole_ms, "partition_ms": {}}
        diff = 0.0
        for partition in args.partitions:
            ms, out = time_call(case, partition, args.calls, args.repeats)
            row["partition_ms"][partition] = ms
            diff = max(diff, (out - whole_out).abs().max().item())
        row["max_diff"] = diff
        results.append(row)
        print(f"{batch:>6} {context:>8} {whole_ms:>8.3f}"
              + "".join(f" {row['partition_ms'][p]:>8.3f}" for p in args.partitions) + f" {diff:>9.1e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"threads": args.threads, "cache_dtype": args.cache_dtype,
                                           "heads": args.heads, "kv_heads": args.kv_heads,
                                           "head_dim": args.head_dim, "results": results}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
