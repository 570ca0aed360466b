#!/usr/bin/env python3
"""What serving LoRA adapters costs: the same greedy workload for the base model alone and for 4 adapters plus the
base model mixed in one batch (requests round-robin over "", a0 .. a3; --max-loras 4), in process with the real
Scheduler and ModelRunner (no server), interleaved rounds.

The adapters are random PEFT adapters of --rank on all seven target modules (q/k/v/o, gate/up/down), written to a
temporary folder. Prints output tokens/s of each setting, the ratio mixed / base alone, and writes JSON. Figures
are ratios from one run on a quiet machine; the absolute times depend on the host.

    .venv/bin/python scripts/dev/make_random_model.py --shape 110m --out /tmp/shuttle-models/llama-110m
    .venv/bin/python scripts/dev/bench_lora.py --model /tmp/shuttle-models/llama-110m --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig  # noqa: E402
from shuttle.common.lora import TARGET_MODULES, LoRAConfig, LoRAModule  # noqa: E402
from shuttle.common.messages import Submit  # noqa: E402
from shuttle.common.model_config import ModelConfig  # noqa: E402
from shuttle.common.sampling import SamplingParams  # noqa: E402
from shuttle.scheduler.in_process import drive  # noqa: E402
from shuttle.scheduler.kv_cache import KVCacheManager  # noqa: E402
from shuttle.scheduler.lora_slots import lora_slots_for  # noqa: E402
from shuttle.scheduler.scheduler import Scheduler  # noqa: E402
from shuttle.worker.worker import ModelRunner  # noqa: E402


def write_adapters(model: torch.nn.Module, folder: Path, count: int, rank: int) -> list[LoRAModule]:
    """`count` random adapters of `rank` on every target module of `model`."""
    modules = []
    for i in range(count):
        generator = torch.Generator().manual_seed(i)
        tensors = {}
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in TARGET_MODULES:
                linear = getattr(module, "base", module)
                out_features, in_features = linear.weight.shape
                tensors[f"base_model.model.{name}.lora_A.weight"] = torch.randn(rank, in_features,
                                                                                generator=generator) * 0.01
                tensors[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_features, rank,
                                                                                generator=generator) * 0.01
        directory = folder / f"a{i}"
        directory.mkdir()
        save_file(tensors, str(directory / "adapter_model.safetensors"))
        (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank,
                                                                   "lora_alpha": 2 * rank,
                                                                   "target_modules": sorted(TARGET_MODULES)}))
        modules.append(LoRAModule(name=f"a{i}", path=str(directory)))
    return modules


def timed(runner: ModelRunner, config: ShuttleConfig, prompts: list[list[int]], adapters: list[str],
          max_tokens: int) -> float:
    """Output tokens/s of one run of every prompt (with its adapter), all submitted at once."""
    for request_id in list(runner.batch.requests):
        runner.batch.drop(request_id)
    model = config.model
    scheduler = Scheduler(config.scheduler, KVCacheManager(runner.kv_cache.num_blocks, config.cache.block_size),
                          model.max_model_len, (), lora=lora_slots_for(config.lora))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    paths = {m.name: m.path for m in config.lora.lora_modules}
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=params,
                                           arrival_time=float(i), lora_name=adapter, lora_path=paths.get(adapter, "")))
    produced = 0

    def collect(batch) -> None:
        nonlocal produced
        for out in batch:
            if out.error_status:
                raise RuntimeError(out.error_message)
            produced += len(out.new_token_ids)

    start = time.perf_counter()
    drive(scheduler, runner, collect)
    return produced / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"))
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16, help="--max-num-seqs")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="bench_lora.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(32, 128, (args.requests,), generator=generator)]
    with tempfile.TemporaryDirectory() as folder:
        model = ModelConfig.from_dir(args.model, max_model_len=512)
        base = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                             cache=CacheConfig(16, None, kv_cache_memory=512 * 2**20),
                             scheduler=SchedulerConfig(max_num_seqs=args.concurrency))
        plain_runner = ModelRunner(base)
        modules = write_adapters(plain_runner.model, Path(folder), 4, args.rank)
        lora = LoRAConfig(enable_lora=True, max_loras=4, max_lora_rank=args.rank, lora_modules=tuple(modules))
        with_lora = dataclasses.replace(base, lora=lora)
        lora_runner = ModelRunner(with_lora)
        torch.set_num_threads(args.threads)
        mixed = [("", "a0", "a1", "a2", "a3")[i % 5] for i in range(args.requests)]
        settings = {"base alone": (plain_runner, base, [""] * args.requests),
                    "base alone, --enable-lora": (lora_runner, with_lora, [""] * args.requests),
                    "4 adapters + base": (lora_runner, with_lora, mixed)}
        for runner, config, adapters in settings.values():  # warm-up
            timed(runner, config, prompts[:4], adapters[:4], 4)
        rates: dict[str, list[float]] = {name: [] for name in settings}
        for _ in range(args.rounds):
            for name, (runner, config, adapters) in settings.items():
                rates[name].append(timed(runner, config, prompts, adapters, args.max_tokens))
    base_rate = statistics.median(rates["base alone"])
    rows = [{"setting": name, "tokens_per_s": statistics.median(r), "ratio": statistics.median(r) / base_rate}
            for name, r in rates.items()]
    print(f"{'setting':<28} {'tok/s':>9} {'vs base':>8}")
    for row in rows:
        print(f"{row['setting']:<28} {row['tokens_per_s']:>9.1f} {row['ratio']:>7.2f}x")
    Path(args.json).write_text(json.dumps({"model": args.model, "requests": args.requests,
                                           "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                                           "rank": args.rank, "rounds": args.rounds, "threads": args.threads,
                                           "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
