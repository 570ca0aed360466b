#!/usr/bin/env python3
"""Where one decode step's time goes, next to the bare model forward of the same shape.

For each batch size B, B requests with prompts of --context tokens are prefilled, then --steps decode steps are
timed phase by phase, in one process (a real Scheduler and ModelRunner, the wire encoding done as the sockets
would): plan (schedule), encode/send (msgpack of the plan and the result, both ways), input prep (apply the plan,
pack the tensors), forward (the model with paged attention), sample, apply (settle the result and build the
frontend's outputs). "bare forward" is the same model under transformers' own attention with a dense cache:
B sequences of --context tokens decoding one token each, the cost of the model with no serving engine around it.
"engine overhead" is everything but our forward. With overlapped scheduling, plan and apply run in the scheduler
process while the worker runs the next step, so the worker's own critical path is prep + forward + sample.

    .venv/bin/python scripts/dev/bench_overhead.py --model ../shared/models/stories260K
    .venv/bin/python scripts/dev/bench_overhead.py --model /tmp/shuttle-models/llama-110m --batch 1 16 64

Prints a table (milliseconds per step, medians) and writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import msgspec
import torch
from transformers import AutoModelForCausalLM, DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig  # noqa: E402
from shuttle.common.messages import PlanMessage, StepOutputs, StepResult, Submit, WorkerMessage  # noqa: E402
from shuttle.common.model_config import ModelConfig  # noqa: E402
from shuttle.common.sampling import SamplingParams  # noqa: E402
from shuttle.scheduler.kv_cache import KVCacheManager  # noqa: E402
from shuttle.scheduler.scheduler import Scheduler  # noqa: E402
from shuttle.worker.model_loader import cache_kwargs  # noqa: E402
from shuttle.worker.worker import ModelRunner  # noqa: E402

PHASES = ("plan", "encode/send", "input prep", "forward", "sample", "apply")


class Timed:
    def __init__(self):
        self.times: dict[str, list[float]] = {p: [] for p in PHASES}

    def add(self, phase: str, seconds: float) -> None:
        self.times[phase].append(seconds * 1e3)

    def median(self, phase: str) -> float:
        return statistics.median(self.times[phase])


def run_batch(runner: ModelRunner, model_config: ModelConfig, batch: int, context: int, steps: int,
              profiler=None) -> dict:
    block_size = runner.block_size
    num_blocks = batch * -(-(context + steps + 4) // block_size) + 8
    config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * context))
    scheduler = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=False),
                          model_config.max_model_len, model_config.eos_token_ids)
    assert num_blocks <= runner.kv_cache.num_blocks, "raise --num-kv-blocks"
    vocab = runner.model.get_output_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab, (context,), generator=generator).tolist()
        scheduler.add_request(b"bench", Submit(request_id=f"r{i}", prompt_token_ids=prompt, sampling=params,
                                               arrival_time=float(i)))
    encoder, plan_decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(PlanMessage)
    result_decoder = msgspec.msgpack.Decoder(WorkerMessage)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.requests.values()):
        step = scheduler.schedule()
        scheduler.update_from_output(step, runner.execute(step.plan))
        scheduler.take_outputs()
    timed = Timed()
    with torch.inference_mode(), profiler or contextlib.nullcontext():
        for _ in range(steps):
            t0 = time.perf_counter()
            step = scheduler.schedule()
            t1 = time.perf_counter()
            plan = plan_decoder.decode(encoder.encode(step.plan))
            t2 = time.perf_counter()
            inputs = runner.batch.pack(runner.batch.apply(plan))
            t3 = time.perf_counter()
            logits = runner.forward(inputs, runner.kv_cache.layers, inputs.logits_rows)
            t4 = time.perf_counter()
            requests = inputs.sampled_requests
            sampled = runner.sampler(logits[:len(requests)], [r.sampling for r in requests],
                                     [r.token_ids for r in requests])
            for state, token in zip(requests, sampled.token_ids):
                state.token_ids.append(token)
            result = StepResult(step_id=plan.step_id, request_ids=[r.request_id for r in requests],
                                token_ids=sampled.token_ids)
            t5 = time.perf_counter()
            result = result_decoder.decode(encoder.encode(result))
            t6 = time.perf_counter()
            scheduler.update_from_output(step, result)
            for outputs in scheduler.take_outputs().values():
                encoder.encode(StepOutputs(outputs=outputs, stats=scheduler.stats()))
            t7 = time.perf_counter()
            for phase, seconds in zip(PHASES, (t1 - t0, (t2 - t1) + (t6 - t5), t3 - t2, t4 - t3, t5 - t4, t7 - t6)):
                timed.add(phase, seconds)
    assert len(step.scheduled) == batch
    scheduler.abort(list(scheduler.requests))
    runner.batch.apply(scheduler.schedule().plan)  # the worker forgets them
    return {phase: timed.median(phase) for phase in PHASES}


class _NamedKernel:
    """The decode kernel module, each call recorded as `shuttle::paged_decode` in torch's profiler."""

    def __init__(self, kernel):
        self._kernel = kernel
        self.CACHE_VIEWS = kernel.CACHE_VIEWS  # the backend asks which cache dtypes the kernel reads

    def paged_decode(self, *args):
        with torch.profiler.record_function("shuttle::paged_decode"):
            return self._kernel.paged_decode(*args)


def bare_forward(model, batch: int, context: int, steps: int) -> float:
    """Median ms of one decode step of B sequences with a dense transformers cache of `context` tokens."""
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(3, vocab, (batch, context), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        cache = cache_kwargs(model, DynamicCache(config=model.config))
        out = model(input_ids=ids, **cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(min(steps, 10)):
            start = time.perf_counter()
            out = model(input_ids=token, **cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per request before decoding")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--dtype", default="float32", help="the engine's --dtype (auto, float32, bfloat16, ...); "
                        "the bare forward runs in the same dtype")
    parser.add_argument("--json", type=Path, default=Path("bench_results/bench_overhead.json"))
    parser.add_argument("--torch-profile", action="store_true",
                        help="also print torch.profiler's top operators (self CPU time) of the timed decode steps "
                             "at the largest batch: where the forward's time goes")
    args = parser.parse_args()
    model_config = ModelConfig.from_dir(args.model, dtype=args.dtype)
    block_size = 16
    blocks = max(args.batch) * -(-(args.context + args.steps + 12) // block_size) + 16
    from shuttle.common.config import WorkerConfig
    config = ShuttleConfig(model=model_config, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(block_size, blocks, enable_prefix_caching=False),
                           worker=WorkerConfig(args.attention_backend))
    runner = ModelRunner(config)
    bare_model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa",
                                                      dtype=runner.dtype).eval()
    print(f"model {args.model} ({runner.architecture}, {runner.dtype_label}), context {args.context} tokens, "
          f"attention backend {runner.backend.name}, torch threads {torch.get_num_threads()}; "
          "medians in ms per decode step")
    header = f"{'batch':>6}" + "".join(f"{p:>12}" for p in PHASES) + f"{'step':>10}{'overhead':>10}{'bare fwd':>10}"
    print(header)
    rows = []
    for batch in args.batch:
        phases = run_batch(runner, model_config, batch, args.context, args.steps)
        bare = bare_forward(bare_model, batch, args.context, args.steps)
        step = sum(phases.values())
        overhead = step - phases["forward"]
        rows.append({"batch": batch, **phases, "step": step, "engine_overhead": overhead, "bare_forward": bare})
        print(f"{batch:>6}" + "".join(f"{phases[p]:12.2f}" for p in PHASES)
              + f"{step:10.2f}{overhead:10.2f}{bare:10.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "context": args.context, "backend": runner.backend.name,
                                     "rows": rows}, indent=2))
    print(f"wrote {args.json}")
    if args.torch_profile:
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        kernel = getattr(runner.backend, "_kernel", None)
        if kernel is not None:  # numba is invisible to torch's profiler: name its calls
            runner.backend._kernel = _NamedKernel(kernel)
        run_batch(runner, model_config, max(args.batch), args.context, args.steps, profiler)
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=40))


if __name__ == "__main__":
    main()
