#!/usr/bin/env python3
"""How closely shuttle's bfloat16 CPU path agrees with transformers (bf16 cannot be token-exact with fp32).

For each model, 32 fixed prompts (capacity/story_prompts.py's story, as scripts/dev/gpu_check.py cuts it) run
through the in-process engine (cpu attention backend: the numba kernel over a bfloat16 cache) and through
transformers' own greedy generate, one prompt at a time, end-of-sequence ignored so every output has the same
length. Rows:

- shuttle bf16 against transformers bf16 (the same dtype: what the paged path itself changes) and against
  transformers fp32 (what bf16 costs), with transformers bf16 against fp32 as the yardstick;
- shuttle with fp32 weights over a bfloat16 KV cache (--kv-cache-dtype bfloat16) against transformers fp32.

Greedy agreement: the share of identical sequences and the mean common-prefix fraction. Logprobs: the mean |log
probability difference| of every prompt token after the first (the echo / prompt_logprobs path) against the
same transformers reference. A random model's greedy is noisier than a trained one's (its top two logits are often
close), so its agreement is a lower bound.

    .venv/bin/python scripts/dev/check_agreement.py --json /tmp/agreement.json \\
        ../shared/models/stories260K /tmp/shuttle-models/llama-110m
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "dev"))

from gpu_check import common_prefix, greedy, hf_greedy, prompt_ids  # noqa: E402

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig  # noqa: E402
from shuttle.common.messages import Submit  # noqa: E402
from shuttle.common.model_config import ModelConfig  # noqa: E402
from shuttle.common.sampling import SamplingParams  # noqa: E402
from shuttle.scheduler.in_process import drive  # noqa: E402
from shuttle.scheduler.kv_cache import KVCacheManager  # noqa: E402
from shuttle.scheduler.scheduler import Scheduler  # noqa: E402

CPU = torch.device("cpu")
NUM_BLOCKS = 1024


def make_runner(model_dir: str, dtype: str, kv_cache_dtype: str = "auto", quantization: str = "none"):
    """A CPU ModelRunner (cpu attention backend; start-up check passed) of these dtypes and --quantization."""
    from shuttle.worker.worker import ModelRunner

    model = ModelConfig.from_dir(model_dir, dtype=dtype)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(16, NUM_BLOCKS, kv_cache_dtype=kv_cache_dtype),
                           scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
                           worker=WorkerConfig(device="cpu", attention_backend="cpu", quantization=quantization))
    return model, ModelRunner(config, device=CPU)


def new_scheduler(model: ModelConfig, runner, prefix_caching: bool) -> Scheduler:
    """A fresh scheduler (empty queue, empty block pool) for `runner`, whose earlier requests are dropped."""
    for request_id in list(runner.batch.requests):
        runner.batch.drop(request_id)
    return Scheduler(SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
                     KVCacheManager(NUM_BLOCKS, 16, prefix_caching), model.max_model_len, model.eos_token_ids)


def shuttle_prompt_logprobs(scheduler, runner, prompts: list[list[int]]) -> list[list[float]]:
    """The logprob of every prompt token after the first, from the engine's prompt_logprobs path."""
    out: dict[str, list[float]] = {}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        scheduler.add_request(b"c", Submit(request_id=f"p{i}", prompt_token_ids=prompt, sampling=params,
                                           arrival_time=time.time()))

    def collect(batch) -> None:
        for o in batch:
            if o.prompt_logprobs:
                out[o.request_id] = [t.logprob for t in o.prompt_logprobs]

    drive(scheduler, runner, collect)
    return [out.get(f"p{i}", []) for i in range(len(prompts))]


def hf_prompt_logprobs(model_dir: str, dtype: str, prompts: list[list[int]]) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    rows = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logp = model(ids).logits[0, :-1].float().log_softmax(-1)  # [n - 1, vocab]
            rows.append(logp.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return rows


def agreement(ours: list[list[int]], theirs: list[list[int]], tokens: int) -> dict:
    return {"identical": sum(a == b for a, b in zip(ours, theirs)) / len(ours),
            "prefix": sum(common_prefix(a, b) / tokens for a, b in zip(ours, theirs)) / len(ours)}


def logprob_gap(ours: list[list[float]], theirs: list[list[float]]) -> float:
    diffs = [abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y)]
    return sum(diffs) / max(len(diffs), 1)


def check_model(model_dir: str, count: int, tokens: int) -> list[dict]:
    prompts = prompt_ids(model_dir, count)
    max_tokens = [tokens] * count
    multi = [p for p in prompts if len(p) > 1]  # prompt logprobs need a second token
    hf = {dtype: hf_greedy(model_dir, dtype, CPU, prompts, max_tokens) for dtype in ("bfloat16", "float32")}
    hf_lp = {dtype: hf_prompt_logprobs(model_dir, dtype, multi) for dtype in ("bfloat16", "float32")}
    rows = []
    for label, dtype, kv in (("shuttle bf16", "bfloat16", "auto"), ("shuttle fp32, bf16 KV", "float32", "bfloat16")):
        model, runner = make_runner(model_dir, dtype, kv)
        ours = greedy(new_scheduler(model, runner, True), runner, prompts, max_tokens)
        ours_lp = shuttle_prompt_logprobs(new_scheduler(model, runner, False), runner, multi)
        references = ("bfloat16", "float32") if dtype == "bfloat16" else ("float32",)
        for ref in references:
            rows.append({"model": Path(model_dir).name, "run": label, "against": f"transformers {ref}",
                         **agreement(ours, hf[ref], tokens), "logprob_gap": logprob_gap(ours_lp, hf_lp[ref])})
    rows.append({"model": Path(model_dir).name, "run": "transformers bf16", "against": "transformers float32",
                 **agreement(hf["bfloat16"], hf["float32"], tokens),
                 "logprob_gap": logprob_gap(hf_lp["bfloat16"], hf_lp["float32"])})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="model directories")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args()
    rows = [row for model in args.models for row in check_model(model, args.prompts, args.tokens)]
    print(f"{args.prompts} prompts x {args.tokens} greedy tokens; logprobs: mean |difference| over every prompt "
          f"token after the first")
    print("| model | run | against | identical sequences | mean common prefix | mean \\|logprob diff\\| |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['run']} | {r['against']} | {100 * r['identical']:.0f}% | {100 * r['prefix']:.0f}% "
              f"| {r['logprob_gap']:.2g} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
