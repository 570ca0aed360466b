"""Measure the real ModelRunner on a grid of step shapes and fit the step-cost model (scheduler/step_cost.py).

Each configuration is driven by a real Scheduler (no prefix caching) exactly as scripts/dev/bench_overhead.py does:
requests are prefilled in chunks, then decode steps run; every step goes through the worker's critical path as in
the server (plan decoded from msgpack, applied, packed, forward, sample, result encoded) and is timed whole, so the
engine's per-step overhead is part of what is fitted. The scheduler's own time per step (plan + settle) is
measured alongside and fitted as `scheduler_s` per step plus `scheduler_sequence_s` per sequence. Per configuration the
median step is fitted (a loaded machine
throws outliers), and how far each step lies from its configuration's median is kept as the profile's `spread`,
which the simulator draws step times from. The device's peaks are measured first (capacity/hardware.py), and the
roofline's corrections are
fitted by non-negative least squares on relative error.

`shuttle calibrate` (main) runs the grid on the machine it is on, prints each measurement next to its fit and writes
the JSON profile that `shuttle serve --step-cost-profile`, `shuttle simulate` and `shuttle tune` read:

    shuttle calibrate --model ../shared/models/stories260K --out profiles/stories260K.json

Nothing here is fitted to a full server: the profile describes the worker's steps, which is what carries over to
the machine a user serves on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from dataclasses import dataclass

import msgspec
import torch

from shuttle.capacity import hardware, simulate
from shuttle.capacity.simulator import RequestRecord, SimResult
from shuttle.capacity.workload import SimRequest
from shuttle.common.arg_types import add_config_options, output_file, positive
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.devices import DeviceError, cuda_device_count, resolve_config
from shuttle.common.messages import PlanMessage, StepPlan, StepResult, Submit, WorkerMessage
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduled_step import ScheduledStep
from shuttle.scheduler.scheduler import Scheduler
from shuttle.scheduler.step_cost import FEATURES, StepCostModel, StepShape, fit_scheduler_seconds, shape_of, spread_of
from shuttle.worker.kv_sizing import KVSizingError
from shuttle.worker.model_loader import UnsupportedModelError
from shuttle.worker.worker import ModelRunner

MAX_PREFILL_TOKENS = 16384  # a decode configuration first prefills batch x context tokens: keep that affordable


@dataclass
class InProcessRun:
    """A workload served in process: what each request saw, and each step's shape and measured seconds."""

    result: SimResult
    steps: list[tuple[StepShape, float]]


@dataclass
class Measurement:
    """One configuration's median step: its shape, seconds, and the scheduler's seconds for it; `samples`: every
    step's seconds it is the median of (the spread of steps of one shape on this machine)."""

    label: str
    shape: StepShape
    seconds: float
    scheduler_seconds: float
    samples: tuple[float, ...] = ()


def grid(max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> list[tuple[str, int, int, int]]:
    """(kind, batch, prompt_len, chunk) configurations spanning the shapes a server meets: decode batches over
    contexts, prefill chunks of growing size, and single-token prefills."""
    contexts = sorted({c for c in (16, 128, 512, 2048) if c < max_model_len - 8} | {max(8, max_model_len // 2)})
    batches = sorted({b for b in (1, 4, 16, 32, 64, 128) if b <= max_num_seqs} | {min(max_num_seqs, 8)})
    configs = [("decode", b, c, 0) for b in batches for c in contexts if b * c <= MAX_PREFILL_TOKENS]
    chunks = sorted({q for q in (16, 64, 256, 1024, 2048) if q <= max_num_batched_tokens} | {max_num_batched_tokens})
    configs += [("prefill", 1, min(max_model_len - 8, 4 * q), q) for q in chunks]
    # several prompts filling the whole budget at once: the steps behind the first TTFTs of a burst, whose
    # attention a single long prompt's chunks do not span
    shared = sorted({q for q in chunks if 4 * q <= max_num_batched_tokens} | {max(1, max_num_batched_tokens // 4)})
    configs += [("prefill", 4, min(max_model_len - 8, q), q) for q in shared]
    # and eight: a burst's first step packs as many prompts as fit, and the full budget is where a token costs most
    eighth = max(1, max_num_batched_tokens // 8)
    configs.append(("prefill", 8, min(max_model_len - 8, eighth), eighth))
    # mixed steps, decodes beside a prompt's chunk: under load most steps of a chunked-prefill server are these
    context = min(128, max(8, max_model_len // 4))
    configs += [("mixed", b, context, q) for b in sorted({min(max_num_seqs - 1, b) for b in (8, 32, 64)} - {0})
                for q in sorted({min(q, max_num_batched_tokens - b) for q in (64, 256)}) if q > 1]
    return configs


class Calibrator:
    """Owns one ModelRunner with a KV cache large enough for the grid.

    Args:
        model_dir: Hugging Face model directory.
        dtype: weights and KV dtype.
        max_model_len: None for the model's limit.
        block_size: tokens per KV block.
        attention_backend: as `shuttle serve --attention-backend`.
    """

    def __init__(self, model_dir: str, dtype: str = "float32", max_model_len: int | None = None,
                 block_size: int = 16, attention_backend: str = "auto", num_kv_blocks: int = 0):
        self.model_config = ModelConfig.from_dir(model_dir, max_model_len, dtype=dtype)
        self.block_size = block_size
        blocks = num_kv_blocks or 128 * -(-min(self.model_config.max_model_len, 2048) // block_size) + 16
        config = ShuttleConfig(model=self.model_config, ipc=IpcConfig.in_directory("/nonexistent"),
                               cache=CacheConfig(block_size, blocks, enable_prefix_caching=False),
                               worker=WorkerConfig(attention_backend=attention_backend))
        # the device, dtype and attention backend resolved and checked as `shuttle serve` does (DeviceError)
        config = resolve_config(config, 1, cuda_device_count())
        self.model_config = config.model
        self.runner = ModelRunner(config)
        self.vocab = self.runner.model.get_output_embeddings().weight.shape[0]
        self._encoder = msgspec.msgpack.Encoder()
        self._plan_decoder = msgspec.msgpack.Decoder(PlanMessage)
        self._result_decoder = msgspec.msgpack.Decoder(WorkerMessage)

    def step(self, scheduler: Scheduler) -> tuple[ScheduledStep, float, float]:
        """Plan, execute and settle one step; returns it with (worker seconds, scheduler seconds)."""
        t0 = time.perf_counter()
        step = scheduler.schedule()
        t1 = time.perf_counter()
        plan = self._plan_decoder.decode(self._encoder.encode(step.plan))
        assert isinstance(plan, StepPlan)  # what was encoded: the round trip adds the wire's cost, not another type
        executed = self.runner.execute(plan)
        result = self._result_decoder.decode(self._encoder.encode(executed))
        assert isinstance(result, StepResult)  # likewise
        t2 = time.perf_counter()
        scheduler.update_from_output(step, result)
        t3 = time.perf_counter()
        return step, t2 - t1, (t1 - t0) + (t3 - t2)

    def measure(self, kind: str, batch: int, prompt_len: int, chunk: int, repeats: int = 5,
                seed: int = 0) -> list[Measurement]:
        """Run one configuration; returns its decode median, or its prefill or mixed steps one by one (labelled).

        kind "decode": `batch` prompts of `prompt_len` prefilled, then their decode steps. "prefill": `batch` prompts
        prefilled in chunks of `chunk` tokens each. "mixed": `batch` prompts of `prompt_len` prefilled, then, while
        they decode, one prompt of 4 x `chunk` tokens (at most the model's length) prefilled in `chunk`s beside them.
        """
        if kind == "mixed":
            return self._measure_mixed(batch, prompt_len, chunk, seed)
        budget = chunk * batch if kind == "prefill" else max(batch * prompt_len, batch)
        config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget)
        num_blocks = self.runner.kv_cache.num_blocks
        scheduler = Scheduler(config, KVCacheManager(num_blocks, self.block_size, enable_caching=False),
                              self.model_config.max_model_len, ())
        generator = torch.Generator().manual_seed(seed)
        steps = repeats + 2
        params = SamplingParams(max_tokens=max(steps, 1), temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(3, self.vocab, (prompt_len,), generator=generator).tolist()
            scheduler.add_request(b"cal", Submit(request_id=f"r{i}", prompt_token_ids=prompt, sampling=params,
                                                 arrival_time=float(i)))
        prefill: list[tuple[StepShape, float, float]] = []  # (shape, worker seconds, scheduler seconds)
        decode: list[tuple[StepShape, float, float]] = []
        while scheduler.has_work and len(decode) < repeats:
            step, seconds, sched = self.step(scheduler)
            scheduler.take_outputs()
            chunks = [(e.start, e.num_new, e.samples) for e in step.scheduled.values()]
            is_decode = all(n == 1 for _, n, _ in chunks)
            (decode if is_decode else prefill).append((shape_of(chunks), seconds, sched))
            if kind == "prefill" and not is_decode and all(e.samples for e in step.scheduled.values()):
                break  # the prompts are done: that is all a prefill configuration measures
        scheduler.abort(list(scheduler.requests))
        self.runner.batch.apply(scheduler.schedule().plan)  # the worker forgets them
        label = f"{kind} batch {batch} prompt {prompt_len}" + (f" chunk {chunk}" if chunk else "")
        if kind == "prefill":  # each chunk attends over a longer context: distinct shapes, kept one by one
            return [Measurement(f"{label} at {s.num_tokens} tokens, attention {s.prefill_attention}", s, sec, sch)
                    for s, sec, sch in prefill]
        return [_median(label, decode)] if decode else []

    def _measure_mixed(self, batch: int, prompt_len: int, chunk: int, seed: int) -> list[Measurement]:
        long_len = min(self.model_config.max_model_len - 8, 4 * chunk)
        # the decoders' prompts are prefilled under a full budget (at batch + chunk tokens a step, 64 decoders of the
        # 110M shape took a minute to start), then the budget becomes batch + chunk for the steps measured
        warm_budget = max(batch + chunk, 2048)
        config = SchedulerConfig(max_num_seqs=batch + 1, max_num_batched_tokens=warm_budget)
        scheduler = Scheduler(config, KVCacheManager(self.runner.kv_cache.num_blocks, self.block_size,
                                                     enable_caching=False), self.model_config.max_model_len, ())
        generator = torch.Generator().manual_seed(seed)
        # the decoders outlive their own chunked prefill (the first is done before the last) and the long one's
        steps = -(-batch * prompt_len // warm_budget) + -(-long_len // chunk) + 8
        decoding = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            prompt = torch.randint(3, self.vocab, (prompt_len,), generator=generator).tolist()
            scheduler.add_request(b"cal", Submit(request_id=f"r{i}", prompt_token_ids=prompt, sampling=decoding,
                                                 arrival_time=float(i)))
        while scheduler.has_work:  # until every decoder has its prompt computed
            step, _, _ = self.step(scheduler)
            scheduler.take_outputs()
            if not step.is_empty and all(e.num_new == 1 for e in step.scheduled.values()):
                break
        scheduler.config = dataclasses.replace(config, max_num_batched_tokens=batch + chunk)
        prompt = torch.randint(3, self.vocab, (long_len,), generator=generator).tolist()
        sampling = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        scheduler.add_request(b"cal", Submit(request_id="long", prompt_token_ids=prompt, sampling=sampling,
                                             arrival_time=float(batch)))
        mixed = []
        while scheduler.has_work:
            step, seconds, sched = self.step(scheduler)
            scheduler.take_outputs()
            chunks = [(e.start, e.num_new, e.samples) for e in step.scheduled.values()]
            if any(n > 1 for _, n, _ in chunks) and any(n == 1 for _, n, _ in chunks):
                mixed.append((shape_of(chunks), seconds, sched))
            if "long" not in scheduler.requests or scheduler.requests["long"].num_computed_tokens >= long_len:
                break
        scheduler.abort(list(scheduler.requests))
        self.runner.batch.apply(scheduler.schedule().plan)
        label = f"mixed {batch} decodes at {prompt_len} + chunk {chunk}"
        return [Measurement(f"{label}, attention {s.prefill_attention}", s, sec, sch) for s, sec, sch in mixed]

    def calibrate(self, max_num_batched_tokens: int, max_num_seqs: int, repeats: int = 5,
                  progress=print) -> tuple[StepCostModel, list[Measurement]]:
        """Measure the grid and fit. Returns the model and the measurements it was fitted to."""
        with torch.inference_mode():
            # warm-up: first calls pay lazy initialisation (kernels compiled, allocator pools, caches); the first
            # grid points ran 30-40% slow after a two-step warm-up
            self.measure("decode", 8, 64, 0, repeats=20)
            self.measure("prefill", 1, 256, 64)
        measurements: list[Measurement] = []
        configs = grid(self.model_config.max_model_len, max_num_batched_tokens, max_num_seqs)
        for i, (kind, batch, prompt_len, chunk) in enumerate(configs):
            with torch.inference_mode():
                if kind != "decode":  # each run gives one sample per chunk: run it `repeats` times, keep medians
                    runs = [self.measure(kind, batch, prompt_len, chunk, repeats, seed) for seed in range(repeats)]
                    found = [_median(same[0].label, [(m.shape, m.seconds, m.scheduler_seconds) for m in same])
                             for same in zip(*runs)]
                else:
                    found = self.measure(kind, batch, prompt_len, chunk, repeats)
            measurements.extend(found)
            for m in found:
                progress(f"[{i + 1}/{len(configs)}] {m.label}: {m.seconds * 1e3:.2f} ms")
        device = hardware.measure(self.model_config.dtype, self.runner.device.type)
        progress(f"{device.name}: {device.peak_flops / 1e9:.1f} GFLOP/s, {device.bandwidth / 1e9:.1f} GB/s "
                 f"({device.source})")
        roofline = hardware.roofline_for(self.model_config.model_dir, self.model_config.dtype, device)
        # the spread: each step against the median of its configuration, where a configuration ran more than once
        ratios = [x / m.seconds for m in measurements if len(m.samples) > 1 for x in m.samples]
        per_step, per_sequence = fit_scheduler_seconds([m.shape for m in measurements],
                                                       [m.scheduler_seconds for m in measurements])
        model = StepCostModel.fit([m.shape for m in measurements], [m.seconds for m in measurements],
                                  roofline=roofline,
                                  scheduler_s=per_step, scheduler_sequence_s=per_sequence,
                                  spread=spread_of(ratios), meta=self.meta())
        return model, measurements

    def serve(self, workload: list[SimRequest], config: SchedulerConfig, num_blocks: int) -> InProcessRun:
        """Serve `workload` with the in-process engine: the real Scheduler and this ModelRunner in one loop in real
        time (one step in flight, each through the worker's critical path as in step()), requests taken in when
        their arrival time has come. What the simulator is judged against (scripts/dev/compare_inprocess.py).

        Raises:
            ValueError: num_blocks exceeds the runner's KV cache.
        """
        if num_blocks > self.runner.kv_cache.num_blocks:
            raise ValueError(f"{num_blocks} KV blocks asked, the runner holds {self.runner.kv_cache.num_blocks}")
        scheduler = Scheduler(config, KVCacheManager(num_blocks, self.block_size, enable_caching=False),
                              self.model_config.max_model_len, ())
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
        records = [RequestRecord(w.arrival, len(w.prompt_token_ids), w.output_len) for w in workload]
        steps: list[tuple[StepShape, float]] = []
        start, sent = time.perf_counter(), 0
        with torch.inference_mode():
            while sent < len(order) or scheduler.has_work:
                now = time.perf_counter() - start
                while sent < len(order) and workload[order[sent]].arrival <= now:
                    w = workload[order[sent]]
                    scheduler.add_request(b"run", Submit(request_id=str(order[sent]),
                                                         prompt_token_ids=w.prompt_token_ids, sampling=SamplingParams(
                        max_tokens=w.output_len, temperature=0.0, ignore_eos=True), arrival_time=start + w.arrival))
                    sent += 1
                if not scheduler.has_work:
                    time.sleep(max(0.0, workload[order[sent]].arrival - now))
                    continue
                step, seconds, _ = self.step(scheduler)
                if step.is_empty:
                    continue
                steps.append((shape_of((e.start, e.num_new, e.samples) for e in step.scheduled.values()), seconds))
                now = time.perf_counter() - start
                for output in scheduler.take_outputs().get(b"run", []):
                    record = records[int(output.request_id)]
                    record.token_times.extend([now] * len(output.new_token_ids))
                    if output.finish_reason is not None:
                        record.finish = now
        self.runner.batch.apply(scheduler.schedule().plan)
        first = min(r.arrival for r in records)
        last = max(r.finish for r in records)
        return InProcessRun(SimResult(records, [], len(steps), scheduler.num_preemptions, last - first), steps)

    def meta(self) -> dict:
        """What the simulator needs besides the coefficients, and how the measurement was made."""
        return {"model": self.model_config.model_dir, "dtype": self.model_config.dtype,
                "max_model_len": self.model_config.max_model_len, "vocab_size": self.vocab,
                "kv_bytes_per_token": self.runner.kv_cache.bytes_per_token,
                "block_size": self.block_size, "attention_backend": self.runner.backend.name,
                "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()}


def _median(label: str, rows: list[tuple[StepShape, float, float]]) -> Measurement:
    ordered = sorted(rows, key=lambda r: r[1])
    shape, seconds, _ = ordered[len(ordered) // 2]
    return Measurement(label, shape, seconds, statistics.median(r[2] for r in rows), tuple(r[1] for r in ordered))


def main(argv: list[str] | None = None) -> int:
    """`shuttle calibrate`: measure, fit, print, save the profile."""
    parser = argparse.ArgumentParser(prog="shuttle calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="the model directory to serve")
    parser.add_argument("--out", type=output_file, required=True, help="where the JSON profile goes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-model-len", type=positive, default=None)
    parser.add_argument("--max-num-batched-tokens", type=positive, default=2048, help="largest chunk measured")
    parser.add_argument("--max-num-seqs", type=positive, default=128, help="largest decode batch measured")
    parser.add_argument("--repeats", type=positive, default=5, help="decode steps per configuration (median kept)")
    add_config_options(parser, WorkerConfig, ["attention_backend"])
    args = parser.parse_args(argv)
    simulate.require_model_dir(parser, args.model, args.max_model_len)
    start = time.time()
    try:
        calibrator = Calibrator(args.model, args.dtype, args.max_model_len, attention_backend=args.attention_backend)
    except (DeviceError, UnsupportedModelError, KVSizingError) as exc:
        parser.error(str(exc))
    model, measurements = calibrator.calibrate(args.max_num_batched_tokens, args.max_num_seqs, args.repeats,
                                               progress=lambda line: print(line, flush=True))
    print(f"{'measurement':<60}{'ms':>10}{'fit ms':>10}")
    for m in measurements:
        print(f"{m.label:<60}{m.seconds * 1e3:10.2f}{model.predict(m.shape) * 1e3:10.2f}")
    model.meta["seconds"] = round(time.time() - start, 1)
    print("coefficients: " + ", ".join(f"{name} {model.coefficients[name]:.3g}" for name in FEATURES))
    print(f"relative RMS error {model.meta['rel_rmse']:.3f}; scheduler {model.scheduler_s * 1e3:.3f} ms/step + "
          f"{model.scheduler_sequence_s * 1e6:.2f} us/sequence")
    model.save(args.out)
    print(f"wrote {args.out}")
    return 0
