#!/usr/bin/env python3
"""The GPU check's roofline stage: how far a decode step is from what the hardware allows.

For each model (the GPU check passes the 1B shape and, where its budget allows, the 8B shape, random weights) and
each batch size, B requests of a fixed prompt are prefilled, then pure decode steps (B tokens each) are timed with
the real Scheduler and ModelRunner in process, one step in flight. Each step's floor is the larger of
- memory: the bytes a decode step must read, every weight once plus each request's KV cache so far, over the
  device's memory bandwidth, measured here by timing a large device-to-device copy (read + write);
- compute: 2 FLOPs per weight per token (a matrix-vector product per token) plus the attention's 4 per head
  dimension per cached token, over the peak matmul rate, measured here on a square matmul in the model's dtype.
The ratio measured / floor says how much a step wastes: launch gaps, small kernels, synchronisation, sampling. The
largest step gets a torch.profiler summary: device time in GEMMs, attention, sampling and the rest, and the launch
gaps (the step's wall time less the time kernels ran).

    .venv/bin/python scripts/dev/roofline.py --models /tmp/shuttle-models/llama-110m --device cpu --batches 1 4 16
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

PROMPT_LEN = 128
CATEGORIES = (  # kernel or op name fragments -> category, first match wins (lower-cased names)
    ("attention", ("flex", "attention", "sdpa", "paged", "decode_kernel", "flash")),
    ("gemm", ("gemm", "matmul", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "_linear_pointwise", "cutlass",
              "sm90_xmma", "ampere_", "cublas", "nvjet")),
    ("sampling", ("argmax", "topk", "softmax", "multinomial", "sort", "sample")),
)


def measured_bandwidth(device: torch.device, nbytes: int) -> float:
    """Bytes per second of a device-to-device copy of `nbytes` (read + written), the best of 5."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        began = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * nbytes / best


def measured_peak_flops(device: torch.device, dtype: torch.dtype, size: int) -> float:
    """FLOPs per second of a `size`-square matmul in `dtype`, the best of 5."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(6):
        _sync(device)
        began = time.perf_counter()
        torch.mm(a, b)
        _sync(device)
        best = min(best, time.perf_counter() - began)
    return 2 * size ** 3 / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TimedRunner:
    """A ModelRunner whose every execute() is timed (seconds), with the plan's request and token counts; with a
    `profiler`, every decode-only step from the first one on runs under it."""

    def __init__(self, runner, device: torch.device, profiler=None):
        self.runner = runner
        self.device = device
        self.grammars = runner.grammars
        self.profiler = profiler
        self.profiling = False
        self.profiled_s = 0.0  # wall seconds of the steps run under the profiler
        self.steps: list[tuple[int, int, float]] = []  # (requests, tokens, seconds)

    def execute(self, plan):
        scheduled = [*plan.new_requests, *plan.cached_requests]
        tokens = sum(r.num_scheduled_tokens for r in scheduled)
        if self.profiler is not None and not self.profiling and scheduled and tokens == len(scheduled):
            self.profiler.__enter__()
            self.profiling = True
        _sync(self.device)
        began = time.perf_counter()
        result = self.runner.execute(plan)
        _sync(self.device)
        seconds = time.perf_counter() - began
        self.steps.append((len(scheduled), tokens, seconds))
        if self.profiling:
            self.profiled_s += seconds
        return result

    def stop(self) -> None:
        if self.profiling:
            self.profiler.__exit__(None, None, None)
            self.profiling = False


def decode_steps(model_dir: str, device: torch.device, dtype: str, batch: int, steps: int,
                 profile: bool = False, largest: int = 0) -> dict:
    """Time `steps` pure decode steps of `batch` requests after their prefill; with `profile`, a torch.profiler
    summary of the decode steps too. The engine is sized for `largest` requests (default `batch`), so that every
    batch size of one model shares one ModelRunner: loaded, compiled and its graphs captured once."""
    from scripts.dev.gpu_check import make_engine
    from shuttle.common.messages import Submit
    from shuttle.common.sampling import SamplingParams
    from shuttle.scheduler.in_process import drive

    largest = max(largest, batch)
    blocks = largest * ((PROMPT_LEN + steps + 8) // 16 + 2) + 16
    backend = "flex" if device.type == "cuda" else "cpu"  # each device's own decode path
    scheduler, runner = make_engine(model_dir, dtype, device, backend=backend, num_blocks=blocks,
                                    prefix_caching=False, max_batched=max(largest, PROMPT_LEN * min(largest, 8)),
                                    max_num_seqs=largest)
    vocab = runner.model.config.vocab_size
    profiler = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        profiler = torch_profile(activities=activities)
    timed = TimedRunner(runner, device, profiler)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = [1] + [(i * 131 + j * 7) % (vocab - 2) + 2 for j in range(PROMPT_LEN - 1)]
        scheduler.add_request(b"c", Submit(request_id=f"r{i}", prompt_token_ids=prompt, sampling=params,
                                           arrival_time=float(i)))
    try:
        drive(scheduler, timed, lambda outputs: None, max_in_flight=1)
    finally:
        timed.stop()
    full = [seconds for requests, tokens, seconds in timed.steps if requests == tokens == batch]  # decodes only
    decode = full[len(full) // 4:] or full  # the first ones pay first-shape costs (a graph, a compile)
    kv_per_token = runner.kv_cache.bytes_per_token
    record = {"batch": batch, "step_ms": 1000 * statistics.median(decode), "steps_timed": len(decode),
              "weight_bytes": runner.weight_bytes, "kv_bytes_read": batch * (PROMPT_LEN + steps // 2) * kv_per_token,
              "params": sum(p.numel() for p in runner.model.parameters())}
    if profiler is not None:
        record["profile"] = profile_summary(profiler, device, timed.profiled_s)
    return record


def profile_summary(profiler, device: torch.device, wall_s: float) -> dict:
    """Milliseconds of device (on CUDA) or CPU op time per category over the profiled steps, and the launch gaps:
    their wall time `wall_s` less the time kernels ran (CUDA only: CPU ops nest, so their sum is no busy time)."""
    totals = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    cuda = device.type == "cuda"
    for event in profiler.key_averages():
        us = event.self_device_time_total if cuda else event.self_cpu_time_total
        if not us:
            continue
        name = event.key.lower()
        category = next((cat for cat, fragments in CATEGORIES if any(f in name for f in fragments)), "other")
        totals[category] += us / 1000
    busy = sum(totals.values())
    return {**{k: round(v, 2) for k, v in totals.items()}, "kernels_ms": round(busy, 2),
            "launch_gaps_ms": round(max(1000 * wall_s - busy, 0.0), 2) if cuda else None}


def roofline(model_dirs: list[str], device: torch.device, dtype: str, batches: list[int], steps: int) -> dict:
    """Every (model, batch) row against its floor, and the profile of the largest step."""
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    bandwidth = measured_bandwidth(device, 2 ** 30 if device.type == "cuda" else 2 ** 26)
    peak = measured_peak_flops(device, torch_dtype, 8192 if device.type == "cuda" else 1024)
    rows = []
    for model_dir in model_dirs:
        for batch in batches:
            largest = model_dir == model_dirs[0] and batch == max(batches)
            record = decode_steps(model_dir, device, dtype, batch, steps, profile=largest, largest=max(batches))
            config = json.loads((Path(model_dir) / "config.json").read_text())
            head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            context = PROMPT_LEN + steps // 2
            flops = 2 * record["params"] * batch + 4 * batch * context * head_dim * config["num_attention_heads"] * \
                config["num_hidden_layers"]
            memory_floor = (record["weight_bytes"] + record["kv_bytes_read"]) / bandwidth
            compute_floor = flops / peak
            floor = max(memory_floor, compute_floor)
            rows.append({"model": Path(model_dir).name, **record, "floor_ms": 1000 * floor,
                         "bound": "memory" if memory_floor >= compute_floor else "compute",
                         "ratio": record["step_ms"] / (1000 * floor)})
            print(f"roofline {Path(model_dir).name} batch {batch}: {record['step_ms']:.2f} ms a step, floor "
                  f"{1000 * floor:.2f} ms ({rows[-1]['bound']}), {rows[-1]['ratio']:.1f}x", flush=True)
        from scripts.dev import gpu_check

        gpu_check._RUNNERS.clear()  # this model's runner goes before the next one loads
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"bandwidth_gb_s": bandwidth / 1e9, "peak_tflops": peak / 1e12, "rows": rows}


def summary_line(result: dict) -> str:
    """The table's line: each row's ratio, and the profile of the largest step."""
    parts = [f"{r['model']} b{r['batch']} {r['step_ms']:.2f} ms = {r['ratio']:.1f}x floor" for r in result["rows"]]
    profiled = next((r for r in result["rows"] if "profile" in r), None)
    text = (f"HBM {result['bandwidth_gb_s']:.0f} GB/s, {result['peak_tflops']:.1f} TFLOP/s measured; "
            + "; ".join(parts))
    if profiled is not None:
        p = profiled["profile"]
        text += (f"; profile of {profiled['model']} b{profiled['batch']} (ms over the timed steps): gemm {p['gemm']}, "
                 f"attention {p['attention']}, sampling {p['sampling']}, other {p['other']}, launch gaps "
                 f"{p['launch_gaps_ms']}")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 16, 64, 256])
    parser.add_argument("--steps", type=int, default=16, help="decode steps per batch (a quarter are warm-up)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = roofline(args.models, torch.device(args.device), args.dtype, args.batches, args.steps)
    print(summary_line(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
