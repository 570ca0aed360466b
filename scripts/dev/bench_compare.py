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

On a GPU (--device cuda, --dtype bfloat16; scripts/gpu_check.sh runs it so) the transformers baselines run on the
same device, shuttle gets its own --serve-args (its --device, --dtype and memory share), and the one-at-a-time
baseline is best skipped (--skip sequential: it takes minutes at 1B). Every method reports TTFT and ITL (shuttle
by streaming with return_token_ids, transformers through a streamer or its manager's streaming results) and its
peak memory; shuttle's decode step at --bare-batch sequences (from its --step-log) is set against the bare
transformers forward of that shape (a dense cache of --bare-context tokens), and its KV blocks are read from its
start-up line.

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
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GenerationConfig
from transformers.generation.streamers import BaseStreamer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # scheduler.step_log reads shuttle's step log

from llama_server import convert_to_gguf  # noqa: E402  (scripts/dev, this script's own directory)

from shuttle.worker.model_loader import cache_kwargs  # noqa: E402


def percentile(values: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of `values` by the nearest-rank rule, None when empty."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


@dataclass
class Outcome:
    name: str
    wall_s: float
    output_tokens: int
    latencies_s: list[float]
    note: str = ""
    ttfts_s: list[float] = field(default_factory=list)  # each request's first token, from the start of the round
    itls_s: list[float] = field(default_factory=list)  # gaps between a request's consecutive tokens
    peak_memory_mib: float | None = None

    def row(self) -> dict:
        ordered = sorted(self.latencies_s)
        def ms(v):
            return None if v is None else 1000 * v
        return {"method": self.name, "wall_s": self.wall_s, "output_tok_per_s": self.output_tokens / self.wall_s,
                "mean_latency_s": statistics.fmean(ordered) if ordered else 0.0,
                "p99_latency_s": percentile(ordered, 0.99) or 0.0,
                "ttft_p50_ms": ms(percentile(self.ttfts_s, 0.5)), "ttft_p99_ms": ms(percentile(self.ttfts_s, 0.99)),
                "itl_p50_ms": ms(percentile(self.itls_s, 0.5)), "itl_p99_ms": ms(percentile(self.itls_s, 0.99)),
                "peak_memory_mib": self.peak_memory_mib, "output_tokens": self.output_tokens, "note": self.note}


def token_times(arrivals: list[tuple[float, int]]) -> tuple[float | None, list[float]]:
    """(TTFT, ITLs) of one request from (seconds since the round began, tokens that arrived then): a chunk of k
    tokens after a gap g counts as k gaps of g / k."""
    if not arrivals:
        return None, []
    itls = []
    for (before, _), (at, count) in zip(arrivals, arrivals[1:]):
        itls += [(at - before) / max(count, 1)] * max(count, 1)
    return arrivals[0][0], itls


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int):
    rng = random.Random(seed)
    return [([1] + [rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range) - 1)], rng.randint(*output_range))
            for _ in range(n)]


# ---- shuttle ------------------------------------------------------------------------------------------------------

class ShuttleServer:
    """`shuttle serve` started once (warmed up by two requests) and timed on the workload once per round; py-spy
    records the worker and scheduler during the rounds with --profile."""

    def __init__(self, model: str, requests, serve_args: list[str], profile_out: Path | None, device: str = "cpu"):
        self.step_log = Path(tempfile.mkstemp(prefix="bench-steps-", suffix=".jsonl")[1])
        cmd = [sys.executable, "-m", "shuttle.launcher.cli", "serve", model, "--port", "0", "--step-log",
               str(self.step_log),
               *serve_args]
        self.cuda = device.startswith("cuda")
        self.device_used_before = _device_used_mib() if self.cuda else 0.0
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, start_new_session=True)
        self.profilers = []
        self.kv_blocks: int | None = None
        self.peak_memory_mib: float | None = None
        info = None
        for line in self.proc.stdout:
            print(line, end="", flush=True)
            found = re.match(r"shuttle: KV cache (\d+) blocks", line)
            if found:
                self.kv_blocks = int(found.group(1))
            if line.startswith("shuttle: ready "):
                info = json.loads(line[len("shuttle: ready "):])
                break
        if info is None:
            self.proc.wait()
            raise RuntimeError("shuttle did not start")
        # later output is passed on as it comes, so a full pipe never blocks the launcher
        threading.Thread(target=lambda: [print(line, end="", flush=True) for line in self.proc.stdout],
                         daemon=True).start()
        self.url = info["url"]
        self.worker_pid = info["pids"]["worker"]
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
        timings = asyncio.run(_shuttle_requests(self.url, requests))
        wall = time.perf_counter() - start
        self._note_memory()
        per_request = [token_times(arrivals) for _, arrivals in timings]
        return Outcome("shuttle", wall, sum(m for _, m in requests), [latency for latency, _ in timings],
                       ttfts_s=[t for t, _ in per_request if t is not None],
                       itls_s=[gap for _, gaps in per_request for gap in gaps], peak_memory_mib=self.peak_memory_mib,
                       note="device memory taken since start" if self.cuda else "worker peak RSS")

    def _note_memory(self) -> None:
        """CUDA: the device memory in use above what it was before the server started (its worker's pool, KV
        and weights); CPU: the worker process's peak resident set."""
        if self.cuda:
            taken = _device_used_mib() - self.device_used_before
        else:
            status = Path(f"/proc/{self.worker_pid}/status")
            found = re.search(r"VmHWM:\s+(\d+) kB", status.read_text()) if status.exists() else None
            taken = int(found.group(1)) / 1024 if found else None
        if taken is not None:
            self.peak_memory_mib = max(self.peak_memory_mib or 0.0, taken)

    def decode_step_ms(self, batch: int) -> tuple[int, float] | None:
        """(batch, median served milliseconds) of decode-only steps of `batch` sequences from the step log; the
        largest decode-only batch logged when none has exactly `batch`. None when the log holds no decode step."""
        from shuttle.scheduler.step_log import read_step_log

        decodes = [s for s in read_step_log(self.step_log) if s.num_prefill_seqs == 0 and s.num_decode_seqs > 0]
        if not decodes:
            return None
        sizes = {s.num_decode_seqs for s in decodes}
        chosen = batch if batch in sizes else max(sizes)
        return chosen, 1000 * statistics.median(s.seconds for s in decodes if s.num_decode_seqs == chosen)

    def slowest_steps(self, count: int = 3) -> str:
        """The `count` longest served steps of the log as "ms (tokens, prefill seqs, decode seqs)": where a stall
        (a compile, a sync) shows."""
        from shuttle.scheduler.step_log import read_step_log

        steps = sorted(read_step_log(self.step_log), key=lambda s: -s.seconds)[:count]
        return ", ".join(f"{1000 * s.seconds:.0f} ({s.num_tokens}, {s.num_prefill_seqs}, {s.num_decode_seqs})"
                         for s in steps)

    def stop(self) -> None:
        for _, _, p in self.profilers:
            p.send_signal(signal.SIGINT)
            p.wait(30)
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(15)
        self.step_log.unlink(missing_ok=True)
        for name, out, _ in self.profilers:
            print(f"\nprofile of the {name} process ({out}):")
            for category, share in summarize_profile(out).items():
                print(f"  {category:<34}{100 * share:6.1f}%")


def _device_used_mib() -> float:
    free, total = torch.cuda.mem_get_info()
    return (total - free) / 2**20


async def _shuttle_requests(url: str, requests) -> list[tuple[float, list[tuple[float, int]]]]:
    """Stream every request at once; each one's (latency, [(seconds since start, tokens in the chunk)])."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=7200)) as session:
        start = time.perf_counter()

        async def one(prompt, max_tokens):
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            arrivals = []
            async with session.post(f"{url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                async for line in response.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[len(b"data: "):])
                    assert "choices" in chunk, chunk  # an error event
                    count = sum(len(c.get("token_ids") or ()) for c in chunk["choices"])
                    if count:
                        arrivals.append((time.perf_counter() - start, count))
            assert sum(c for _, c in arrivals) == max_tokens, (sum(c for _, c in arrivals), max_tokens)
            return time.perf_counter() - start, arrivals

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

class _StepTimes(BaseStreamer):
    """Times of generate's token steps (its first put is the prompt), from `start`."""

    def __init__(self, start: float):
        self.start, self.times, self.prompt_seen = start, [], False

    def put(self, value) -> None:
        if self.prompt_seen:
            self.times.append(time.perf_counter() - self.start)
        self.prompt_seen = True

    def end(self) -> None:
        pass


def _sync(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def _peak_start(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_mib(model) -> float | None:
    """Peak device memory of this process since _peak_start (the model's weights included); None on a CPU."""
    return torch.cuda.max_memory_allocated() / 2**20 if model.device.type == "cuda" else None


def _add_times(outcome: Outcome, times: list[float], tokens: int) -> None:
    """A request's TTFT and ITLs from the times of its first `tokens` token steps."""
    ttft, itls = token_times([(t, 1) for t in times[:tokens]])
    if ttft is not None:
        outcome.ttfts_s.append(ttft)
        outcome.itls_s.extend(itls)


def run_sequential(model, requests) -> Outcome:
    _peak_start(model)
    start = time.perf_counter()
    latencies, steps = [], []
    with torch.inference_mode():
        for prompt, max_tokens in requests:
            streamer = _StepTimes(start)
            model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_tokens,
                           min_new_tokens=max_tokens, do_sample=False, pad_token_id=0, streamer=streamer)
            _sync(model)
            latencies.append(time.perf_counter() - start)
            steps.append((streamer.times, max_tokens))
    outcome = Outcome("transformers one at a time", time.perf_counter() - start, sum(m for _, m in requests),
                      latencies, peak_memory_mib=_peak_mib(model))
    for times, tokens in steps:
        _add_times(outcome, times, tokens)
    return outcome


def run_static_batches(model, requests, batch_size: int) -> Outcome:
    _peak_start(model)
    start = time.perf_counter()
    latencies, steps = [], []
    with torch.inference_mode():
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=model.device)  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=model.device)
            longest = max(m for _, m in batch)
            streamer = _StepTimes(start)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                           pad_token_id=0, streamer=streamer)
            _sync(model)
            latencies.extend([time.perf_counter() - start] * len(batch))
            steps.extend((streamer.times, m) for _, m in batch)
    outcome = Outcome(f"transformers static batches of {batch_size}", time.perf_counter() - start,
                      sum(m for _, m in requests), latencies, "padding tokens and tails beyond max_tokens are wasted",
                      peak_memory_mib=_peak_mib(model))
    for times, tokens in steps:  # a request's tokens are its batch's first `tokens` steps
        _add_times(outcome, times, tokens)
    return outcome


def run_continuous_batching(model, requests) -> Outcome:
    config = GenerationConfig(do_sample=False, max_new_tokens=max(m for _, m in requests), eos_token_id=-1,
                              pad_token_id=0)
    _peak_start(model)
    start = time.perf_counter()
    latencies, produced, arrivals = {}, 0, collections.defaultdict(list)
    seen = collections.Counter()
    with model.continuous_batching_context_manager(generation_config=config, block=True, timeout=30) as manager:
        ids = [manager.add_request(input_ids=p, max_new_tokens=m, streaming=True) for p, m in requests]
        while len(latencies) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None:  # streaming: each result holds the tokens so far
                now, count = time.perf_counter() - start, len(result.generated_tokens)
                if count > seen[result.request_id]:
                    arrivals[result.request_id].append((now, count - seen[result.request_id]))
                    seen[result.request_id] = count
                if result.is_finished():
                    latencies[result.request_id] = now
                    produced += count
            elif not manager.is_running():
                raise RuntimeError("transformers' continuous batching manager stopped")
    outcome = Outcome("transformers continuous batching", time.perf_counter() - start, produced,
                      list(latencies.values()), peak_memory_mib=_peak_mib(model))
    for request_arrivals in arrivals.values():
        ttft, itls = token_times(request_arrivals)
        outcome.ttfts_s.append(ttft)
        outcome.itls_s.extend(itls)
    return outcome


def bare_forward_ms(model, batch: int, context: int, vocab: int, repeats: int = 10) -> float:
    """Median milliseconds of transformers' own forward decoding one token for each of `batch` sequences over a
    dense cache of about `context` tokens: the model's cost with no serving engine around it."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        cache = cache_kwargs(model, DynamicCache())
        prompt = torch.randint(3, vocab, (batch, context), generator=generator).to(model.device)
        model(input_ids=prompt, **cache, use_cache=True)
        token = torch.randint(3, vocab, (batch, 1), generator=generator).to(model.device)
        times = []
        for i in range(repeats + 2):  # the context grows by one token a step: `context` is far larger than repeats
            _sync(model)
            began = time.perf_counter()
            model(input_ids=token, **cache, use_cache=True)
            _sync(model)
            if i >= 2:  # the first two warm up
                times.append(1000 * (time.perf_counter() - began))
    return statistics.median(times)


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
    parser.add_argument("--device", default="cpu", help="where the transformers baselines run (cpu, cuda, cuda:N); "
                                                        "shuttle's own device is in --serve-args")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the transformers baselines' dtype")
    parser.add_argument("--bare-batch", type=int, default=64, help="decode batch of the step-vs-bare-forward row")
    parser.add_argument("--bare-context", type=int, default=128, help="context tokens of that bare forward")
    parser.add_argument("--min-ratio", type=float, default=0.0,
                        help="exit 1 (status fail in the JSON) when shuttle's out tok/s is below this multiple of "
                             "transformers' continuous batching (gpu_check.sh: 2 on CUDA)")
    args = parser.parse_args()
    # SIGTERM (a `timeout` around this script) unwinds like Ctrl-C, so the finally below stops shuttle's processes,
    # which run in a session of their own
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    max_len = model.config.max_position_embeddings
    requests = workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), model.config.vocab_size,
                        args.seed)
    assert all(len(p) + m <= max_len for p, m in requests), "workload exceeds the model's positions"
    profile = Path(args.result_json).with_suffix("") if args.profile else None
    if profile is not None:
        profile.parent.mkdir(parents=True, exist_ok=True)

    # Every method runs --repeats times, rounds interleaved so that a machine whose speed drifts affects all alike;
    # each row is the method's median round (by wall time). shuttle's server starts once.
    server = ShuttleServer(args.model, requests, args.serve_args.split(), profile, args.device)
    rounds: dict[str, list[Outcome]] = collections.defaultdict(list)
    if model.device.type == "cuda":  # cuBLAS handles, kernels and the allocator's first blocks: not part of a round
        run_static_batches(model, [(p[:8], 4) for p, _ in requests[:4]], 4)
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
        step = server.decode_step_ms(args.bare_batch)
        slowest = server.slowest_steps()
    finally:
        server.stop()
    outcomes = [_median_round(runs) for runs in rounds.values()]
    engine = {"kv_blocks": server.kv_blocks, "slowest_steps_ms": slowest}
    if step is not None:
        bare = bare_forward_ms(model, step[0], args.bare_context, model.config.vocab_size)
        engine.update({"decode_batch": step[0], "shuttle_step_ms": step[1], "bare_forward_ms": bare,
                       "step_over_bare": step[1] / bare})

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
    print(f"\n{'method':<36}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'peak MiB':>10}  (ms)")
    def show(v, d=1):
        return "-" if v is None else f"{v:.{d}f}"
    for row in rows:
        print(f"{row['method']:<36}{show(row['ttft_p50_ms']):>10}{show(row['ttft_p99_ms']):>10}"
              f"{show(row['itl_p50_ms'], 2):>9}{show(row['itl_p99_ms'], 2):>9}{show(row['peak_memory_mib'], 0):>10}")
    print("shuttle: " + "; ".join(f"{k} {show(v, 2) if isinstance(v, float) else v}" for k, v in engine.items()))
    continuous = next((r for r in rows if r["method"] == "transformers continuous batching"), None)
    versus = continuous["shuttle_throughput_ratio"] if continuous else float("nan")
    status = "pass" if not args.min_ratio or versus >= args.min_ratio else "fail"  # NaN (it failed): fail
    summary = (f"shuttle {shuttle['output_tok_per_s']:.0f} out tok/s, "
               + (f"{versus:.2f}x transformers continuous batching" if continuous else "continuous batching not run")
               + (f" (target >= {args.min_ratio:g}x: {'met' if status == 'pass' else 'NOT met'})"
                  if args.min_ratio else ""))
    os.makedirs(os.path.dirname(args.result_json) or ".", exist_ok=True)
    with open(args.result_json, "w") as f:
        json.dump({"model": args.model, "status": status, "summary": summary, "rows": rows, "engine": engine,
                   "args": {k: str(v) for k, v in vars(args).items()}}, f, indent=2)
    print(f"{summary}\nwrote {args.result_json}")
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
