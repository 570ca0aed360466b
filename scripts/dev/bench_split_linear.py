#!/usr/bin/env python3
"""float32 linear layers at decode-sized row counts: one `F.linear` each against worker/split_linear.py's column
groups on every thread, over all the linear layers of a model (its lm_head included), next to the time of reading
the same bytes once (a sum over a tensor of the weights' size: the memory-bandwidth floor of a one-row pass).

Loads --model with transformers in float32, collects its nn.Linear weights, and for each --rows count times a pass
over all of them both ways (the median of --repeats, on torch's default threads or --threads), and says whether
every output was bit-identical to F.linear's. Prints a table and writes JSON. No assertions.

    .venv/bin/python scripts/dev/bench_split_linear.py --model /tmp/shuttle-models/llama-110m --json /tmp/split.json
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

from shuttle.worker.split_linear import column_groups, split_linear  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    threads = torch.get_num_threads()
    layers = [(m.weight.detach(), None if m.bias is None else m.bias.detach(), column_groups(m.out_features, threads))
              for m in model.modules() if isinstance(m, torch.nn.Linear)]
    weight_bytes = sum(w.numel() * 4 for w, _, _ in layers)
    weights_sized = torch.empty(weight_bytes // 4).uniform_()
    weights_sized.sum()
    floor_ms = median_ms(weights_sized.sum, args.repeats)
    print(f"{args.model}: {len(layers)} linears, {weight_bytes / 1e6:.0f} MB of float32, {threads} threads; "
          f"ms per pass over all of them, median of {args.repeats}; reading {weight_bytes / 1e6:.0f} MB once: "
          f"{floor_ms:.1f} ms")
    print("| rows | F.linear | column groups | groups / F.linear | bit-identical |")
    print("|---|---|---|---|---|")
    table = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in args.rows:
            inputs = {k: torch.randn(rows, k, generator=generator) for k in {w.shape[1] for w, _, _ in layers}}
            def plain_pass(inputs=inputs):
                return [F.linear(inputs[w.shape[1]], w, b) for w, b, _ in layers]

            def split_pass(inputs=inputs):
                return [split_linear(inputs[w.shape[1]], w, b, g) for w, b, g in layers]

            plain_pass(), split_pass()  # first calls off the clock
            plain, split = median_ms(plain_pass, args.repeats), median_ms(split_pass, args.repeats)
            same = all(torch.equal(split_linear(inputs[w.shape[1]], w, b, g), F.linear(inputs[w.shape[1]], w, b))
                       for w, b, g in layers)
            row = {"rows": rows, "linear_ms": plain, "split_ms": split, "ratio": split / plain, "bit_identical": same}
            table.append(row)
            print(f"| {rows} | {plain:.1f} | {split:.1f} | {split / plain:.2f} | {'yes' if same else 'no'} |",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "threads": threads, "weight_bytes": weight_bytes,
                                         "read_once_ms": floor_ms, "rows": table}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
