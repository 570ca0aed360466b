#!/usr/bin/env python3
"""What speculative decoding gains: the same greedy workload with speculation off, with ngram k=2 and k=4, and
(with --draft) with a draft model at k=4, in process with the offline LLM (no server), on two workloads.

- copy: prompts that hold a story paragraph twice, then its start a third time, so that prompt lookup can propose
  the rest of it;
- plain: ordinary story openings, where a trained model's drafts are rarely accepted.

For each workload, concurrency and setting it times `generate` over --prompts prompts of --max-tokens tokens
(greedy, ignore_eos), handed over --concurrency at a time, for --rounds interleaved rounds (one LLM per setting,
built and warmed first), and reports the median output tokens/s, the acceptance rate (accepted over drafted
tokens, from the scheduler's spec counters), the mean accepted tokens per speculative step, and the ratio of
tokens/s to speculation off. Outputs with speculation must equal those without token for token: otherwise it
prints MISMATCH and exits 1. Figures are ratios from one run on a quiet machine; the absolute times depend on the
host.

    .venv/bin/python scripts/dev/bench_spec.py
    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/make_random_model.py --draft-of /tmp/shuttle-models/llama-110m --layers 2
    .venv/bin/python scripts/dev/bench_spec.py --model /tmp/shuttle-models/llama-110m \
        --draft /tmp/shuttle-models/llama-110m-draft2 --concurrency 1 16 --threads 2 --json /tmp/spec.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle import LLM, SamplingParams  # noqa: E402

PARAGRAPHS = [
    "Tom had a red ball. He liked to play with it in the park. One day the ball went into the pond. Tom was sad.",
    "Lily saw a big tree. She wanted to climb it. Her mom said to be careful. Lily went up and saw the sky.",
    "The cat sat on the mat. It was warm and soft. A dog came and wanted to play. The cat ran away fast.",
    "Ben and Sue went to the shop. They wanted to buy a cake. The man gave them a big cake. They said thank you.",
]
OPENINGS = ["Once upon a time", "One day, a little girl", "Tom was a happy boy who", "The sun was shining and",
            "There was a small dog named", "Lily and her mom went to", "A big bird flew over the", "Sam had a toy car"]
NGRAM_SETTINGS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "ngram k=2": {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}


def workload_prompts(workload: str, count: int) -> list[str]:
    """`count` prompts of `workload`: "copy" (a paragraph twice, then its first words again) or "plain"."""
    if workload == "copy":
        return [f"{p} {p} {' '.join(p.split()[:5 + i % 3])}"
                for i, p in ((i, PARAGRAPHS[i % len(PARAGRAPHS)]) for i in range(count))]
    return [OPENINGS[i % len(OPENINGS)] for i in range(count)]


def spec_counters(llm: LLM) -> tuple[int, int, int]:
    """The LLM's scheduler's (drafts, draft tokens, accepted tokens) counters so far."""
    stats = llm._scheduler.stats()
    return stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens


def timed_round(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int) -> dict[str, Any]:
    """One timed round of generate calls, `concurrency` prompts each: output tokens/s, the spec counters' growth
    and the output token ids."""
    before = spec_counters(llm)
    start = time.perf_counter()
    outputs = [output for i in range(0, len(prompts), concurrency)
               for output in llm.generate(prompts[i:i + concurrency], params, use_tqdm=False)]
    seconds = time.perf_counter() - start
    drafts, drafted, accepted = (b - a for a, b in zip(before, spec_counters(llm)))
    token_ids = [list(output.outputs[0].token_ids) for output in outputs]
    return {"tokens_per_s": sum(map(len, token_ids)) / seconds, "drafts": drafts, "drafted": drafted,
            "accepted": accepted, "token_ids": token_ids}


def main() -> int:
    """Build one LLM per setting, run the interleaved rounds, print the table and write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="/work/shared/models/stories260K")
    parser.add_argument("--draft", default=None, help="a draft model's directory: adds the setting draft k=4")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[16], help="prompts handed over at a time")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", default="bench_spec.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = dict(NGRAM_SETTINGS)
    if args.draft:
        settings["draft k=4"] = {"method": "draft_model", "model": args.draft, "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    workloads = {name: workload_prompts(name, args.prompts) for name in ("copy", "plain")}
    llms: dict[str, LLM] = {}
    for setting, spec in settings.items():
        extra = {"speculative_config": spec} if spec else {}
        llms[setting] = LLM(args.model, max_model_len=512, kv_cache_memory="256MiB",
                            max_num_seqs=max(args.concurrency), **extra)
        torch.set_num_threads(args.threads)
        for prompts in workloads.values():
            llms[setting].generate(prompts[:2], params, use_tqdm=False)  # warm-up
    cases = [(w, c) for w in workloads for c in args.concurrency]
    runs: dict[tuple[str, int, str], list[dict[str, Any]]] = {(w, c, s): [] for w, c in cases for s in settings}
    for _ in range(args.rounds):
        for workload, concurrency in cases:
            for setting, llm in llms.items():
                runs[workload, concurrency, setting].append(timed_round(llm, workloads[workload], params,
                                                                        concurrency))
    mismatch = False
    results: list[dict[str, Any]] = []
    for workload, concurrency in cases:
        reference = runs[workload, concurrency, "off"][0]["token_ids"]
        off_rate = statistics.median(r["tokens_per_s"] for r in runs[workload, concurrency, "off"])
        for setting in settings:
            rounds = runs[workload, concurrency, setting]
            for run in rounds:
                if run["token_ids"] != reference:
                    mismatch = True
                    print(f"MISMATCH: {workload} at {concurrency} {setting} differs from speculation off")
            rate = statistics.median(r["tokens_per_s"] for r in rounds)
            drafts, drafted, accepted = (sum(r[key] for r in rounds) for key in ("drafts", "drafted", "accepted"))
            results.append({"workload": workload, "concurrency": concurrency, "setting": setting,
                            "tokens_per_s": rate, "ratio_vs_off": rate / off_rate,
                            "acceptance_rate": accepted / drafted if drafted else None,
                            "mean_accepted_per_step": accepted / drafts if drafts else None})
    print(f"{'workload':<8} {'conc':>4} {'setting':<10} {'tok/s':>9} {'vs off':>7} {'accept':>7} {'acc/step':>8}")
    for row in results:
        accept, per_step = row["acceptance_rate"], row["mean_accepted_per_step"]
        print(f"{row['workload']:<8} {row['concurrency']:>4} {row['setting']:<10} {row['tokens_per_s']:>9.1f} "
              f"{row['ratio_vs_off']:>6.2f}x {'-' if accept is None else f'{accept:.0%}':>7} "
              f"{'-' if per_step is None else f'{per_step:.2f}':>8}")
    Path(args.json).write_text(json.dumps({"model": args.model, "draft": args.draft, "prompts": args.prompts,
                                           "max_tokens": args.max_tokens, "rounds": args.rounds,
                                           "threads": args.threads, "results": results,
                                           "outputs_match": not mismatch}, indent=2) + "\n")
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
