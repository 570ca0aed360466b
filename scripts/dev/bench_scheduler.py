#!/usr/bin/env python3
"""How long the scheduler takes to plan and to settle one step, with no model: a real Scheduler driven by
fabricated sampled tokens, with many requests waiting and a full running set decoding.

    .venv/bin/python scripts/dev/bench_scheduler.py                      # 10,000 waiting, 256 running
    .venv/bin/python scripts/dev/bench_scheduler.py --waiting 1000 --running 64 --json out.json

Prints a table (median and p99 over the timed steps, in microseconds) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shuttle.common.config import SchedulerConfig  # noqa: E402
from shuttle.common.messages import StepResult, Submit  # noqa: E402
from shuttle.common.sampling import SamplingParams  # noqa: E402
from shuttle.scheduler.kv_cache import KVCacheManager  # noqa: E402
from shuttle.scheduler.scheduler import Scheduler  # noqa: E402


def build(waiting: int, running: int, prompt_len: int, block_size: int) -> Scheduler:
    """A scheduler whose running set is full (`running` requests decoding) with `waiting` more queued."""
    blocks_per_request = -(-(prompt_len + 4096) // block_size)
    num_blocks = running * blocks_per_request + 16
    config = SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=max(2048, running * prompt_len),
                             max_waiting_requests=waiting + running)
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size), 1 << 20, (2,))
    params = SamplingParams(max_tokens=4096, ignore_eos=True)
    for i in range(running + waiting):
        prompt = [1] + [3 + (i * 7 + j) % 500 for j in range(prompt_len - 1)]
        scheduler.add_request(b"bench", Submit(request_id=f"r{i}", prompt_token_ids=prompt, sampling=params,
                                               arrival_time=float(i)))
    step = scheduler.schedule()  # admits `running` requests: their prefills
    scheduler.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=step.sampling_ids,
                                                  token_ids=[5] * len(step.sampling_ids)))
    scheduler.take_outputs()
    return scheduler


def measure(scheduler: Scheduler, steps: int) -> tuple[list[float], list[float], int]:
    plan_us, settle_us = [], []
    step = scheduler.schedule()
    for _ in range(steps):
        t0 = time.perf_counter()
        following = scheduler.schedule()  # planned while `step` is in flight, as the overlapped loop does
        t1 = time.perf_counter()
        scheduler.update_from_output(step, StepResult(step_id=step.plan.step_id, request_ids=step.sampling_ids,
                                                      token_ids=[5] * len(step.sampling_ids)))
        scheduler.take_outputs()
        t2 = time.perf_counter()
        plan_us.append((t1 - t0) * 1e6)
        settle_us.append((t2 - t1) * 1e6)
        step = following
    return plan_us, settle_us, len(step.scheduled)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--waiting", type=int, default=10_000)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--json", type=Path, default=Path("bench_results/bench_scheduler.json"))
    args = parser.parse_args()
    scheduler = build(args.waiting, args.running, args.prompt_len, args.block_size)
    plan, settle, batch = measure(scheduler, args.steps)
    assert len(scheduler.waiting) == args.waiting and batch == args.running

    def pct(values: list[float], q: float) -> float:
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    rows = {"plan (schedule)": plan, "settle (update_from_output)": settle}
    print(f"scheduler with {args.waiting} waiting and {args.running} running (decoding), {args.steps} steps")
    print(f"{'phase':<30}{'median us':>12}{'p99 us':>12}")
    for name, values in rows.items():
        print(f"{name:<30}{statistics.median(values):12.1f}{pct(values, 0.99):12.1f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "waiting": args.waiting, "running": args.running, "steps": args.steps,
        "plan_us": {"median": statistics.median(plan), "p99": pct(plan, 0.99)},
        "settle_us": {"median": statistics.median(settle), "p99": pct(settle, 0.99)}}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
