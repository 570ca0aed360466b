#!/usr/bin/env python3
"""What grammar-constrained decoding costs: unconstrained against json_schema-constrained requests on one server,
in one run, and unconstrained requests beside constrained ones; then grammar compile time, cold and cached.

Phases, each --concurrency requests in flight (--rounds x concurrency requests in all), streamed completions:
  free    unconstrained, ignore_eos, --free-tokens tokens each (about the json outputs' length), sampled at
          temperature 1.0 as the json requests are
  json    a response_format json_schema (nested objects, arrays, enums, numbers), up to --json-max-tokens tokens
          (they end where the JSON does)
  mixed   half of each; the free half's figures are the "free in mixed" row
Every json output is checked to parse and to validate against the schema (jsonschema); a failure is counted.
Compile time: the worker's GrammarCompiler on the served model's tokenizer, a schema it has not seen (cold) and
again (cached), in this process.

    .venv/bin/python scripts/dev/bench_structured.py                       # stories260K, 64 concurrent
    .venv/bin/python scripts/dev/bench_structured.py --model PATH --concurrency 128

Prints a table and writes JSON (--result-json). Ratios from one run on a quiet machine are the figures to quote;
absolute times only from the machine the server is meant for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shuttle.capacity.bench_serve import RequestSpec, run_benchmark, summarize  # noqa: E402
from shuttle.common.config import DEFAULT_MODEL_DIR  # noqa: E402
from shuttle.common.model_config import ModelConfig  # noqa: E402
from shuttle.common.sampling import StructuredOutput  # noqa: E402
from shuttle.launcher.local_server import ShuttleServer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["happy", "sad", "sleepy"]},
        "height": {"type": "number"},
        "friends": {"type": "array", "maxItems": 3,
                    "items": {"type": "object",
                              "properties": {"name": {"type": "string", "maxLength": 12},
                                             "kind": {"enum": ["cat", "dog", "bird"]}},
                              "required": ["name", "kind"], "additionalProperties": False}},
    },
    "required": ["name", "age", "mood", "friends"],
    "additionalProperties": False,
}
PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a bird"]


def _response_format(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                         "strict": True}},
            "ignore_eos": False, "temperature": 1.0}


def _specs(kind: str, n: int, args, rng: random.Random) -> list[RequestSpec]:
    specs = []
    for i in range(n):
        prompt = rng.choice(PROMPTS)
        if kind == "json" or (kind == "mixed" and i % 2):
            specs.append(RequestSpec(prompt, 0, args.json_max_tokens, {**_response_format(SCHEMA), "seed": i}))
        else:
            # sampled as the json requests are (greedy would take the sampler's shortcut and flatter the baseline)
            specs.append(RequestSpec(prompt, 0, args.free_tokens, {"temperature": 1.0, "seed": i}))
    return specs


async def _run_phase(url: str, specs: list[RequestSpec], concurrency: int):
    results, duration = await run_benchmark(url, specs, float("inf"), concurrency, 0, False)
    return results, duration


def _row(name: str, results, duration: float) -> dict:
    summary = summarize(results, duration, None, None)
    return {"phase": name, "completed": summary["completed"], "failed": summary["failed"],
            "out_tok_s": summary["output_token_throughput"], "itl_p50_ms": summary["itl_ms"]["median"],
            "itl_p99_ms": summary["itl_ms"]["p99"], "ttft_p50_ms": summary["ttft_ms"]["median"],
            "errors": summary["errors"]}


async def _json_outputs_valid(url: str, n: int, max_tokens: int) -> tuple[int, int]:
    """(valid, total) over n non-streamed json_schema completions (seeded, temperature 1.0)."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async def one(i: int) -> bool:
            body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "seed": i,
                    **_response_format(SCHEMA)}
            async with session.post(f"{url}/v1/completions", json=body) as response:
                data = await response.json()
            try:
                jsonschema.validate(json.loads(data["choices"][0]["text"]), SCHEMA)
                return True
            except (KeyError, ValueError, jsonschema.ValidationError):
                return False

        valid = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(valid), n


def _compile_times(model_dir: str) -> dict:
    from shuttle.worker.grammar import GrammarCompiler

    model = ModelConfig.from_dir(model_dir)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size
    compiler = GrammarCompiler(model.tokenizer_dir or model.model_dir, vocab, model.eos_token_ids)
    compiler.compile_now([StructuredOutput(kind="json_object")])  # loads the tokenizer: not a compile's cost
    times = {}
    for label in ("cold", "cached"):
        spec = StructuredOutput(kind="json", spec=json.dumps(SCHEMA))
        start = time.perf_counter()
        answer = compiler.compile_now([spec])
        times[f"compile_{label}_ms"] = 1000 * (time.perf_counter() - start)
        assert answer.errors == [""], answer.errors
    compiler.close()
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per phase = rounds x concurrency")
    parser.add_argument("--free-tokens", type=int, default=96)
    parser.add_argument("--json-max-tokens", type=int, default=400)
    parser.add_argument("--worker-threads", type=int, default=None)
    parser.add_argument("--result-json", default="bench_results/bench_structured.json")
    args = parser.parse_args(argv)

    rng = random.Random(0)
    n = args.rounds * args.concurrency
    rows = []
    with ShuttleServer(model_dir=args.model, worker_threads=args.worker_threads) as server:
        asyncio.run(_run_phase(server.url, _specs("free", min(8, n), args, rng), args.concurrency))  # warm-up
        for phase in ("free", "json", "mixed"):
            specs = _specs(phase, n, args, rng)
            results, duration = asyncio.run(_run_phase(server.url, specs, args.concurrency))
            if phase == "mixed":
                json_rows = ["response_format" in s.extra for s in specs]
                rows.append(_row("free in mixed", [r for r, j in zip(results, json_rows) if not j], duration))
                rows.append(_row("json in mixed", [r for r, j in zip(results, json_rows) if j], duration))
            else:
                rows.append(_row(phase, results, duration))
        valid, total = asyncio.run(_json_outputs_valid(server.url, args.concurrency, args.json_max_tokens))
    by_phase = {r["phase"]: r for r in rows}
    figures = {
        "json_vs_free_out_tok_s": by_phase["json"]["out_tok_s"] / by_phase["free"]["out_tok_s"],
        "json_vs_free_itl_p50": by_phase["json"]["itl_p50_ms"] / by_phase["free"]["itl_p50_ms"],
        "free_in_mixed_vs_free_itl_p50": by_phase["free in mixed"]["itl_p50_ms"] / by_phase["free"]["itl_p50_ms"],
        "json_outputs_valid": f"{valid}/{total}",
        **_compile_times(args.model),
    }
    print(f"{'phase':<16}{'done':>6}{'failed':>8}{'out tok/s':>11}{'ITL p50':>10}{'ITL p99':>10}{'TTFT p50':>10}")
    for r in rows:
        print(f"{r['phase']:<16}{r['completed']:>6}{r['failed']:>8}{r['out_tok_s']:>11.1f}{r['itl_p50_ms']:>10.2f}"
              f"{r['itl_p99_ms']:>10.2f}{r['ttft_p50_ms']:>10.1f}")
        for error in r["errors"]:
            print(f"  error: {error}")
    for name, value in figures.items():
        print(f"{name:<32}{value:.3f}" if isinstance(value, float) else f"{name:<32}{value}")
    Path(args.result_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.result_json).write_text(json.dumps({"config": vars(args), "phases": rows, "figures": figures}, indent=2))
    print(f"wrote {args.result_json}")
    failed = sum(r["failed"] for r in rows)
    return 0 if failed == 0 and valid == total else 1


if __name__ == "__main__":
    sys.exit(main())
