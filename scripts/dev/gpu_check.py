#!/usr/bin/env python3
"""The stages of scripts/gpu_check.sh that run the in-process engine, one per call, and the table of them all.

Each stage runs the real Scheduler and ModelRunner in one process (no sockets, two steps in flight as the worker
sees them) and writes one JSON record {stage, status, summary, ...} to --out-dir/STAGE.json; status is pass, fail or
skipped. On the GPU, gpu_check.sh runs each stage in its own process under its own timeout; the dry run runs them
all in one process, sharing runners, to save start-ups on a small CPU.

    python scripts/dev/gpu_check.py exact --device cuda --model .gpu_carry/models/stories260K --out-dir r/
    python scripts/dev/gpu_check.py exact bf16 compiles graphs --device cpu --dry-run --out-dir r/   # one process
    python scripts/dev/gpu_check.py table r/        # every record in r/ (and r/bench.json) as one table

Stages:
- exact: float32 greedy on the flex backend equal to transformers' generate, token for token (16 prompts).
- bf16: bfloat16 greedy against transformers' bfloat16 generate over 32 prompts: the share of identical
  sequences and the mean common-prefix fraction (passes at a mean prefix fraction of at least BF16_MIN_PREFIX: the
  two differ in rounding, so this gates gross breakage only).
- compiles: dynamo graphs compiled while the same workload runs a second time after a warm-up run, under
  flex_attention.no_recompiles() (must be 0). On a CPU, flex is traced with dynamo's "eager" backend instead of
  inductor, so the tracing and guards are checked but no kernel is generated.
- graphs: greedy with CUDA graphs equal to --enforce-eager (skipped while worker/graph_runner.py is absent).
- spec: float32 greedy with n-gram speculation (k=4) and with a draft model (the test model's first layer) equal to
  greedy without, token for token, on prompts that hold their text twice; and the output tokens/s of n-gram
  speculation against none at concurrency 1 (one prompt at a time), with its acceptance rate.

--dry-run shrinks every stage (fewer prompts and tokens) so the whole check runs on a CPU in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.capacity.story_prompts import MAX_TOKENS, STORY, story_prompts  # noqa: E402
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig  # noqa: E402
from shuttle.common.messages import Submit  # noqa: E402
from shuttle.common.model_config import ModelConfig  # noqa: E402
from shuttle.common.sampling import SamplingParams  # noqa: E402
from shuttle.scheduler.in_process import drive  # noqa: E402
from shuttle.scheduler.kv_cache import KVCacheManager  # noqa: E402
from shuttle.scheduler.scheduler import Scheduler  # noqa: E402

BF16_MIN_PREFIX = 0.5
STAGES = ("exact", "bf16", "compiles", "graphs", "spec", "roofline")
ROOFLINE_AIM = 2.0  # a decode step of the 1B shape at batch 64 within twice its floor (issue 47)
# What each stage leaves out on a CPU (the dry run), said in the table.
CPU_NOTES = {
    "exact": "on the CPU: flex runs eagerly (inductor's Triton kernels need CUDA)",
    "bf16": "on the CPU: flex runs eagerly, a few prompts and tokens",
    "compiles": "on the CPU: traced by dynamo's eager backend (no inductor codegen)",
    "graphs": "on the CPU: the graph runner's plain-call capture (CUDA graph capture needs a GPU)",
    "spec": "on the CPU: stories260K, a few tokens (a step of a model this small is all overhead: no speed-up)",
    "roofline": "on the CPU: a tiny random Llama at batches 1 and 4, float32, the cpu attention backend (its numba "
                "kernel is no torch op: unprofiled); no 8B shape; CPU op times, no launch gaps",
    "bench": "on the CPU: a tiny random Llama (not 1B), cpu attention backend, no continuous batching (it takes "
             "20 s to start on a CPU), no 2x target, memory as the worker's peak RSS",
}


# ---- the in-process engine ------------------------------------------------------------------------------------

def worker_config(backend: str, device: torch.device, **extra) -> WorkerConfig:
    """WorkerConfig with the attention backend, the device and `extra`, each only where the field exists (the
    device and graph fields are being added by others; a field that is missing is left out, not an error)."""
    names = {f.name for f in dataclasses.fields(WorkerConfig)}
    values = {"attention_backend": backend, "device": str(device), **extra}
    return WorkerConfig(**{k: v for k, v in values.items() if k in names})


def make_engine(model_dir: str, dtype: str, device: torch.device, backend: str = "flex", num_blocks: int = 1024,
                prefix_caching: bool = True, max_batched: int = 512, speculative=None, max_num_seqs: int = 32,
                **worker_extra):
    """A fresh Scheduler and a ModelRunner (loaded, start-up exactness check passed) on `device`, at most
    `max_num_seqs` sequences a step (32: CUDA graphs are captured, and flex compiled, for buckets up to 32 only).
    Stages run in one process (the dry run) share a runner of the same dtype and worker settings, its per-request
    state reset."""
    model = ModelConfig.from_dir(model_dir, dtype=dtype)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(16, num_blocks),
                           scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched,
                                                     speculative_config=speculative),
                           worker=worker_config(backend, device, **worker_extra))
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, 16, prefix_caching), model.max_model_len,
                          model.eos_token_ids)
    key = (str(device), config)
    if key not in _RUNNERS:
        from shuttle.worker.worker import ModelRunner

        _RUNNERS[key] = ModelRunner(config, device=device)
    runner = _RUNNERS[key]
    for request_id in list(runner.batch.requests):
        runner.batch.drop(request_id)
    return scheduler, runner


_RUNNERS: dict = {}


def greedy(scheduler, runner, prompts: list[list[int]], max_tokens: list[int], tag: str = "") -> list[list[int]]:
    """Every prompt's greedy output (ignoring end-of-sequence, so lengths are fixed), all submitted at once and
    served with up to two planned steps in flight, as the worker process sees them."""
    outputs = {f"{tag}{i}": [] for i in range(len(prompts))}
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
        scheduler.add_request(b"c", Submit(request_id=f"{tag}{i}", prompt_token_ids=prompt, sampling=params,
                                           arrival_time=time.time()))

    def collect(batch) -> None:
        for out in batch:
            outputs[out.request_id] += out.new_token_ids

    drive(scheduler, runner, collect)
    return [outputs[f"{tag}{i}"] for i in range(len(prompts))]


def hf_greedy(model_dir: str, dtype: str, device: torch.device, prompts, max_tokens) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding), ignoring end-of-sequence."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
    out = []
    with torch.inference_mode():
        for prompt, m in zip(prompts, max_tokens):
            ids = model.generate(torch.tensor([prompt], device=device), max_new_tokens=m, min_new_tokens=m,
                                 do_sample=False, pad_token_id=0)
            out.append(ids[0, len(prompt):].tolist())
    del model
    return out


def prompt_ids(model_dir: str, count: int) -> list[list[int]]:
    """`count` prompts of the test story, tokenized by the model's tokenizer: capacity/story_prompts.py's 16 first, then
    further cuts of the story."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = STORY.split(" ")
    texts = story_prompts() + [" ".join(words[:n]) for n in range(2, 200, 6)]
    return [tokenizer(t)["input_ids"] or [tokenizer.bos_token_id] for t in texts[:count]]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---- stages -----------------------------------------------------------------------------------------------------

def stage_exact(args) -> dict:
    count, cap = (3, 3) if args.dry_run else (16, None)
    prompts = prompt_ids(args.model, count)
    max_tokens = [min(m, cap or m) for m in MAX_TOKENS[:count]]
    scheduler, runner = make_engine(args.model, "float32", args.device, backend=args.backend)
    ours = greedy(scheduler, runner, prompts, max_tokens)
    theirs = hf_greedy(args.model, "float32", args.device, prompts, max_tokens)
    mismatched = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    first = [(i, common_prefix(ours[i], theirs[i])) for i in mismatched]
    return {"status": "fail" if mismatched else "pass",
            "summary": f"{len(prompts) - len(mismatched)}/{len(prompts)} prompts equal transformers' generate "
                       + ("" if args.backend == "flex" else f"with --attention-backend {args.backend} ")
                       + f"({sum(max_tokens)} tokens)"
                       + (f"; first differing token (prompt, index): {first[:4]}" if mismatched else ""),
            "check_difference": runner.check_difference, "mismatched": mismatched}


def stage_bf16(args) -> dict:
    count, tokens = (3, 3) if args.dry_run else (32, 64)
    prompts = prompt_ids(args.model, count)
    max_tokens = [tokens] * count
    scheduler, runner = make_engine(args.model, "bfloat16", args.device, backend="flex")
    ours = greedy(scheduler, runner, prompts, max_tokens)
    theirs = hf_greedy(args.model, "bfloat16", args.device, prompts, max_tokens)
    identical = sum(a == b for a, b in zip(ours, theirs)) / count
    prefix = sum(common_prefix(a, b) / tokens for a, b in zip(ours, theirs)) / count
    return {"status": "pass" if prefix >= BF16_MIN_PREFIX else "fail",
            "summary": f"{count} prompts x {tokens} tokens: identical {100 * identical:.0f}%, mean common prefix "
                       f"{100 * prefix:.0f}% (gate >= {100 * BF16_MIN_PREFIX:.0f}%)",
            "identical_share": identical, "mean_prefix_fraction": prefix}


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def stage_compiles(args) -> dict:
    from shuttle.worker import flex_attention as fx

    count, tokens = (2, 3) if args.dry_run else (24, 48)
    prompts = prompt_ids(args.model, count)
    max_tokens = [tokens] * count
    dtype = "float32" if args.device.type == "cpu" else "bfloat16"
    scheduler, runner = make_engine(args.model, dtype, args.device, backend="flex", prefix_caching=False)
    how, own_backend = "inductor", runner.backend
    if args.device.type == "cpu":  # eager flex traces nothing; dynamo's eager backend checks guards without codegen
        runner.backend = fx.FlexBackend(runner.block_size, args.device, compile_backend="eager",
                                        max_blocks_per_seq=own_backend.max_blocks_per_seq)
        # as at start-up, up to the most prefill tokens this workload can put in one step (tracing is slow here)
        max_model_len = own_backend.max_blocks_per_seq * runner.block_size
        runner.warm_up_prefill_shapes(min(512, sum(map(len, prompts))), max_model_len)
        how = "dynamo eager backend (CPU: decode shapes compile in the first run, not in a graph capture)"
    try:
        return _count_compiles(scheduler, runner, prompts, max_tokens, how)
    finally:
        runner.backend = own_backend


def _count_compiles(scheduler, runner, prompts, max_tokens, how: str) -> dict:
    """Graphs compiled while the workload runs once after start-up (on CUDA, where start-up compiled every prefill
    bucket and graph capture every decode one, must be 0) and once more under no_recompiles() (must be 0)."""
    from shuttle.worker import flex_attention as fx

    start = _unique_graphs()
    warm = greedy(scheduler, runner, prompts, max_tokens, tag="w")
    after_warm = _unique_graphs()
    try:
        with fx.no_recompiles():
            again = greedy(scheduler, runner, prompts, max_tokens, tag="m")  # the same steps again
        error = ""
    except Exception as exc:  # a recompile raises under no_recompiles: that is the failure this stage looks for
        again, error = None, f"{type(exc).__name__}: {exc}"[:300]
    after = _unique_graphs()
    compiled, first = after - after_warm, after_warm - start
    on_cpu = runner.device.type == "cpu"
    status = "pass" if compiled == 0 and (on_cpu or first == 0) and not error and again == warm else "fail"
    summary = (f"{first} graphs compiled in the first run after start-up{'' if on_cpu else ' (gate 0)'}, "
               f"{compiled} in the second; start-up warm-up {runner.warm_up_seconds:.1f} s ({how})"
               + (f"; {error}" if error else "")
               + ("; second run's tokens differ" if again not in (None, warm) else ""))
    return {"status": status, "summary": summary, "first_run_graphs": first, "second_run_graphs": compiled,
            "warm_up_seconds": runner.warm_up_seconds}


def stage_graphs(args) -> dict:
    if importlib.util.find_spec("shuttle.worker.graph_runner") is None:
        return {"status": "skipped", "summary": "skipped: no graph runner (worker/graph_runner.py is absent)"}
    if "enforce_eager" not in {f.name for f in dataclasses.fields(WorkerConfig)}:
        return {"status": "skipped", "summary": "skipped: WorkerConfig has no enforce_eager field"}
    count, tokens = (2, 3) if args.dry_run else (24, 48)
    prompts = prompt_ids(args.model, count)
    max_tokens = [tokens] * count
    dtype = "float32" if args.device.type == "cpu" else "bfloat16"
    outputs = {}
    for eager in (True, False):
        scheduler, runner = make_engine(args.model, dtype, args.device, backend="flex", enforce_eager=eager)
        outputs[eager] = greedy(scheduler, runner, prompts, max_tokens)
    differing = [i for i in range(count) if outputs[True][i] != outputs[False][i]]
    how = "CUDA graphs" if args.device.type == "cuda" else "the graph runner's plain-call capture (CPU)"
    return {"status": "fail" if differing else "pass",
            "summary": f"{count - len(differing)}/{count} sequences ({dtype}) equal with {how} and --enforce-eager",
            "differing": differing}


def stage_spec(args) -> dict:
    from scripts.dev.make_random_model import truncate_model
    from shuttle.common.speculative import SpeculativeConfig

    count, tokens = (2, 6) if args.dry_run else (8, 96)
    prompts = [p + p[1:] for p in prompt_ids(args.model, count)]  # its text twice: the output may copy it
    max_tokens = [tokens] * count
    draft_dir = Path(tempfile.mkdtemp(prefix="shuttle-spec-draft-"))  # not under --out-dir: what comes back
    try:
        truncate_model(Path(args.model), draft_dir, 1)
        settings = {"off": None,
                    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_max=4,
                                               prompt_lookup_min=2),
                    "draft": SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model=str(draft_dir))}
        outputs, seconds, stats = {}, {}, {}
        for name, spec in settings.items():
            scheduler, runner = make_engine(args.model, "float32", args.device, speculative=spec)
            outputs[name] = greedy(scheduler, runner, prompts, max_tokens, tag="all")
            if name != "draft":  # concurrency 1, after the batched run warmed every shape up
                began = time.perf_counter()
                for i, prompt in enumerate(prompts):
                    greedy(scheduler, runner, [prompt], [tokens], tag=f"one{i}-")
                if args.device.type == "cuda":
                    torch.cuda.synchronize()
                seconds[name] = time.perf_counter() - began
            stats[name] = scheduler.stats()
        differing = {name: [i for i in range(count) if outputs[name][i] != outputs["off"][i]]
                     for name in ("ngram", "draft")}
        ratio = seconds["off"] / seconds["ngram"]
        drafted = stats["ngram"].spec_num_draft_tokens
        acceptance = stats["ngram"].spec_num_accepted_tokens / drafted if drafted else 0.0
        draft_drafted = stats["draft"].spec_num_draft_tokens
        draft_acceptance = stats["draft"].spec_num_accepted_tokens / draft_drafted if draft_drafted else 0.0
        failed = any(differing.values())
        return {"status": "fail" if failed else "pass",
                "summary": f"{count} prompts x {tokens} tokens equal without speculation: ngram "
                           f"{count - len(differing['ngram'])}/{count}, draft model "
                           f"{count - len(differing['draft'])}/{count} (acceptance {100 * draft_acceptance:.0f}%); "
                           f"ngram at concurrency 1: {ratio:.2f}x the tokens/s of none, acceptance "
                           f"{100 * acceptance:.0f}%",
                "differing": differing, "ngram_speedup_c1": ratio, "ngram_acceptance": acceptance,
                "draft_acceptance": draft_acceptance}
    finally:
        shutil.rmtree(draft_dir, ignore_errors=True)


def stage_roofline(args) -> dict:
    from scripts.dev.roofline import roofline, summary_line

    models = args.roofline_models or [args.model]
    batches, steps, dtype = ([1, 4], 4, "float32") if args.dry_run else ([1, 16, 64, 256], 16, "bfloat16")
    result = roofline(models, args.device, dtype, batches, steps)
    aimed = [r for r in result["rows"] if r["model"] == Path(models[0]).name and r["batch"] == 64]
    aim = "" if not aimed else (f"; the aim (1B at batch 64 within {ROOFLINE_AIM:g}x its floor) "
                                f"{'holds' if aimed[0]['ratio'] <= ROOFLINE_AIM else 'is missed'}")
    return {"status": "pass", "summary": summary_line(result) + aim, **result}


# ---- the table --------------------------------------------------------------------------------------------------

def _fmt(value, digits=1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(results_dir: Path) -> int:
    """Print every stage record and the bench rows as one table. Returns 1 if a stage failed or is missing."""
    records = []
    failed = False
    for name in (*STAGES, "bench"):
        path = results_dir / f"{name}.json"
        if name == "bench":
            continue
        record = json.loads(path.read_text()) if path.exists() else {
            "stage": name, "status": "fail", "summary": "no result (the stage crashed or timed out: see its log)"}
        failed |= record["status"] == "fail"
        records.append(record)
    bench = results_dir / "bench.json"
    bench_record = json.loads(bench.read_text()) if bench.exists() else None
    status_of_bench = (bench_record or {}).get("status", "fail")
    failed |= status_of_bench == "fail"
    device = records[0].get("device", "?") if records else "?"
    print(f"\nshuttle GPU check ({'dry run, ' if any(r.get('dry_run') for r in records) else ''}device {device})")
    print(f"{'stage':<10}{'status':<9}summary")
    for r in records:
        print(f"{r['stage']:<10}{r['status']:<9}{r['summary']}")
        if r.get("device") == "cpu" and r["stage"] in CPU_NOTES:
            print(f"{'':<19}({CPU_NOTES[r['stage']]})")
    if bench_record is None:
        print(f"{'bench':<10}{'fail':<9}no result (bench_compare.py crashed or timed out: see bench.log)")
        return 1
    print(f"{'bench':<10}{status_of_bench:<9}{bench_record.get('summary', '')}")
    if device == "cpu":
        print(f"{'':<19}({CPU_NOTES['bench']})")
    rows = bench_record.get("rows", [])
    if rows:
        print(f"\n{'method':<36}{'out tok/s':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}"
              f"{'peak mem':>10}{'shuttle x':>10}   (times in ms, memory in MiB)")
        for row in rows:
            print(f"{row['method']:<36}{_fmt(row.get('output_tok_per_s')):>10}{_fmt(row.get('ttft_p50_ms')):>10}"
                  f"{_fmt(row.get('ttft_p99_ms')):>10}{_fmt(row.get('itl_p50_ms'), 2):>9}"
                  f"{_fmt(row.get('itl_p99_ms'), 2):>9}{_fmt(row.get('peak_memory_mib'), 0):>10}"
                  f"{_fmt(row.get('shuttle_throughput_ratio'), 2):>10}")
        for row in rows:
            if row.get("note"):
                print(f"  {row['method']}: {row['note']}")
    extra = bench_record.get("engine", {})
    if extra:
        print("\n" + "; ".join(f"{k} {_fmt(v, 2)}" for k, v in extra.items()))
    return 1 if failed else 0


def print_versions() -> None:
    """One line of the library versions this process runs the stages with, for the log: a GPU machine brings its
    own torch, triton and transformers (on a GPU each stage is its own process, so the line repeats per stage)."""
    import msgspec
    import transformers
    import zmq
    print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "transformers", transformers.__version__,
          "pyzmq", zmq.__version__, "msgspec", msgspec.__version__, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="+", help=f"one or more of {', '.join(STAGES)} (run in turn, in one process), "
                                                  "or `table FOLDER`")
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny workloads, for a CPU")
    parser.add_argument("--backend", default="flex", help="the exact stage's attention backend (the others: flex)")
    parser.add_argument("--out-dir", type=Path, help="where each stage's record goes, as STAGE.json")
    parser.add_argument("--roofline-models", nargs="+", help="the roofline stage's model directories (default "
                                                             "--model), the first one profiled")
    args = parser.parse_args()
    if args.stages[0] == "table":
        if len(args.stages) != 2:
            parser.error("table takes one results folder")
        return print_table(Path(args.stages[1]))
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(sorted(unknown))}; choose from {', '.join(STAGES)}")
    args.device = torch.device(args.device)
    print_versions()
    failed = False
    for name in args.stages:
        began = time.perf_counter()
        try:
            record = globals()[f"stage_{name}"](args)
        except Exception as exc:
            traceback.print_exc()
            record = {"status": "fail", "summary": f"raised {type(exc).__name__}: {exc}"[:300]}
        record = {"stage": name, "device": str(args.device), "dry_run": args.dry_run,
                  "seconds": round(time.perf_counter() - began, 1), **record}
        print(f"{name}: {record['status']}: {record['summary']} ({record['seconds']} s)", flush=True)
        failed |= record["status"] == "fail"
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / f"{name}.json").write_text(json.dumps(record, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
