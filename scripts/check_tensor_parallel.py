#!/usr/bin/env python3
"""Check tensor parallel on any model (issue 13 acceptance 1): greedy outputs of a TP=N server, streamed and not,
with chunked prefill and preemption, token for token against a TP=1 server and transformers' own generate.

Starts `shuttle serve MODEL --tensor-parallel-size 1` and then `N` with the same small step budget and KV cache
(one server at a time), sends the same concurrent greedy requests (random token ids, seeded; every other one
streamed) to each, then runs transformers' generate on every prompt. Servers are stopped by PID.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/check_tensor_parallel.py /tmp/shuttle-models/llama-110m
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.server import ShuttleServer  # noqa: E402


async def greedy(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                 stream: bool) -> list[int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True,
            "stream": stream}
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {await response.text()}")
        if not stream:
            return (await response.json())["choices"][0]["token_ids"]
        tokens = []
        async for raw in response.content:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"])
                tokens.extend(chunk["choices"][0]["token_ids"])
        return tokens


async def serve_all(url: str, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list[list[int]], dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        outputs = await asyncio.gather(*(greedy(session, url, p, m, stream=i % 2 == 0)
                                         for i, (p, m) in enumerate(zip(prompts, max_tokens))))
        async with session.get(f"{url}/health") as response:
            stats = (await response.json())["scheduler"]
    return list(outputs), stats


def run_server(model: Path, tp: int, flags: list[str], prompts, max_tokens) -> list[list[int]]:
    server = ShuttleServer(*flags, "--tensor-parallel-size", str(tp), model_dir=model, start_timeout=600)
    try:
        started = time.monotonic()
        outputs, stats = asyncio.run(serve_all(server.url, prompts, max_tokens))
        capacity = next(line for line in server.output if line.startswith("shuttle: KV cache"))
        print(f"TP={tp}: {len(prompts)} requests in {time.monotonic() - started:.1f} s, "
              f"{stats['num_preemptions']} preemptions, {stats['num_steps']} steps; {capacity[len('shuttle: '):]}",
              flush=True)
        return outputs
    finally:
        server.stop()


def transformers_greedy(model_dir: Path, prompts, max_tokens) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    with torch.inference_mode():
        for prompt, m in zip(prompts, max_tokens):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=m, do_sample=False)[0, len(prompt):]
            out.append(ids.tolist())
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--tensor-parallel-size", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-num-batched-tokens", type=int, default=32, help="small: long prompts are chunked")
    parser.add_argument("--num-kv-blocks", type=int, default=16, help="small: requests are preempted")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    prompts = [[1] + [rng.randrange(3, vocab) for _ in range(rng.randrange(1, 120))] for _ in range(args.num_prompts)]
    max_tokens = [rng.randrange(8, 40) for _ in prompts]
    flags = ["--max-num-batched-tokens", str(args.max_num_batched_tokens), "--num-kv-blocks", str(args.num_kv_blocks)]
    single = run_server(args.model, 1, flags, prompts, max_tokens)
    parallel = run_server(args.model, args.tensor_parallel_size, flags, prompts, max_tokens)
    reference = transformers_greedy(args.model, prompts, max_tokens)
    same_tp1 = sum(a == b for a, b in zip(parallel, single))
    same_hf = sum(a == b for a, b in zip(parallel, reference))
    print(f"TP={args.tensor_parallel_size} equals TP=1 on {same_tp1}/{len(prompts)} requests and transformers on "
          f"{same_hf}/{len(prompts)} ({sum(map(len, reference))} tokens)")
    for i, (a, b, c) in enumerate(zip(parallel, single, reference)):
        if not a == b == c:
            print(f"  request {i} (prompt {len(prompts[i])} tokens): TP={args.tensor_parallel_size} {a}\n"
                  f"    TP=1 {b}\n    transformers {c}")
    return 0 if same_tp1 == same_hf == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
