#!/usr/bin/env python3
"""bf16 linear layers on a CPU without bf16 matrix units, at decode-sized row counts: worker/bf16_gemv.py's kernel
(weights read once as bf16, widened in registers) against output_projection.py's widened float32 chunks and against
a plain float32 linear of the same shape (twice the weight bytes).

--layers linears of --out x --in weights (default: 12 of 2304 x 768, about the 110M Llama shape's per-layer QKV),
each timed over all layers, the median of --repeats; the server's thread count (torch's default). Prints a table
(ms per pass over the layers, and kernel / chunked) and writes JSON. No assertions.

    .venv/bin/python scripts/dev/bench_bf16_gemv.py --rows 1 4 16 32 64 128 --json /tmp/bf16_gemv.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.worker.bf16_gemv import bf16_linear_rows, warm_up  # noqa: E402
from shuttle.worker.output_projection import WIDEN_CHUNK, ColumnChunkedLinear  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return 1000 * statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32, 64, 128])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", type=int, default=2304, help="output features of each linear")
    parser.add_argument("--in", dest="in_features", type=int, default=768, help="input features of each linear")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    warm_up(torch.get_num_threads())
    bf16 = [torch.nn.Linear(args.in_features, args.out, bias=False).to(torch.bfloat16) for _ in range(args.layers)]
    fp32 = [torch.nn.Linear(args.in_features, args.out, bias=False) for _ in range(args.layers)]
    chunked = [ColumnChunkedLinear(linear, WIDEN_CHUNK, widen=True) for linear in bf16]
    for module in chunked:
        module.rows_kernel = None  # the widened float32 chunks at every row count
    rows_out = []
    print(f"{args.layers} linears of {args.out} x {args.in_features}, {torch.get_num_threads()} threads; "
          f"ms per pass over all of them, median of {args.repeats}")
    print("| rows | bf16 kernel | bf16 widened chunks | fp32 linear | kernel / chunks |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for rows in args.rows:
            x = torch.randn(rows, args.in_features).to(torch.bfloat16)
            x32 = x.float()
            row = {"rows": rows,
                   "kernel_ms": median_ms(lambda x=x: [bf16_linear_rows(x, m.weight) for m in bf16], args.repeats),
                   "chunks_ms": median_ms(lambda x=x: [m(x) for m in chunked], args.repeats),
                   "fp32_ms": median_ms(lambda x32=x32: [m(x32) for m in fp32], args.repeats)}
            rows_out.append(row)
            print(f"| {rows} | {row['kernel_ms']:.2f} | {row['chunks_ms']:.2f} | {row['fp32_ms']:.2f} "
                  f"| {row['kernel_ms'] / row['chunks_ms']:.2f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows_out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
