#!/usr/bin/env python3
"""Compare shuttle with what a user would pick instead, on one workload, in one run, on this machine.

Workload (default): 64 requests, prompts of 16-256 random tokens, outputs of 16-128 tokens, greedy, all arriving
at once. Contenders: shuttle end to end over HTTP (its three processes), and transformers on the same model
directory three ways: one request at a time (`generate`), static batches with left padding (`generate` on a
padded batch), and transformers' own continuous batching manager (per-request max_new_tokens). Every request
produces exactly its output length (ignore_eos / min_new_tokens), so all do the same useful work.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m
    .venv/bin/python scripts/dev/bench_compare.py --model /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/bench_compare.py --model ../shared/models/stories260K --profile
    bash scripts/dev/install_llama_cpp.sh        # once, optional: adds llama.cpp (llama-cpp-python) as a peer
    .venv/bin/python scripts/dev/bench_compare.py --model ../shared/models/stories260K --peers llama.cpp

llama.cpp serves one request at a time here (llama-cpp-python's `Llama.generate`, greedy, the model converted to an
f32 GGUF by the convert_hf_to_gguf.py its source distribution ships), the way its Python binding is used.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Outcome:
    name: str
    wall_s: float
    output_tokens: int
    latencies_s: list[float]
    note: str = ""

    def row(self) -> dict:
        ordered = sorted(self.latencies_s)
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0
        return {"method": self.name, "wall_s": self.wall_s, "output_tok_per_s": self.output_tokens / self.wall_s,
                "mean_latency_s": statistics.fmean(ordered) if ordered else 0.0, "p99_latency_s": p99,
                "output_tokens": self.output_tokens, "note": self.note}


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range) - 1)], rng.randint(*output_range))
            for _ in range(n)]


# ---- shuttle ------------------------------------------------------------------------------------------------------

class ShuttleServer:
    """`shuttle serve` started once (warmed up by two requests) and timed on the workload once per round; py-spy
    records the worker and scheduler during the rounds with --profile."""

    def __init__(self, model: str, requests, serve_args: list[str], profile_out: Path | None):
        cmd = [sys.executable, "-m", "launcher.cli", "serve", model, "--port", "0", *serve_args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.profilers = []
        info = None
        for line in self.proc.stdout:
            if line.startswith("shuttle: ready "):
                info = json.loads(line[len("shuttle: ready "):])
                break
        if info is None:
            self.proc.wait()
            raise RuntimeError("shuttle did not start")
        self.url = info["url"]
        asyncio.run(_shuttle_requests(self.url, requests[:2]))  # warm-up
        if profile_out is not None:
            for name in ("worker", "scheduler"):
                out = profile_out.with_name(f"{profile_out.stem}-{name}.txt")
                self.profilers.append((name, out, subprocess.Popen(
                    [str(Path(sys.executable).parent / "py-spy"), "record", "--format", "raw", "--rate", "200",
                     "--nonblocking", "-o", str(out), "-p", str(info["pids"][name])],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
            time.sleep(1.0)

    def run(self, requests) -> Outcome:
        start = time.perf_counter()
        latencies = asyncio.run(_shuttle_requests(self.url, requests))
        return Outcome("shuttle", time.perf_counter() - start, sum(m for _, m in requests), latencies)

    def stop(self) -> None:
        for _, _, p in self.profilers:
            p.send_signal(signal.SIGINT)
            p.wait(30)
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(15)
        for name, out, _ in self.profilers:
            print(f"\nprofile of the {name} process ({out}):")
            for category, share in summarize_profile(out).items():
                print(f"  {category:<34}{100 * share:6.1f}%")


async def _shuttle_requests(url: str, requests) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=7200)) as session:
        start = time.perf_counter()

        async def one(prompt, max_tokens) -> float:
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                result = await response.json()
                assert response.status == 200, result
                assert result["usage"]["completion_tokens"] == max_tokens
            return time.perf_counter() - start

        return await asyncio.gather(*(one(p, m) for p, m in requests))


# Innermost frame that decides a sample's category; checked in order.
_CATEGORIES = [
    ("attention (worker/attention.py)", re.compile(r"worker/attention\.py")),
    ("sampling (worker/sampler.py)", re.compile(r"worker/sampler\.py")),
    ("input packing (worker/input_batch.py)", re.compile(r"worker/input_batch\.py")),
    ("model forward, rest (transformers/torch)", re.compile(r"transformers/|torch/nn/")),
    ("messaging (zmq, msgspec)", re.compile(r"common/ipc\.py|zmq/")),
    ("scheduling (scheduler/*.py)", re.compile(r"scheduler/(scheduler|kv_cache|block_pool|queue|stats)\.py")),
    ("waiting for work (idle)", re.compile(r"\b(recv|poll)\b")),
]


def summarize_profile(path: Path) -> dict[str, float]:
    """Share of samples per category from py-spy's raw folded stacks (innermost matching frame wins)."""
    counts: collections.Counter[str] = collections.Counter()
    if not path.exists():
        return {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = stack.split(";")
        category = "other"
        for frame in reversed(frames):
            match = next((name for name, pattern in _CATEGORIES if pattern.search(frame)), None)
            if match:
                category = match
                break
        counts[category] += int(count)
    total = sum(counts.values()) or 1
    return {k: v / total for k, v in counts.most_common()}


# ---- llama.cpp ------------------------------------------------------------------------------------------------------

LLAMA_CPP_SRC = REPO / ".venv" / "llama-cpp-src"


def convert_to_gguf(model_dir: str) -> Path:
    """The model as an f32 GGUF (cached next to the model under /tmp), by llama.cpp's own converter."""
    converters = sorted(LLAMA_CPP_SRC.glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not converters:
        raise RuntimeError("llama.cpp's converter is missing: run scripts/dev/install_llama_cpp.sh")
    out = Path("/tmp/shuttle-gguf") / f"{Path(model_dir).resolve().name}-f32.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(converters[-1]), model_dir, "--outfile", str(out), "--outtype", "f32"],
                       check=True, stdout=subprocess.DEVNULL)
    return out


def load_llama_cpp(model_dir: str, requests, threads: int):
    from llama_cpp import Llama

    return Llama(model_path=str(convert_to_gguf(model_dir)), n_ctx=max(len(p) + m for p, m in requests) + 8,
                 n_threads=threads, n_threads_batch=threads, n_batch=512, verbose=False)


def run_llama_cpp(llm, requests, threads: int) -> Outcome:
    start = time.perf_counter()
    latencies, produced = [], 0
    for prompt, max_tokens in requests:
        llm.reset()
        generated = 0
        for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):  # greedy; runs past end-of-sequence ids
            generated += 1
            if generated == max_tokens:
                break
        produced += generated
        latencies.append(time.perf_counter() - start)
    return Outcome("llama.cpp one at a time", time.perf_counter() - start, produced, latencies,
                   f"llama-cpp-python, f32 GGUF, {threads} threads")


# ---- transformers baselines ---------------------------------------------------------------------------------------

def run_sequential(model, requests) -> Outcome:
    start = time.perf_counter()
    latencies = []
    with torch.inference_mode():
        for prompt, max_tokens in requests:
            model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                           do_sample=False, pad_token_id=0)
            latencies.append(time.perf_counter() - start)
    return Outcome("transformers one at a time", time.perf_counter() - start, sum(m for _, m in requests), latencies)


def run_static_batches(model, requests, batch_size: int) -> Outcome:
    start = time.perf_counter()
    latencies = []
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(m for _, m in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=0)
            latencies.extend([time.perf_counter() - start] * len(batch))
    return Outcome(f"transformers static batches of {batch_size}", time.perf_counter() - start,
                   sum(m for _, m in requests), latencies, "padding tokens and tails beyond max_tokens are wasted")


def run_continuous_batching(model, requests) -> Outcome:
    config = GenerationConfig(do_sample=False, max_new_tokens=max(m for _, m in requests), eos_token_id=-1,
                              pad_token_id=0)
    start = time.perf_counter()
    latencies, produced = {}, 0
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30) as manager:
        ids = [manager.add_request(input_ids=p, max_new_tokens=m) for p, m in requests]
        while len(latencies) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                latencies[result.request_id] = time.perf_counter() - start
                produced += len(result.generated_tokens)
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching manager stopped")
    return Outcome("transformers continuous batching", time.perf_counter() - start, produced,
                   list(latencies.values()))


def _median_round(runs: list[Outcome]) -> Outcome:
    """The round with the median wall time (the lower middle of an even count), its walls listed in the note."""
    ordered = sorted(runs, key=lambda o: o.wall_s)
    chosen = ordered[(len(ordered) - 1) // 2]
    if len(runs) > 1:
        walls = ", ".join(f"{o.wall_s:.2f}" for o in runs)
        chosen.note = "; ".join(filter(None, [chosen.note, f"median of {len(runs)} rounds: {walls} s"]))
    return chosen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size for the padded baseline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of every method, interleaved; each row is the method's median round")
    parser.add_argument("--skip", nargs="*", default=[], choices=["sequential", "static", "continuous"])
    parser.add_argument("--peers", nargs="*", default=[], choices=["llama.cpp"],
                        help="other engines to run on the same workload (installed separately)")
    parser.add_argument("--serve-args", default="", help="extra `shuttle serve` flags, one string")
    parser.add_argument("--profile", action="store_true", help="py-spy the worker and scheduler during shuttle's run")
    parser.add_argument("--result-json", default="bench_results/bench_compare.json")
    args = parser.parse_args()

    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    max_len = model.config.max_position_embeddings
    requests = workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), model.config.vocab_size,
                        args.seed)
    assert all(len(p) + m <= max_len for p, m in requests), "workload exceeds the model's positions"
    profile = Path(args.result_json).with_suffix("") if args.profile else None
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)

    # Every method runs --repeats times, rounds interleaved so that a machine whose speed drifts affects all alike;
    # each row is the method's median round (by wall time). shuttle's server starts once.
    server = ShuttleServer(args.model, requests, args.serve_args.split(), profile)
    rounds: dict[str, list[Outcome]] = collections.defaultdict(list)
    try:
        for _ in range(args.repeats):
            found = [server.run(requests)]
            if "sequential" not in args.skip:
                found.append(run_sequential(model, requests))
            if "static" not in args.skip:
                found.append(run_static_batches(model, requests, args.batch_size))
            if "continuous" not in args.skip:
                try:
                    found.append(run_continuous_batching(model, requests))
                except Exception as exc:  # it is allowed not to run everywhere; say so in the table
                    found.append(Outcome("transformers continuous batching", float("nan"), 0, [],
                                         f"failed: {exc!r}"[:120]))
            if "llama.cpp" in args.peers:
                # loaded for its own round only: its idle worker threads keep polling and would slow the others
                llm = load_llama_cpp(args.model, requests, torch.get_num_threads())
                try:
                    found.append(run_llama_cpp(llm, requests, torch.get_num_threads()))
                finally:
                    llm.close()
                    del llm
            for outcome in found:
                rounds[outcome.name].append(outcome)
    finally:
        server.stop()
    outcomes = [_median_round(runs) for runs in rounds.values()]

    rows = [o.row() for o in outcomes]
    shuttle = rows[0]
    print(f"\nmodel {args.model}: {args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
          f"outputs {args.output_len[0]}-{args.output_len[1]} tokens, greedy, all at once; torch threads "
          f"{torch.get_num_threads()}; median of {args.repeats} interleaved round(s)")
    print(f"{'method':<36}{'wall s':>9}{'out tok/s':>11}{'mean lat s':>12}{'p99 lat s':>11}{'shuttle x':>11}")
    for row in rows:
        ratio = shuttle["output_tok_per_s"] / row["output_tok_per_s"] if row["output_tok_per_s"] else float("nan")
        row["shuttle_throughput_ratio"] = ratio
        print(f"{row['method']:<36}{row['wall_s']:>9.2f}{row['output_tok_per_s']:>11.1f}{row['mean_latency_s']:>12.2f}"
              f"{row['p99_latency_s']:>11.2f}{ratio:>11.2f}" + (f"  ({row['note']})" if row["note"] else ""))
    os.makedirs(os.path.dirname(args.result_json) or ".", exist_ok=True)
    with open(args.result_json, "w") as f:
        json.dump({"model": args.model, "rows": rows, "args": {k: str(v) for k, v in vars(args).items()}}, f, indent=2)
    print(f"wrote {args.result_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
