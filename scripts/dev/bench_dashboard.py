#!/usr/bin/env python3
"""Throughput with the dashboard watched vs not, on one running server in one run.

Runs `shuttle bench`'s benchmark in rounds that alternate "off" (nobody watches) and "on" (the live feed
GET /v1/stats/stream is read by --watchers clients for the whole run; with --browser, the real /dashboard page is
open in headless Chromium instead), swapping the order every round so that drift on a shared machine falls on
both alike. Prints output throughput per run and the mean of each mode; with --frontend-pid (the launcher's ready
line names it) also the frontend's CPU time per 1000 output tokens, which a busy shared machine disturbs far less
than wall-clock throughput.

    .venv/bin/python scripts/dev/bench_dashboard.py --url http://127.0.0.1:8000 --num-prompts 64 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shuttle.capacity import bench_serve  # noqa: E402

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid` so far (0 without a pid), from /proc/PID/stat."""
    if not pid:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class FeedReaders:
    """`count` clients reading the SSE feed until stopped; `frames` counts what they received."""

    def __init__(self, url: str, api_key: str | None, count: int):
        self.url, self.api_key, self.count = url, api_key, count
        self.frames = 0

    async def _read(self, session: aiohttp.ClientSession) -> None:
        async with session.get(f"{self.url}/v1/stats/stream") as response:
            response.raise_for_status()
            async for line in response.content:
                self.frames += line.startswith(b"data: ")

    @asynccontextmanager
    async def open(self):
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=None)) as session:
            tasks = [asyncio.create_task(self._read(session)) for _ in range(self.count)]
            try:
                yield self
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)


class BrowserPage:
    """The /dashboard page open in headless Chromium (playwright driving the system's browser)."""

    def __init__(self, url: str, api_key: str | None, chromium: str, query: str = ""):
        self.url, self.api_key, self.chromium, self.query = url, api_key, chromium, query
        self.frames = 0
        self.page = None  # the playwright Page while open

    @asynccontextmanager
    async def open(self):
        from playwright.async_api import async_playwright

        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=self.chromium, args=CHROMIUM_ARGS)
            try:
                self.page = page = await browser.new_page(viewport={"width": 1400, "height": 860})
                fragment = f"#key={self.api_key}" if self.api_key else ""
                await page.goto(f"{self.url}/dashboard{self.query}{fragment}")
                yield self
                self.frames = int(await page.evaluate("Number(document.body.dataset.frames)"))
            finally:
                await browser.close()


async def run(args: argparse.Namespace) -> dict:
    vocab_size = await bench_serve.served_vocab_size(args.url, args.api_key)
    specs = bench_serve.random_workload(args.num_prompts, args.input_len, args.output_len, 0.5, 0, vocab_size, 0)
    runs = []
    for round_ in range(args.rounds):
        for mode in (("off", "on") if round_ % 2 == 0 else ("on", "off")):
            watcher = None
            if mode == "on":
                watcher = (BrowserPage(args.url, args.api_key, args.chromium) if args.browser
                           else FeedReaders(args.url, args.api_key, args.watchers))
            cpu_before = cpu_seconds(args.frontend_pid)
            if watcher is None:
                results, duration = await bench_serve.run_benchmark(args.url, specs, float("inf"),
                                                                    args.max_concurrency, 0, False, args.api_key)
                frames = 0
            else:
                async with watcher.open():
                    results, duration = await bench_serve.run_benchmark(args.url, specs, float("inf"),
                                                                        args.max_concurrency, 0, False, args.api_key)
                frames = watcher.frames
            summary = bench_serve.summarize(results, duration, None, None)
            cpu = cpu_seconds(args.frontend_pid) - cpu_before
            cpu_per_k = 1000 * cpu / max(summary["total_output_tokens"], 1) * 1000  # ms per 1000 tokens
            runs.append({"round": round_, "mode": mode, "output_token_throughput": summary["output_token_throughput"],
                         "request_throughput": summary["request_throughput"], "failed": summary["failed"],
                         "duration_s": duration, "frames": frames, "frontend_cpu_ms_per_1k_tokens": cpu_per_k})
            print(f"round {round_}  dashboard {mode:<3}  output {summary['output_token_throughput']:8.1f} tok/s  "
                  f"{summary['request_throughput']:6.2f} req/s  {duration:6.2f} s  frames {frames}"
                  + (f"  frontend CPU {cpu_per_k:.0f} ms/1k tokens" if args.frontend_pid else ""), flush=True)
    means = {mode: statistics.fmean(r["output_token_throughput"] for r in runs if r["mode"] == mode)
             for mode in ("off", "on")}
    spread = {mode: [round(r["output_token_throughput"], 1) for r in runs if r["mode"] == mode] for mode in means}
    print(f"mean output throughput: off {means['off']:.1f} tok/s {spread['off']}, on {means['on']:.1f} tok/s "
          f"{spread['on']} ({100 * (means['on'] / means['off'] - 1):+.1f}%)")
    if args.frontend_pid:
        cpu = {mode: statistics.fmean(r["frontend_cpu_ms_per_1k_tokens"] for r in runs if r["mode"] == mode)
               for mode in ("off", "on")}
        print(f"mean frontend CPU per 1000 output tokens: off {cpu['off']:.0f} ms, on {cpu['on']:.0f} ms "
              f"({100 * (cpu['on'] / cpu['off'] - 1):+.1f}%)")
    return {"runs": runs, "mean_output_token_throughput": means,
            "config": {k: v for k, v in vars(args).items() if k != "api_key"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs once without and once with the feed")
    parser.add_argument("--watchers", type=int, default=1, help="feed readers while 'on' (without --browser)")
    parser.add_argument("--browser", action="store_true", help="'on' opens /dashboard in headless Chromium")
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--frontend-pid", type=int, default=None, help="also measure this process's CPU time")
    parser.add_argument("--api-key", default=os.environ.get("SHUTTLE_API_KEY"))
    parser.add_argument("--result-json", default="bench_results/bench_dashboard.json")
    args = parser.parse_args(argv)
    result = asyncio.run(run(args))
    if args.result_json:
        os.makedirs(os.path.dirname(args.result_json) or ".", exist_ok=True)
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.result_json}")
    return 0 if all(r["failed"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
