#!/usr/bin/env python3
"""Calibrate the step-cost model of a model on this machine and save it as a JSON profile.

Runs the real ModelRunner in process over a grid of step shapes (decode batches over contexts, prefill chunks;
see capacity/calibrate.py), fits the cost model to the measured steps, prints each measurement next to its fit,
and writes the profile:

    .venv/bin/python scripts/calibrate.py --model ../shared/models/stories260K --out profiles/stories260K.json
    .venv/bin/python scripts/calibrate.py --model /tmp/shuttle-models/llama-110m --out profiles/llama-110m.json

Nothing here is fitted to a full server: the profile describes the worker's steps, which is what carries over to
the machine a user serves on. The profile feeds scripts/simulate.py, scripts/tune.py and
`shuttle serve --step-cost-profile`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import simulate  # noqa: E402
from capacity.calibrate import Calibrator  # noqa: E402
from common.arg_types import positive  # noqa: E402
from scheduler.step_cost import FEATURES  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON profile goes")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=positive, default=None)
    parser.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="largest chunk measured")
    parser.add_argument("--max-num-seqs", type=positive, default=128, help="largest decode batch measured")
    parser.add_argument("--repeats", type=positive, default=5, help="decode steps per configuration (median kept)")
    parser.add_argument("--attention-backend", default="auto")
    args = parser.parse_args(argv)
    simulate.require_model_dir(parser, args.model, args.max_model_len)
    start = time.time()
    calibrator = Calibrator(args.model, args.dtype, args.max_model_len, attention_backend=args.attention_backend)
    model, measurements = calibrator.calibrate(args.max_num_batched_tokens, args.max_num_seqs, args.repeats,
                                               progress=lambda line: print(line, flush=True))
    print(f"{'measurement':<60}{'ms':>10}{'fit ms':>10}")
    for m in measurements:
        print(f"{m.label:<60}{m.seconds * 1e3:10.2f}{model.predict(m.shape) * 1e3:10.2f}")
    model.meta["seconds"] = round(time.time() - start, 1)
    print("coefficients: " + ", ".join(f"{name} {model.coefficients[name]:.3g}" for name in FEATURES))
    print(f"relative RMS error {model.meta['rel_rmse']:.3f}; scheduler {model.scheduler_s * 1e3:.3f} ms/step")
    model.save(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
