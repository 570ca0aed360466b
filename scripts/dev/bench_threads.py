#!/usr/bin/env python3
"""Do the worker's threads thrash beside busy neighbours? One server per thread setting, timed alone and beside
CPU-bound processes.

For each setting (--settings: "default" is the server's own flags, anything else is passed as flags, e.g.
"--worker-threads 1", after any NAME=VALUE words, which go into the launcher's environment, e.g. "GOMP_SPINCOUNT=0"
for worker threads that sleep as soon as they wait), starts `shuttle serve` on --model (launcher/local_server.py's
ShuttleServer, stopped by PID), warms it with one burst, then times --rounds bursts of --requests concurrent
non-streaming completions of --max-tokens tokens each (ignore_eos, greedy) alone; then starts --hogs CPU-bound
Python processes (busy loops, on every core this script may use, stopped by PID however the run ends), waits a
second, and times as many bursts beside them. Reported per setting and condition: the median burst's seconds,
output tokens/s, the median and 99th-percentile decode-only step in the server's step log (--step-log) during
those bursts, and the slowdown beside the hogs over alone. A setting may be listed more than once (interleaved
repeats on a noisy machine). No assertions: it prints a table and writes JSON.

    .venv/bin/python scripts/dev/bench_threads.py
    .venv/bin/python scripts/dev/bench_threads.py --settings default "--worker-threads 1" "GOMP_SPINCOUNT=0" \\
        --json /tmp/threads.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.launcher.local_server import ShuttleServer  # noqa: E402
from shuttle.scheduler.step_log import read_step_log  # noqa: E402

HOG = "while True: pass"


async def burst(url: str, model: str, requests: int, max_tokens: int) -> tuple[float, int]:
    """(seconds, output tokens) of `requests` completions sent at once."""
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def one(i: int) -> int:
            async with session.post(f"{url}/v1/completions", json={**body, "seed": i}) as response:
                payload = await response.json()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {payload}")
                return payload["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(requests)))
        return time.perf_counter() - start, sum(tokens)


def decode_step_ms(step_log: Path, since: int) -> tuple[float, float] | None:
    """Median and 99th percentile (ms) of the decode-only steps logged after the first `since` steps."""
    steps = read_step_log(step_log)[since:] if step_log.exists() else []
    decodes = sorted(1000 * s.seconds for s in steps if s.num_prefill_seqs == 0 and s.num_decode_seqs > 0)
    if not decodes:
        return None
    return statistics.median(decodes), decodes[min(len(decodes) - 1, int(0.99 * len(decodes)))]


def logged_steps(step_log: Path) -> int:
    return len(read_step_log(step_log)) if step_log.exists() else 0


def measure(url: str, model: str, args, step_log: Path) -> dict:
    since = logged_steps(step_log)
    rounds = [asyncio.run(burst(url, model, args.requests, args.max_tokens)) for _ in range(args.rounds)]
    seconds = statistics.median(s for s, _ in rounds)
    tokens = rounds[0][1]
    step = decode_step_ms(step_log, since)
    return {"seconds": seconds, "rounds_s": [s for s, _ in rounds], "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "decode_step_ms": step and step[0],
            "decode_step_p99_ms": step and step[1]}


def start_hogs(n: int) -> list[subprocess.Popen]:
    """Each hog in a session of its own, as another user's process would be: with the kernel's autogroup
    scheduling (sched_autogroup_enabled), hogs in this script's session would share one CPU share with the client
    and hardly compete with the server, which ShuttleServer starts in its own session."""
    return [subprocess.Popen([sys.executable, "-c", HOG], start_new_session=True) for _ in range(n)]


def stop_hogs(hogs: list[subprocess.Popen]) -> None:
    for hog in hogs:
        if hog.poll() is None:
            os.kill(hog.pid, 9)
        hog.wait()


def run_setting(setting: str, args) -> dict:
    words = [] if setting == "default" else shlex.split(setting)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    flags = words
    step_log = Path(tempfile.mkstemp(prefix="bench-threads-", suffix=".jsonl")[1])
    hogs: list[subprocess.Popen] = []
    try:
        # worker_threads=None: the server's own default, not the test harness's one thread
        with ShuttleServer(*flags, "--step-log", str(step_log), model_dir=args.model, worker_threads=None,
                           env=env) as server:
            startup = [line for line in server.output if line.startswith("shuttle: worker")]
            model = asyncio.run(_served_model(server.url))
            asyncio.run(burst(server.url, model, args.requests, args.max_tokens))  # warm-up
            alone = measure(server.url, model, args, step_log)
            hogs = start_hogs(args.hogs)
            time.sleep(1.0)
            beside = measure(server.url, model, args, step_log)
    finally:
        stop_hogs(hogs)
        step_log.unlink(missing_ok=True)
    return {"setting": setting, "startup": startup, "alone": alone, "beside_hogs": beside,
            "slowdown": beside["seconds"] / alone["seconds"]}


async def _served_model(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/v1/models") as response:
            return (await response.json())["data"][0]["id"]


def print_table(rows: list[dict], args) -> None:
    print(f"\n{args.requests} concurrent requests x {args.max_tokens} tokens, median of {args.rounds} bursts; "
          f"{args.hogs} CPU-bound neighbours; {len(os.sched_getaffinity(0))} cores allowed")
    print("step ms: the decode-only steps' median / 99th percentile, as served (--step-log)")
    print(f"{'setting':<22}{'alone s':>9}{'tok/s':>9}{'step ms':>13}{'hogs s':>9}{'tok/s':>9}{'step ms':>13}"
          f"{'slowdown':>10}")
    for row in rows:
        a, b = row["alone"], row["beside_hogs"]
        print(f"{row['setting']:<22}{a['seconds']:>9.2f}{a['tokens_per_s']:>9.0f}{_ms(a):>13}{b['seconds']:>9.2f}"
              f"{b['tokens_per_s']:>9.0f}{_ms(b):>13}{row['slowdown']:>9.2f}x")
    for row in rows:
        print(f"  {row['setting']}: {'; '.join(row['startup'])}")


def _ms(result: dict) -> str:
    if result["decode_step_ms"] is None:
        return "-"
    return f"{result['decode_step_ms']:.1f} / {result['decode_step_p99_ms']:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--settings", nargs="+", default=["default", "--worker-threads 1"])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--json", default="bench_threads.json", help="where to write the results")
    args = parser.parse_args(argv)
    rows = [run_setting(setting, args) for setting in args.settings]
    print_table(rows, args)
    Path(args.json).write_text(json.dumps({"requests": args.requests, "max_tokens": args.max_tokens,
                                           "rounds": args.rounds, "hogs": args.hogs,
                                           "cores": sorted(os.sched_getaffinity(0)), "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
