#!/usr/bin/env python3
"""Which model architectures shuttle serves exactly: every causal-LM architecture of the installed transformers,
as a tiny randomly initialised model, run through shuttle's scheduler and worker in one process and compared
with transformers' own greedy `generate` under eager attention in float32.

An architecture is "exact" when every prompt's greedy tokens equal transformers' under the default step budget
and under `--max-num-batched-tokens 8` (chunked prefill), with two steps in flight, and the sampled tokens'
logprobs are within 1e-4; "refused" when shuttle's start-up check (worker/capability.py) turns it away, with
its reason; "WRONG" or "ERROR" would be shuttle bugs (a model that starts and then serves wrong text or fails);
"n/a" when transformers itself cannot build the tiny model. Attention features are exercised where a config
has them: sliding windows are set to 8 tokens (prompts are longer), Gemma 2's attention soft-cap to 1.

    .venv/bin/python scripts/dev/check_architectures.py                      # all, prints the table, writes JSON
    .venv/bin/python scripts/dev/check_architectures.py llama mistral gpt2    # some
    .venv/bin/python scripts/dev/check_architectures.py --update-readme       # rewrite README's table
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import multiprocessing
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig  # noqa: E402
from shuttle.common.messages import Submit  # noqa: E402
from shuttle.common.model_config import ModelConfig  # noqa: E402
from shuttle.common.sampling import SamplingParams  # noqa: E402
from shuttle.scheduler.in_process import drive  # noqa: E402
from shuttle.scheduler.kv_cache import KVCacheManager  # noqa: E402
from shuttle.scheduler.scheduler import Scheduler  # noqa: E402
from shuttle.worker.model_loader import UnsupportedModelError  # noqa: E402
from shuttle.worker.worker import ModelRunner  # noqa: E402

VOCAB = 512
WINDOW = 8
LOGPROB_TOLERANCE = 1e-4
PROMPT_LENGTHS = (5, 19, 37)
MAX_TOKENS = 12
BUDGETS = (2048, 8)
MAX_PARAMETERS = 40_000_000
ONE_TIMEOUT_S = 300
README_START, README_END = "<!-- architectures:start -->", "<!-- architectures:end -->"

# A tiny shape every architecture understands (configs map standard names to their own via attribute_map).
TINY = {
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": VOCAB, "max_position_embeddings": 256,
    "n_positions": 256, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "initializer_range": 0.2,
    "tie_word_embeddings": False,
}
FEATURES = {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0}

# Variants the acceptance names, besides every model type with the tiny shape above.
VARIANTS = {
    "llama-gqa": ("llama", {}),
    "mistral-window8": ("mistral", {"sliding_window": WINDOW}),
    "gemma2-softcap1": ("gemma2", {"attn_logit_softcapping": 1.0, "sliding_window": WINDOW}),
}


@dataclass
class Result:
    name: str
    status: str  # exact | refused | WRONG | ERROR | n/a
    detail: str = ""
    logprob_error: float = 0.0
    seconds: float = 0.0


def tiny_config(model_type: str, extra: dict | None = None):
    """A small config of `model_type`: TINY and FEATURES for the fields its config class has, then `extra`."""
    default = AutoConfig.for_model(model_type)
    text = getattr(default, "text_config", None)
    target = text if text is not None and hasattr(text, "hidden_size") else default
    known = set(target.to_dict()) | set(getattr(target, "attribute_map", {}))
    kwargs = {k: v for k, v in {**TINY, **FEATURES}.items() if k in known}
    if "qk_rope_head_dim" in known:
        kwargs.pop("head_dim", None)  # multi-head latent attention derives its head dims from the q/k/v ones
        kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", 4)  # and has no grouped KV heads
    if "sliding_window" in kwargs and getattr(target, "sliding_window", None) is None and model_type != "mistral":
        kwargs.pop("sliding_window")  # a config without a window by default: leave it off
    layers = kwargs.get("num_hidden_layers")
    settable = not isinstance(getattr(type(target), "layer_types", None), property)
    if layers and settable and isinstance(getattr(target, "layer_types", None), list):
        # one layer of each kind the full model has (attention, sliding, convolution, ...), so hybrids stay hybrid
        kinds = list(dict.fromkeys(target.layer_types))
        kwargs["num_hidden_layers"] = layers = max(layers, len(kinds))
        kwargs["layer_types"] = (kinds * layers)[:layers]
    if layers and isinstance(getattr(target, "per_layer_config", None), dict):
        kwargs["per_layer_config"] = {k: v for k, v in target.per_layer_config.items() if int(k) < layers}
    kwargs.update(extra or {})
    if target is default:
        return AutoConfig.for_model(model_type, **kwargs)
    return AutoConfig.for_model(model_type, text_config={**text.to_dict(), **kwargs})


def build_model_dir(model_type: str, directory: Path, extra: dict | None = None) -> None:
    """Save a seeded random model of `model_type` (float32, eager-ready) to `directory`."""
    config = tiny_config(model_type, extra)
    with torch.device("meta"):  # count first: a config whose sub-configs stay large is not worth building
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still has {size / 1e6:.0f}M parameters (sub-configs this script does not "
                         f"shrink)")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)


def in_process_outputs(model_dir: Path, prompts: list[list[int]], budget: int) -> tuple[list[list[int]],
                                                                                        list[list[float]]]:
    """Greedy tokens and their logprobs from shuttle's Scheduler and ModelRunner in one process, two steps in
    flight, as the scheduler loop drives the worker."""
    model = ModelConfig.from_dir(model_dir, max_model_len=128)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"), cache=CacheConfig(4, 256),
                           scheduler=SchedulerConfig(max_num_batched_tokens=budget))
    runner = ModelRunner(config)
    scheduler = Scheduler(config.scheduler, KVCacheManager(256, 4), model.max_model_len, ())
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=params,
                                           arrival_time=float(i)))
    tokens = {str(i): [] for i in range(len(prompts))}
    logprobs = {str(i): [] for i in range(len(prompts))}

    def collect(batch) -> None:
        for out in batch:
            if out.error_status:
                raise RuntimeError(f"request failed: {out.error_message}")
            tokens[out.request_id] += out.new_token_ids
            logprobs[out.request_id] += [lp.logprob for lp in out.logprobs]

    drive(scheduler, runner, collect)
    return [tokens[str(i)] for i in range(len(prompts))], [logprobs[str(i)] for i in range(len(prompts))]


def reference_outputs(model_dir: Path, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    tokens, logprobs = [], []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, eos_token_id=None,
                                 pad_token_id=0)
            new = out.sequences[0, len(prompt):].tolist()
            tokens.append(new)
            logprobs.append([float(step[0].float().log_softmax(-1)[t]) for step, t in zip(out.logits, new)])
    return tokens, logprobs


def check(name: str, model_type: str, extra: dict | None = None) -> Result:
    """Build, serve in process, compare. Never raises.

    shuttle runs first: a model it refuses at start-up is "refused" whether or not transformers can generate with
    it (hybrid models whose tiny variant has no attention layer at all, for instance)."""
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, VOCAB, (n - 1,), generator=generator).tolist() for n in PROMPT_LENGTHS]
    with tempfile.TemporaryDirectory(prefix=f"shuttle-arch-{model_type}-") as tmp:
        directory = Path(tmp)
        try:
            with _quiet():
                build_model_dir(model_type, directory, extra)
        except Exception as exc:
            return Result(name, "n/a", f"transformers cannot build it: {_first_line(exc)}",
                          seconds=time.perf_counter() - start)
        try:
            runs = []
            for budget in BUDGETS:
                with _quiet():
                    runs.append((budget, *in_process_outputs(directory, prompts, budget)))
        except UnsupportedModelError as exc:
            return Result(name, "refused", str(exc), seconds=time.perf_counter() - start)
        except Exception as exc:
            return Result(name, "ERROR", _first_line(exc), seconds=time.perf_counter() - start)
        try:
            with _quiet():
                want, want_logprobs = reference_outputs(directory, prompts)
        except Exception as exc:
            return Result(name, "n/a",
                          f"shuttle serves it, but transformers' generate fails on it, so it is unchecked: "
                                       f"{_first_line(exc)}", seconds=time.perf_counter() - start)
    worst = 0.0
    for budget, got, got_logprobs in runs:
        if got != want:
            bad = sum(g != w for g, w in zip(got, want))
            return Result(name, "WRONG", f"{bad}/{len(prompts)} prompts differ (budget {budget})",
                          seconds=time.perf_counter() - start)
        for g, w in zip(got_logprobs, want_logprobs):
            worst = max([worst] + [abs(a - b) for a, b in zip(g, w)])
    status = "exact" if worst < LOGPROB_TOLERANCE else "WRONG"
    detail = "" if status == "exact" else f"logprobs differ by {worst:.2g}"
    return Result(name, status, detail, worst, time.perf_counter() - start)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:160]}" if text else type(exc).__name__


@contextlib.contextmanager
def _quiet():
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        yield


def targets(names: list[str]) -> list[tuple[str, str, dict]]:
    everything = [(name, model_type, extra) for name, (model_type, extra) in VARIANTS.items()]
    everything += [(t, t, {}) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) if t not in ("llama",)]
    if not names:
        return everything
    chosen = [t for t in everything if t[0] in names]
    missing = set(names) - {t[0] for t in chosen}
    chosen += [(name, name, {}) for name in sorted(missing)]
    return chosen


def check_in_subprocess(name: str) -> Result:
    """One architecture in its own process, so a crash, a hang or a memory blow-up costs only its own row."""
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True,
                              timeout=ONE_TIMEOUT_S, cwd=REPO)
    except subprocess.TimeoutExpired:
        return Result(name, "ERROR", f"no answer within {ONE_TIMEOUT_S} s", seconds=time.perf_counter() - start)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return Result(name, "ERROR", f"check process exited {proc.returncode}: {tail[:160]}",
                      seconds=time.perf_counter() - start)
    return Result(**json.loads(lines[-1]))


def check_in_fork(name: str) -> Result:
    """One architecture in a forked child of this process, which has imported torch and transformers already (a
    fresh interpreter spends most of a check importing them); a crash or a hang still costs only its own row."""
    start = time.perf_counter()
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    proc = context.Process(target=_check_and_send, args=(name, sender))
    proc.start()
    sender.close()
    try:
        if not receiver.poll(ONE_TIMEOUT_S):
            return Result(name, "ERROR", f"no answer within {ONE_TIMEOUT_S} s", seconds=time.perf_counter() - start)
        return Result(**receiver.recv())
    except EOFError:
        proc.join()
        return Result(name, "ERROR", f"check process exited {proc.exitcode}", seconds=time.perf_counter() - start)
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()


def _check_and_send(name: str, sender) -> None:
    _, model_type, extra = targets([name])[0]
    sender.send(check(name, model_type, extra).__dict__)


def markdown(results: list[Result]) -> str:
    lines = ["| architecture | result | detail |", "|---|---|---|"]
    for r in results:
        lines.append(f"| {r.name} | {r.status} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="model types or variant names (default: all)")
    parser.add_argument("--json", type=Path, default=Path("bench_results/architectures.json"))
    parser.add_argument("--update-readme", action="store_true", help="rewrite the table in docs/architectures.md")
    parser.add_argument("--jobs", type=int, default=2, help="checks run at once, each in its own process")
    parser.add_argument("--fresh-interpreters", action="store_true",
                        help="run each check in a new Python process instead of a fork of this one (slower)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # run one check and print it as JSON (the subprocess)
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    if args.one:
        name, model_type, extra = targets([args.one])[0]
        print(json.dumps(check(name, model_type, extra).__dict__))
        return 0
    chosen = targets(args.names)
    if len(chosen) == 1:
        runs = iter([check(*chosen[0])])
    else:  # the checks are subprocesses, so threads are enough to run --jobs of them at once (in order)
        one = check_in_subprocess if args.fresh_interpreters else check_in_fork
        runs = ThreadPoolExecutor(max(1, args.jobs)).map(one, [name for name, _, _ in chosen])
    results = []
    for (name, _, _), result in zip(chosen, runs):
        results.append(result)
        print(f"{name:<28}{result.status:<9}{result.seconds:6.1f}s  {result.detail}", flush=True)
    counts = {s: sum(r.status == s for r in results) for s in ("exact", "refused", "WRONG", "ERROR", "n/a")}
    print("; ".join(f"{v} {k}" for k, v in counts.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    if args.update_readme:
        readme = REPO / "docs" / "architectures.md"
        text = readme.read_text()
        table = f"{README_START}\n{markdown(results)}\n{README_END}"
        text = re.sub(re.escape(README_START) + ".*?" + re.escape(README_END), lambda _: table, text, flags=re.S)
        readme.write_text(text)
    return 1 if counts["WRONG"] or counts["ERROR"] else 0


if __name__ == "__main__":
    sys.exit(main())
