"""`shuttle bench`: drive a running shuttle (or any OpenAI-compatible) server over streaming HTTP and report what
users feel: TTFT, TPOT, ITL, end-to-end latency (mean, median, p90, p99), throughput and goodput.

Workload: seeded random token-id prompts (input/output lengths uniform in [len*(1-r), len*(1+r)], optionally
behind a shared prefix) or a JSONL file of {"prompt": ..., "max_tokens": ...}. Arrivals: Poisson at
--request-rate, or as fast as --max-concurrency allows. Output lengths are fixed with ignore_eos. `shuttle simulate`
predicts the same workload (same generator, same seed) and `shuttle tune` verifies its candidates with it.

    shuttle bench --url http://127.0.0.1:8000 --num-prompts 200 --max-concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Annotated

import aiohttp
import msgspec
from tqdm import tqdm

from shuttle.common.arg_types import count, output_file, positive, positive_number, range_ratio, request_rate


@dataclass
class RequestSpec:
    prompt: list[int] | str
    prompt_len: int
    max_tokens: int
    extra: dict = field(default_factory=dict)  # more body fields, over the defaults (a response_format, say)


@dataclass
class RequestResult:
    ok: bool
    prompt_len: int = 0
    output_tokens: int = 0
    sent: float = 0.0  # perf_counter seconds when the request was sent
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, shared_prefix_len: int,
                    vocab_size: int, seed: int) -> list[RequestSpec]:
    rng = random.Random(seed)
    low_token = 3  # skip <unk>, <s>, </s>
    prefix = [rng.randrange(low_token, vocab_size) for _ in range(shared_prefix_len)]

    def length(mean: int) -> int:
        return max(1, rng.randint(int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))))

    specs = []
    for _ in range(n):
        prompt = [1] + prefix + [rng.randrange(low_token, vocab_size) for _ in range(length(input_len))]
        specs.append(RequestSpec(prompt, len(prompt), length(output_len)))
    return specs


class DatasetLine(msgspec.Struct, forbid_unknown_fields=True):
    """One line of a --dataset file; a key not declared here is refused, not ignored."""

    prompt: Annotated[str, msgspec.Meta(min_length=1)] | Annotated[list[Annotated[int, msgspec.Meta(ge=0)]],
                                                                   msgspec.Meta(min_length=1)]
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 128


def file_workload(path: str, n: int) -> list[RequestSpec]:
    """The first `n` requests of a JSONL file of DatasetLine: {"prompt": text or token ids, "max_tokens": int
    (default 128)}.

    Raises:
        ValueError: the file cannot be read, or a line is not such an object (naming the line and why).
    """
    specs = []
    try:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = msgspec.json.decode(line, type=DatasetLine)
                except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                    raise ValueError(f"{path} line {number}: not a {{prompt, max_tokens}} object ({exc})") from None
                prompt = item.prompt
                specs.append(RequestSpec(prompt, len(prompt) if isinstance(prompt, list) else 0, item.max_tokens))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    return specs[:n] if n else specs


async def run_one(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec) -> RequestResult:
    body = {"model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **spec.extra}
    start = time.perf_counter()
    result = RequestResult(ok=False, prompt_len=spec.prompt_len, sent=start)
    last = start
    try:
        async with session.post(f"{url}/v1/completions", json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    result.error = event["error"]["message"]
                    return result
                now = time.perf_counter()
                if event.get("choices") and event["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                if event.get("usage"):
                    result.output_tokens = event["usage"]["completion_tokens"]
                    result.prompt_len = event["usage"]["prompt_tokens"]
        result.e2e = time.perf_counter() - start
        result.ok = True
    except aiohttp.ClientError as exc:
        result.error = repr(exc)
    return result


def _headers(api_key: str | None) -> dict:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_benchmark(url: str, specs: list[RequestSpec], request_rate: float, max_concurrency: int | None,
                        seed: int, progress: bool, api_key: str | None = None,
                        keep_alive: bool = True) -> tuple[list[RequestResult], float]:
    """Send `specs` (Poisson arrivals at `request_rate`, or all at once; at most `max_concurrency` in flight) and
    return each request's result and the seconds from the first sent to the last done. keep_alive=False opens a
    connection per request: a server that closes each connection after a streamed response while advertising
    keep-alive (llama.cpp's llama-server) otherwise fails the requests that reuse one."""
    connector = aiohttp.TCPConnector(limit=0, force_close=not keep_alive)
    async with aiohttp.ClientSession(connector=connector, headers=_headers(api_key),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async with session.get(f"{url}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(specs), disable=not progress, desc="requests")
        rng = random.Random(seed + 1)

        async def guarded(spec: RequestSpec) -> RequestResult:
            if semaphore is None:
                result = await run_one(session, url, model, spec)
            else:
                async with semaphore:
                    result = await run_one(session, url, model, spec)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for spec in specs:
            tasks.append(asyncio.create_task(guarded(spec)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return results, duration


def percentiles(values: list[float]) -> dict[str, float]:
    """mean, median, p90, p99 in milliseconds (nearest-rank percentiles)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0}
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, int(round(p / 100 * len(ordered) + 0.5)) - 1))]

    return {"mean": 1000 * statistics.fmean(ordered), "median": 1000 * statistics.median(ordered),
            "p90": 1000 * rank(90), "p99": 1000 * rank(99)}


def summarize(results: list[RequestResult], duration: float, ttft_slo_ms: float | None,
              tpot_slo_ms: float | None) -> dict:
    done = [r for r in results if r.ok]
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    good = [r for r in done
            if (ttft_slo_ms is None or 1000 * r.ttft <= ttft_slo_ms)
            and (tpot_slo_ms is None or r.output_tokens <= 1 or 1000 * (r.e2e - r.ttft) / (r.output_tokens - 1)
                 <= tpot_slo_ms)]
    return {
        "completed": len(done), "failed": len(results) - len(done), "duration_s": duration,
        "request_throughput": len(done) / duration,
        "input_token_throughput": sum(r.prompt_len for r in done) / duration,
        "output_token_throughput": sum(r.output_tokens for r in done) / duration,
        "total_input_tokens": sum(r.prompt_len for r in done),
        "total_output_tokens": sum(r.output_tokens for r in done),
        "goodput": len(good) / duration if (ttft_slo_ms or tpot_slo_ms) else None,
        "ttft_ms": percentiles([r.ttft for r in done]), "tpot_ms": percentiles(tpots),
        "itl_ms": percentiles([x for r in done for x in r.itls]), "e2e_ms": percentiles([r.e2e for r in done]),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def save_requests(path: str, results: list[RequestResult]) -> None:
    """One JSON line per request, in the order sent: when it was sent (seconds after the first), its lengths
    (tokens), TTFT, end-to-end latency and inter-token latencies (seconds), and its error ("" when it succeeded)."""
    first = min((r.sent for r in results), default=0.0)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        for r in sorted(results, key=lambda r: r.sent):
            f.write(json.dumps({"sent_s": r.sent - first, "prompt_len": r.prompt_len, "output_tokens": r.output_tokens,
                                "ttft_s": r.ttft, "e2e_s": r.e2e, "itls_s": r.itls, "error": r.error}) + "\n")


def print_table(summary: dict) -> None:
    print(f"{'completed':<28}{summary['completed']:>12}   failed {summary['failed']}")
    print(f"{'duration (s)':<28}{summary['duration_s']:>12.2f}")
    print(f"{'request throughput (req/s)':<28}{summary['request_throughput']:>12.2f}")
    print(f"{'input throughput (tok/s)':<28}{summary['input_token_throughput']:>12.1f}")
    print(f"{'output throughput (tok/s)':<28}{summary['output_token_throughput']:>12.1f}")
    if summary["goodput"] is not None:
        print(f"{'goodput (req/s)':<28}{summary['goodput']:>12.2f}")
    print(f"{'(ms)':<10}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        row = summary[f"{name}_ms"]
        print(f"{name.upper():<10}" + "".join(f"{row[k]:>10.1f}" for k in ("mean", "median", "p90", "p99")))
    for error in summary["errors"]:
        print(f"error: {error}")


def add_request_shape_args(parser: argparse.ArgumentParser) -> None:
    """The workload flags `shuttle bench` shares with `shuttle simulate` and `shuttle tune` (declared once)."""
    parser.add_argument("--num-prompts", type=positive, default=200)
    parser.add_argument("--request-rate", type=request_rate, default=float("inf"),
                        help="requests per second (Poisson arrivals), or inf")
    parser.add_argument("--max-concurrency", type=positive, default=None)
    parser.add_argument("--input-len", type=positive, default=128)
    parser.add_argument("--output-len", type=positive, default=64)
    parser.add_argument("--range-ratio", type=range_ratio, default=0.5,
                        help="lengths uniform in len*(1 +- r), r in [0, 1)")
    parser.add_argument("--shared-prefix-len", type=count, default=0)
    parser.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="shuttle bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    add_request_shape_args(parser)
    parser.add_argument("--dataset", default=None, help="JSONL of {prompt, max_tokens} instead of random prompts")
    parser.add_argument("--ttft-slo-ms", type=positive_number, default=None, help="goodput objective (ms)")
    parser.add_argument("--tpot-slo-ms", type=positive_number, default=None, help="goodput objective (ms)")
    parser.add_argument("--result-json", default="bench_results/bench_serve.json", type=output_file)
    parser.add_argument("--api-key", default=os.environ.get("SHUTTLE_API_KEY"),
                        help="sent as Authorization: Bearer (default: $SHUTTLE_API_KEY)")
    parser.add_argument("--save-requests", default=None, metavar="JSONL", type=output_file,
                        help="also write one line per request: sent_s (since the first was sent), prompt_len, "
                             "output_tokens, ttft_s, e2e_s, itls_s, error")
    parser.add_argument("--vocab-size", type=positive, default=None,
                        help="random prompts draw token ids below this (default: the vocab_size the server's "
                             "/v1/models reports; a server that reports none needs this flag)")
    parser.add_argument("--no-keep-alive", action="store_true",
                        help="one connection per request (for servers that close connections they advertise as "
                             "kept alive)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    if args.dataset:
        try:
            specs = file_workload(args.dataset, args.num_prompts)
        except ValueError as exc:
            parser.error(f"--dataset: {exc}")
        if not specs:
            parser.error(f"--dataset: {args.dataset} holds no request")
    else:
        try:
            vocab_size = args.vocab_size or asyncio.run(served_vocab_size(args.url, args.api_key))
        except (aiohttp.ClientError, OSError, KeyError, IndexError, ValueError) as exc:
            parser.error(f"cannot read {args.url}/v1/models ({type(exc).__name__}: {exc}): is the server up at "
                         f"--url (its base, without /v1), with --api-key if it needs one?")
        if vocab_size is None:
            parser.error(f"{args.url}/v1/models reports no vocab_size: pass --vocab-size (token ids of random "
                         "prompts must stay inside the model's vocabulary) or --dataset")
        specs = random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                                args.shared_prefix_len, vocab_size, args.seed)
    results, duration = asyncio.run(run_benchmark(args.url, specs, args.request_rate, args.max_concurrency, args.seed,
                                                  not args.no_progress, args.api_key, not args.no_keep_alive))
    summary = summarize(results, duration, args.ttft_slo_ms, args.tpot_slo_ms)
    summary["config"] = {k: v for k, v in vars(args).items() if k not in ("no_progress", "api_key")}
    summary["config"]["request_rate"] = str(args.request_rate)
    print_table(summary)
    if args.result_json:  # its folder made by the parser (output_file)
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
        print(f"wrote {args.result_json}")
    if args.save_requests:
        save_requests(args.save_requests, results)
        print(f"wrote {args.save_requests}")
    return 0 if summary["failed"] == 0 else 1


async def served_vocab_size(url: str, api_key: str | None) -> int | None:
    """The vocab_size the server's first model reports in /v1/models (shuttle does; vLLM and llama-server do
    not: None)."""
    async with aiohttp.ClientSession(headers=_headers(api_key)) as session:
        async with session.get(f"{url}/v1/models") as response:
            if response.status != 200:  # its own words (a 401 for the key, a 404 for a --url ending in /v1)
                raise ValueError(f"HTTP {response.status}: {(await response.text())[:200]}")
            return (await response.json())["data"][0].get("vocab_size")
