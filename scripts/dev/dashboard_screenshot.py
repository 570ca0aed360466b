#!/usr/bin/env python3
"""Screenshot of /dashboard under load (the README's docs/dashboard.png): opens the page in headless Chromium,
drives `shuttle bench`'s workload (with a shared prefix, so the prefix cache hits) against the server,
and saves the page after --after seconds of load.

    .venv/bin/python scripts/dev/dashboard_screenshot.py --url http://127.0.0.1:8000 --out docs/dashboard.png
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import shutil
import sys
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_dashboard", Path(__file__).with_name("bench_dashboard.py"))
bench_dashboard = sys.modules["bench_dashboard"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_dashboard)
bench_serve = bench_dashboard.bench_serve


async def run(args: argparse.Namespace) -> None:
    vocab_size = await bench_serve.served_vocab_size(args.url, args.api_key)
    specs = bench_serve.random_workload(args.num_prompts, args.input_len, args.output_len, 0.5, args.shared_prefix_len,
                                        vocab_size, 0)
    browser = bench_dashboard.BrowserPage(args.url, args.api_key, args.chromium, f"?window={args.window}")
    async with browser.open():
        load = asyncio.create_task(bench_serve.run_benchmark(args.url, specs, args.request_rate,
                                                             args.max_concurrency, 0, False, args.api_key))
        await asyncio.sleep(args.after)
        await browser.page.screenshot(path=args.out, full_page=True)
        print(f"wrote {args.out}")
        # The rest of the workload is dropped: its requests fail on the closed session, which is expected here.
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
        load.cancel()
        await asyncio.gather(load, return_exceptions=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--after", type=float, default=20.0, help="seconds of load before the screenshot")
    parser.add_argument("--window", type=float, default=30.0, help="the page's sliding window (seconds)")
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--request-rate", type=float, default=6.0, help="Poisson arrivals per second")
    parser.add_argument("--max-concurrency", type=int, default=24)
    parser.add_argument("--input-len", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--shared-prefix-len", type=int, default=32)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--api-key", default=os.environ.get("SHUTTLE_API_KEY"))
    asyncio.run(run(parser.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
