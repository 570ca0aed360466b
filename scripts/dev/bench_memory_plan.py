#!/usr/bin/env python3
"""`shuttle plan` against a real server: the predicted worker peak RSS at full KV use next to the measured one, and
the concurrency table next to the server's start-up line (docs/capacity.md's table).

Runs `shuttle plan --json` with the given flags, starts `shuttle serve` with the same flags, sends long streaming
requests (random token ids, ignore_eos) until /health shows every KV block in use (preemption keeps it full),
reads the worker's VmHWM from /proc, and stops the server by PID.

    .venv/bin/python scripts/dev/bench_memory_plan.py ../shared/models/stories260K --kv-cache-memory 64MiB \\
        --max-num-seqs 256
    .venv/bin/python scripts/dev/bench_memory_plan.py /tmp/shuttle-models/llama-110m --kv-cache-memory 512MiB
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.launcher.local_server import ShuttleServer  # noqa: E402

MiB = 2**20
STARTUP = re.compile(r"KV cache (\d+) blocks x (\d+) tokens = (\d+) tokens \((\d+) bytes/token\); (\d+) requests of "
                     r"max_model_len (\d+) fit")


def proc_status(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1]) * 1024
    raise OSError(name)


async def fill_kv(url: str, total_blocks: int, max_model_len: int, vocab: int, timeout: float) -> tuple[int, float]:
    """Stream requests until every KV block is in use; returns (most blocks in use seen, seconds it took)."""
    rng = random.Random(0)
    output_len = 32  # KV fills by prefill mostly: long prompts, short outputs
    prompt_len = max_model_len - output_len - 1
    needed = total_blocks * 16 // max_model_len + 8
    start = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> None:
            body = {"prompt": [1] + [rng.randrange(3, vocab) for _ in range(prompt_len - 1)],
                    "max_tokens": output_len, "ignore_eos": True, "stream": True, "temperature": 0}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                async for _ in response.content:
                    pass

        tasks = [asyncio.create_task(one()) for _ in range(needed)]
        most = 0
        try:
            while time.monotonic() - start < timeout:
                async with session.get(f"{url}/health") as response:
                    used = (await response.json())["scheduler"]["num_blocks_in_use"]
                most = max(most, used)
                if most >= total_blocks or all(t.done() for t in tasks):
                    break
                await asyncio.sleep(0.2)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    return most, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to reach full KV use")
    parser.add_argument("--json", type=Path, default=None, help="write both figures here")
    args, flags = parser.parse_known_args()
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    done = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "plan", args.model_dir, *flags, "--json"],
                          cwd=REPO,
                          capture_output=True, text=True, check=True)
    plan = json.loads(done.stdout)
    server = ShuttleServer(*flags, model_dir=Path(args.model_dir), start_timeout=600)
    try:
        line = next(line for line in server.output if STARTUP.search(line))
        blocks, block_size, tokens, bpt, fit, max_model_len = map(int, STARTUP.search(line).groups())
        worker = server.pids["worker"]
        at_start = proc_status(worker, "VmRSS")
        config = json.loads((Path(args.model_dir) / "config.json").read_text())
        most, seconds = asyncio.run(fill_kv(server.url, blocks, max_model_len, config["vocab_size"], args.timeout))
        peak, now = proc_status(worker, "VmHWM"), proc_status(worker, "VmRSS")
        others = {name: proc_status(pid, "VmHWM") for name, pid in server.pids.items() if name != "worker"}
    finally:
        server.stop()
    predicted = plan["worker_peak_rss_bytes"]
    row = next(r for r in plan["concurrency"] if r["context_len"] == max_model_len)
    print(f"start-up line: {line.strip()}")
    print(f"plan:          KV cache {plan['num_kv_blocks']} blocks x {plan['block_size']} tokens = {plan['kv_tokens']} "
          f"tokens ({plan['kv_bytes_per_token']} bytes/token); {row['fit_in_kv']} requests of max_model_len "
          f"{max_model_len} fit")
    agree = (blocks, tokens, bpt, fit) == (plan["num_kv_blocks"], plan["kv_tokens"], plan["kv_bytes_per_token"],
                                           row["fit_in_kv"])
    print(f"KV figures agree: {agree}")
    print(f"full KV use: {most}/{blocks} blocks in use after {seconds:.0f} s")
    print(f"{'worker RSS':<36}{'MiB':>10}")
    print(f"{'  at start (measured)':<36}{at_start / MiB:10.1f}")
    print(f"{'  peak at full KV use (measured)':<36}{peak / MiB:10.1f}")
    print(f"{'  peak at full KV use (plan)':<36}{predicted / MiB:10.1f}   ({100 * (predicted - peak) / peak:+.1f}%)")
    for name, value in others.items():
        print(f"{'  ' + name + ' peak (measured)':<36}{value / MiB:10.1f}   plan at start "
              f"{plan['process_overhead_bytes'].get(name, 0) / MiB:.1f}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"plan": plan, "startup_line": line.strip(), "kv_agree": agree,
                                         "blocks_in_use": most, "worker_rss_at_start": at_start,
                                         "worker_peak_rss": peak, "worker_rss_end": now, "other_peaks": others},
                                        indent=2))
    return 0 if agree and abs(predicted - peak) <= 0.1 * peak else 1


if __name__ == "__main__":
    sys.exit(main())
