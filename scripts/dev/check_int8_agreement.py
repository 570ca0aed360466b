#!/usr/bin/env python3
"""How closely shuttle's `--quantization int8` agrees with transformers (int8 weights cannot be token-exact).

For each model, 32 fixed prompts (capacity/story_prompts.py's story, as scripts/dev/gpu_check.py cuts it) run
greedy through the in-process engine with int8 linears (float32 model, cpu attention backend) and through
transformers' own generate, one prompt at a time, end-of-sequence ignored so every output has the same length.
Rows:

- shuttle int8 against transformers fp32: what int8 costs end to end;
- shuttle int8 against transformers fp32 with the same int8 weights dequantized (q * s, worker/quantization.py):
  the kernel's own error (its bfloat16 activations, the paged path), quantization error taken out;
- transformers with the dequantized weights against transformers fp32: the quantization error alone.

Greedy agreement: the share of identical sequences and the mean common-prefix fraction. Logprobs: the mean |log
probability difference| of every prompt token after the first (shuttle's prompt_logprobs path) against the same
reference. A random model's greedy is noisier than a trained one's (its top two logits are often close), so its
agreement is a lower bound.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/check_int8_agreement.py --json /tmp/int8-agreement.json \\
        ../shared/models/stories260K /tmp/shuttle-models/llama-110m
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "dev"))

from check_agreement import agreement, logprob_gap, make_runner, new_scheduler, shuttle_prompt_logprobs  # noqa
from gpu_check import greedy, prompt_ids  # noqa: E402
from shuttle.worker.quantization import dequantize, quantize_per_channel  # noqa: E402

def hf_model(model_dir: str, dequantized: bool) -> torch.nn.Module:
    """transformers' float32 model; `dequantized`: every linear but lm_head holds q * s of its int8 weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if dequantized:
        head = model.get_output_embeddings()
        with torch.no_grad():
            for module in model.modules():
                if type(module) is torch.nn.Linear and module is not head:
                    module.weight.copy_(dequantize(*quantize_per_channel(module.weight)))
    return model


@torch.inference_mode()
def hf_runs(model_dir: str, dequantized: bool, prompts, tokens: int, multi) -> tuple[list[list[int]], list]:
    """Greedy outputs (one prompt at a time, no padding, end-of-sequence ignored) and prompt logprobs of `multi`."""
    model = hf_model(model_dir, dequantized)
    outputs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                             pad_token_id=0)
        outputs.append(ids[0, len(prompt):].tolist())
    logprobs = []
    for prompt in multi:
        ids = torch.tensor([prompt])
        logp = model(ids).logits[0, :-1].float().log_softmax(-1)  # [n - 1, vocab]
        logprobs.append(logp.gather(1, ids[0, 1:, None])[:, 0].tolist())
    return outputs, logprobs


def check_model(model_dir: str, count: int, tokens: int) -> list[dict]:
    prompts = prompt_ids(model_dir, count)
    multi = [p for p in prompts if len(p) > 1]  # prompt logprobs need a second token
    fp32, fp32_lp = hf_runs(model_dir, False, prompts, tokens, multi)
    deq, deq_lp = hf_runs(model_dir, True, prompts, tokens, multi)
    model, runner = make_runner(model_dir, "float32", quantization="int8")
    ours = greedy(new_scheduler(model, runner, True), runner, prompts, [tokens] * count)
    ours_lp = shuttle_prompt_logprobs(new_scheduler(model, runner, False), runner, multi)
    name = Path(model_dir).name
    return [
        {"model": name, "run": "shuttle int8", "against": "transformers fp32", **agreement(ours, fp32, tokens),
         "logprob_gap": logprob_gap(ours_lp, fp32_lp)},
        {"model": name, "run": "shuttle int8", "against": "transformers, int8 dequantized",
         **agreement(ours, deq, tokens), "logprob_gap": logprob_gap(ours_lp, deq_lp)},
        {"model": name, "run": "transformers, int8 dequantized", "against": "transformers fp32",
         **agreement(deq, fp32, tokens), "logprob_gap": logprob_gap(deq_lp, fp32_lp)},
    ]


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
