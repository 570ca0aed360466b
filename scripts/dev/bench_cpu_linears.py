#!/usr/bin/env python3
"""Linear layers on a CPU: torch's default GEMM (`F.linear`: MKL's sgemm in float32, oneDNN on the row-major weight
in bfloat16, torch 2.13) against oneDNN's matmul (worker/onednn_linear.py) on the row-major weights and on copies
reordered into oneDNN's layout, over all the linear layers of a model (its lm_head included), at decode-sized and
prefill-sized row counts, next to the time of reading the weights' bytes once (the memory-bandwidth floor of a
one-row pass).

Loads --model with transformers in --dtype (float32 or bfloat16; bfloat16 where the CPU's oneDNN has it), and for
each --rows count times a pass over all its nn.Linear weights each way (the median of --repeats, on torch's default
threads or --threads), and gives the largest difference between the products as a fraction of
onednn_linear.agreement_bound (float32 rounding of the sums, and in bfloat16 one rounding of each product: at most
1 is rounding). Prints a table and writes JSON. No assertions.

    .venv/bin/python scripts/dev/bench_cpu_linears.py --model /tmp/shuttle-models/llama-110m --json /tmp/linears.json
    .venv/bin/python scripts/dev/bench_cpu_linears.py --model /tmp/shuttle-models/llama-110m --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench_bf16_gemv import median_ms  # noqa: E402  scripts/dev, this script's own directory

from shuttle.worker.onednn_linear import agreement_bound, onednn_linear, reordered_weight  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 256, 512, 2048])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    threads = torch.get_num_threads()
    layers = [(m.weight.detach(), None if m.bias is None else m.bias.detach())
              for m in model.modules() if isinstance(m, torch.nn.Linear)]
    reordered = [reordered_weight(w) for w, _ in layers]
    weight_bytes = sum(w.numel() * w.element_size() for w, _ in layers)
    weights_sized = torch.empty(weight_bytes // 4).uniform_()  # the same bytes, read as float32
    weights_sized.sum()
    floor_ms = median_ms(weights_sized.sum, args.repeats)
    print(f"{args.model}: {len(layers)} linears, {weight_bytes / 1e6:.0f} MB of {args.dtype}, {threads} threads; "
          f"ms per pass over all of them, median of {args.repeats}; reading {weight_bytes / 1e6:.0f} MB once: "
          f"{floor_ms:.1f} ms")
    print("| rows | F.linear | oneDNN | oneDNN reordered | oneDNN / F.linear | reordered / F.linear "
          "| largest difference / rounding bound |")
    print("|---|---|---|---|---|---|---|")
    table = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=generator).to(dtype) for k in {w.shape[1] for w, _ in layers}}

            def f_linear_pass(inputs=inputs):
                return [F.linear(inputs[w.shape[1]], w, b) for w, b in layers]

            def onednn_pass(inputs=inputs):
                return [onednn_linear(inputs[w.shape[1]], w, b) for w, b in layers]

            def reordered_pass(inputs=inputs):
                return [onednn_linear(inputs[w.shape[1]], r, b) for (w, b), r in zip(layers, reordered)]

            f_linear_pass(), onednn_pass(), reordered_pass()  # first calls off the clock
            base, onednn = median_ms(f_linear_pass, args.repeats), median_ms(onednn_pass, args.repeats)
            packed = median_ms(reordered_pass, args.repeats)
            worst = 0.0
            for (w, b), want, got, got_r in zip(layers, f_linear_pass(), onednn_pass(), reordered_pass()):
                x = inputs[w.shape[1]]
                for product in (got, got_r):
                    bound = agreement_bound(x, w, b, product, want)
                    worst = max(worst, float(((product.float() - want.float()).abs() / bound).max()))
            row = {"rows": rows, "f_linear_ms": base, "onednn_ms": onednn, "reordered_ms": packed,
                   "ratio": onednn / base, "reordered_ratio": packed / base, "worst_of_bound": worst}
            table.append(row)
            print(f"| {rows} | {base:.1f} | {onednn:.1f} | {packed:.1f} | {onednn / base:.2f} | {packed / base:.2f} "
                  f"| {worst:.3f} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "dtype": args.dtype, "threads": threads,
                                         "weight_bytes": weight_bytes,
                                         "read_once_ms": floor_ms, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
