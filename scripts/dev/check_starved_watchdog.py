#!/usr/bin/env python3
"""Slow is not hung: a server starved by CPU-bound neighbours finishes every request, and a stopped worker is still
restarted within --step-timeout.

Starts --hogs busy loops (each in a session of its own, stopped by PID), then `shuttle serve --model` with
--step-timeout, runs capacity/bench_serve.py's random workload (--requests prompts of --input-len tokens, --output-len
tokens each, ignore_eos) at --concurrency, and counts requests that failed and engine restarts beside the longest
step (a --step-timeout below it would have restarted an engine judged by the wall clock). Then it SIGSTOPs the
worker while a request runs (the hogs still running) and times how long until the launcher restarts the engine
for it. No
assertions: it prints a table and writes JSON.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/check_starved_watchdog.py --model /tmp/shuttle-models/llama-110m --hogs 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench_threads import start_hogs, stop_hogs  # scripts/dev, this script's own directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.capacity.bench_serve import random_workload, run_benchmark, served_vocab_size  # noqa: E402
from shuttle.launcher.local_server import ShuttleServer  # noqa: E402
from shuttle.scheduler.step_log import read_step_log  # noqa: E402


def _long_request(url: str) -> None:
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(request, timeout=600).read()
    except (OSError, ValueError):
        pass  # it ends with the engine's restart (a 503), which is the point


def _wait_running(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{url}/health", timeout=60) as response:
            if json.loads(response.read())["scheduler"]["num_running"] > 0:
                return
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--hogs", type=int, default=8)
    parser.add_argument("--step-timeout", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    step_log = Path(tempfile.mkdtemp()) / "steps.jsonl"
    hogs = start_hogs(args.hogs)
    try:
        with ShuttleServer("--step-timeout", f"{args.step_timeout:g}", "--step-log", str(step_log),
                           model_dir=args.model, worker_threads=None, start_timeout=600) as server:
            vocab = asyncio.run(served_vocab_size(server.url, None))
            specs = random_workload(args.requests, args.input_len, args.output_len, 0.0, 0, vocab, 0)
            started = time.monotonic()
            results, _ = asyncio.run(run_benchmark(server.url, specs, float("inf"), args.concurrency, 0,
                                                   progress=False))
            load_s = time.monotonic() - started
            failed = sum(not r.ok for r in results)
            wrong_length = sum(r.ok and r.output_tokens != args.output_len for r in results)
            restarts_under_load = server.restarts
            longest_step = max((step.seconds for step in read_step_log(step_log)), default=0.0)
            seen = len(server.output)
            in_flight = threading.Thread(target=_long_request, args=(server.url,), daemon=True)
            in_flight.start()  # a step in flight when the worker stops: the step watchdog's case, not the heartbeat's
            _wait_running(server.url)
            os.kill(server.pids["worker"], signal.SIGSTOP)
            stopped = time.monotonic()
            while not any("restarts in" in line for line in server.output[seen:]):  # the launcher's verdict
                if time.monotonic() - stopped > 10 * args.step_timeout:
                    break
                time.sleep(0.1)
            found_s = time.monotonic() - stopped
            verdict = next((line for line in server.output[seen:] if "restarts in" in line), "none")
            server.wait_restarts(restarts_under_load + 1, timeout=10 * args.step_timeout)
    finally:
        stop_hogs(hogs)
    result = {"hogs": args.hogs, "step_timeout_s": args.step_timeout, "requests": args.requests,
              "concurrency": args.concurrency, "failed": failed, "wrong_length": wrong_length,
              "restarts_under_load": restarts_under_load, "load_s": round(load_s, 1),
              "longest_step_s": round(longest_step, 1),
              "stopped_worker_found_s": round(found_s, 1), "verdict": verdict}
    for name, value in result.items():
        print(f"{name:36} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
