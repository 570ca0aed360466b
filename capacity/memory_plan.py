"""`shuttle plan`: what a serving group will hold in memory, and how many requests fit, before it is started.

Everything is measured with the serving code itself, never re-derived: the worker's ModelRunner loads the model
(weights), probes the KV geometry (bytes per token) and runs profiling steps of the configured step shape (peak
activation buffers: the resident-set high-water mark of the process during a step, reset before it through
/proc/self/clear_refs); the KV block count and the requests that fit come from common/capacity.py, which the
worker and the launcher's start-up line use too. Each process's own overhead (interpreter, libraries, tokenizer,
compiled kernels) is measured in a fresh subprocess that imports what that process imports. The memory a waiting
request costs is measured with tracemalloc on the scheduler's Request and Submit objects.

The worker's predicted peak RSS at full KV use is: its resident set after loading (interpreter, torch, weights,
exactness check, kernels) + the whole KV cache (allocated zeroed at start, so resident from the start) + the peak
activations of the largest step + the per-token state it keeps for running requests (their token ids).
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from dataclasses import asdict, dataclass, field

import msgspec
import torch

from shuttle.common.capacity import blocks_per_request, kv_blocks_for_memory, kv_cache_bytes, requests_that_fit
from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.messages import FrontendMessage, Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler

CONTEXTS = (256, 1024, 4096)  # context lengths of the concurrency table, besides max_model_len
MiB = 2**20

# What each process imports before serving (its __main__'s imports, and the frontend's tokenizer).
_PROCESS_PROBES = {
    "frontend": "import frontend.app\nfrom frontend.tokenizer import TextTokenizer\nTextTokenizer({model!r})",
    "scheduler": "import scheduler.loop, scheduler.__main__",
}


def rss_bytes(field_name: str = "VmRSS", pid: int | str = "self") -> int:
    """A size from /proc/PID/status in bytes (VmRSS: resident now; VmHWM: the high-water mark)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"{field_name} not in /proc/{pid}/status")


def reset_peak_rss() -> None:
    """Start a new resident-set high-water mark for this process (Linux: write 5 to /proc/self/clear_refs).

    Free heap memory is handed back to the system first (glibc's malloc_trim): glibc keeps freed memory resident
    and raises its mmap threshold as large blocks are freed, so after earlier work (a test suite's) a step's
    activations could reuse resident memory and the high-water mark would not move: peak 0 measured."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the mark is only as good as the allocator's habits
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@dataclass
class ConcurrencyRow:
    """How many requests of `context_len` tokens (prompt + output) fit at once."""

    context_len: int
    blocks_per_request: int
    fit_in_kv: int  # by KV blocks alone
    concurrent: int  # min(fit_in_kv, max_num_seqs)
    limited_by: str  # "KV cache" or "max_num_seqs"


@dataclass
class MemoryPlan:
    """The plan in bytes (and blocks, tokens, requests). See the module docstring for how each is measured."""

    model_dir: str
    dtype: str
    device: str
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_waiting_requests: int
    weight_bytes: int
    kv_bytes_per_token: int
    kv_budget_bytes: int
    kv_budget_source: str
    num_kv_blocks: int
    kv_cache_bytes: int
    peak_activation_bytes: int
    peak_activation_step: str
    worker_loaded_rss_bytes: int  # resident after ModelRunner set-up, its profiling KV cache excluded
    worker_token_state_bytes: int  # per running token: the worker's copy of its id
    process_overhead_bytes: dict[str, int]
    queue_bytes_per_request: int  # a waiting request with no prompt
    queue_bytes_per_prompt_token: float
    notes: list[str] = field(default_factory=list)
    concurrency: list[ConcurrencyRow] = field(default_factory=list)

    @property
    def kv_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def worker_peak_rss_bytes(self) -> int:
        """Predicted worker resident set with every KV block in use."""
        return (self.worker_loaded_rss_bytes + self.kv_cache_bytes + self.peak_activation_bytes
                + self.worker_token_state_bytes * self.kv_tokens)

    def queue_bytes(self, num_requests: int, prompt_len: int) -> int:
        return int(num_requests * (self.queue_bytes_per_request + self.queue_bytes_per_prompt_token * prompt_len))

    @property
    def total_bytes(self) -> int:
        """Worker at full KV use + frontend + scheduler + a full waiting queue of max_model_len/2-token prompts."""
        return (self.worker_peak_rss_bytes + self.process_overhead_bytes.get("frontend", 0)
                + self.process_overhead_bytes.get("scheduler", 0)
                + self.queue_bytes(self.max_waiting_requests, self.max_model_len // 2))

    def to_json(self) -> dict:
        data = asdict(self)
        data.update(kv_tokens=self.kv_tokens, worker_peak_rss_bytes=self.worker_peak_rss_bytes,
                    full_queue_bytes=self.queue_bytes(self.max_waiting_requests, self.max_model_len // 2),
                    total_bytes=self.total_bytes)
        return data

    def render(self) -> str:
        """The human-readable plan (what `shuttle plan` prints)."""
        def mib(n: float) -> str:
            return f"{n / MiB:10.1f} MiB"

        full_queue = self.queue_bytes(self.max_waiting_requests, self.max_model_len // 2)
        lines = [
            f"memory plan for {self.model_dir} ({self.dtype}, {self.device})",
            f"  max_model_len {self.max_model_len}, block_size {self.block_size}, max_num_seqs {self.max_num_seqs}, "
            f"max_num_batched_tokens {self.max_num_batched_tokens}",
            "",
            f"  {'weights':<48}{mib(self.weight_bytes)}",
            f"  {'KV bytes per token':<48}{self.kv_bytes_per_token:>10} B   (probed geometry, all layers, K + V)",
            f"  {'KV budget':<48}{mib(self.kv_budget_bytes)}   ({self.kv_budget_source})",
            f"  {'KV blocks':<48}{self.num_kv_blocks:>10}       x {self.block_size} tokens = {self.kv_tokens} tokens "
            f"(+1 null block)",
            f"  {'KV cache tensors':<48}{mib(self.kv_cache_bytes)}",
            f"  {'peak activations (profiling step)':<48}{mib(self.peak_activation_bytes)}   "
            f"({self.peak_activation_step})",
            f"  {'worker after load (runtime + weights + kernels)':<48}{mib(self.worker_loaded_rss_bytes)}",
            f"  {'worker per-token state at full KV use':<48}{mib(self.worker_token_state_bytes * self.kv_tokens)}",
            f"  {'worker peak RSS at full KV use':<48}{mib(self.worker_peak_rss_bytes)}",
        ]
        for name, value in self.process_overhead_bytes.items():
            lines.append(f"  {name + ' process (measured at start)':<48}{mib(value)}")
        lines += [
            f"  {'queue memory per waiting request':<48}{self.queue_bytes_per_request:>10} B + "
            f"{self.queue_bytes_per_prompt_token:.1f} B per prompt token",
            f"  {f'full queue ({self.max_waiting_requests} x {self.max_model_len // 2}-token prompts)':<48}"
            f"{mib(full_queue)}",
            f"  {'total (all processes, full KV, full queue)':<48}{mib(self.total_bytes)}",
            "",
            f"  {'context':>8}{'blocks/req':>12}{'fit in KV':>11}{'concurrent':>12}  limited by",
        ]
        for row in self.concurrency:
            lines.append(f"  {row.context_len:>8}{row.blocks_per_request:>12}{row.fit_in_kv:>11}{row.concurrent:>12}"
                         f"  {row.limited_by}")
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


def concurrency_table(num_blocks: int, block_size: int, max_model_len: int, max_num_seqs: int) -> list[ConcurrencyRow]:
    """Rows for CONTEXTS below max_model_len, then max_model_len itself (the start-up line's figure)."""
    rows = []
    for context in sorted({c for c in CONTEXTS if c < max_model_len} | {max_model_len}):
        fit = requests_that_fit(num_blocks, block_size, context)
        rows.append(ConcurrencyRow(context, blocks_per_request(context, block_size), fit, min(fit, max_num_seqs),
                                   "KV cache" if fit < max_num_seqs else "max_num_seqs"))
    return rows


def measure_process_overhead(model_dir: str, names=("frontend", "scheduler")) -> dict[str, int]:
    """Resident bytes of a fresh interpreter that imports what each process imports (subprocesses)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = {}
    for name in names:
        code = _PROCESS_PROBES[name].format(model=model_dir) + (  # read inline: this module would import torch
            "\nprint(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS:')))")
        done = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"measuring the {name} process failed: {done.stderr.strip()[-500:]}")
        out[name] = int(done.stdout.split()[-1])
    return out


def measure_queue_memory(vocab_size: int, prompt_len: int = 512) -> tuple[int, float]:
    """(bytes per waiting request without prompt, bytes per prompt token) of the scheduler's Request objects with
    their decoded Submit, measured with tracemalloc over 200 requests of 1 and of `prompt_len` tokens."""
    def measure(length: int) -> float:
        # Waiting requests hold no blocks: the cache only has to be big enough to admit one prompt.
        scheduler = Scheduler(SchedulerConfig(max_waiting_requests=10**6), KVCacheManager(4096, 16), 1 << 30, ())
        generator = torch.Generator().manual_seed(length)
        encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(FrontendMessage)
        prompts = [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for _ in range(200)]
        wire = [encoder.encode(Submit(request_id=f"plan-{i}", prompt_token_ids=prompt,
                                      sampling=SamplingParams(max_tokens=16), arrival_time=float(i)))
                for i, prompt in enumerate(prompts)]
        del prompts
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for message in wire:  # decoded as the scheduler's socket does: every token id a new int object
            request = decoder.decode(message)
            assert isinstance(request, Submit)  # each one encoded from a Submit
            scheduler.add_request(b"plan", request)
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        return (after - before) / len(wire)

    small, large = measure(1), measure(prompt_len)
    per_token = (large - small) / (prompt_len - 1)
    return int(small - per_token), per_token


def _profile_steps(runner, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int,
                   vocab_size: int) -> tuple[int, str]:
    """Peak RSS growth of the largest steps of this shape: a max_model_len prompt prefilled in chunks of
    max_num_batched_tokens (the last chunk attends over the whole context), and max_num_seqs sequences in one
    step (prefill, then a decode). Returns (bytes, which step)."""
    block_size = runner.block_size
    worst = (0, "")
    shapes = [("one sequence", 1, max_model_len - 1, max_num_batched_tokens),
              ("max_num_seqs sequences", max_num_seqs, max(1, min(16, max_num_batched_tokens // max_num_seqs)),
               max_num_batched_tokens)]
    generator = torch.Generator().manual_seed(0)
    for label, batch, prompt_len, budget in shapes:
        config = SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=budget)
        scheduler = Scheduler(config, KVCacheManager(runner.kv_cache.num_blocks, block_size, enable_caching=False),
                              max_model_len, ())
        for i in range(batch):
            prompt = torch.randint(3, vocab_size, (prompt_len,), generator=generator).tolist()
            scheduler.add_request(b"plan", Submit(request_id=f"p{i}", prompt_token_ids=prompt,
                                                  sampling=SamplingParams(max_tokens=2, ignore_eos=True),
                                                  arrival_time=float(i)))
        while scheduler.has_work:
            step = scheduler.schedule()
            gc.collect()
            reset_peak_rss()
            before = rss_bytes()
            result = runner.execute(step.plan)
            peak = rss_bytes("VmHWM") - before
            tokens = step.num_tokens
            if peak > worst[0]:
                count = len(step.scheduled)
                worst = (peak, f"{label}: {count} sequence{'s' * (count != 1)}, {tokens} tokens")
            scheduler.update_from_output(step, result)
            scheduler.take_outputs()
        runner.batch.apply(scheduler.schedule().plan)
    return worst


def build_plan(model_dir: str, max_model_len: int | None = None, dtype: str = "auto",
               kv_cache_memory: int | None = None, gpu_memory_utilization: float | None = None,
               num_kv_blocks: int | None = None, block_size: int = 16, max_num_seqs: int = 128,
               max_num_batched_tokens: int = 2048, max_waiting_requests: int = 4096, attention_backend: str = "auto",
               measure_processes: bool = True, quantization: str = "none") -> MemoryPlan:
    """Measure and compute the memory plan (see the module docstring). Never starts a server.

    Raises:
        ModelDirError: the model directory is unusable.
        UnsupportedModelError: the worker cannot serve the model.
        ValueError: the KV budget holds no block.
    """
    from shuttle.worker.kv_cache import KVCache
    from shuttle.worker.worker import ModelRunner

    model = ModelConfig.from_dir(model_dir, max_model_len, dtype=dtype)
    notes: list[str] = []
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    profile_blocks = (blocks_per_request(model.max_model_len, block_size) + max_num_seqs * blocks_per_request(
        max(1, min(16, max_num_batched_tokens // max_num_seqs)) + 2, block_size) + 8)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(block_size, profile_blocks, enable_prefix_caching=False),
                           worker=WorkerConfig(attention_backend, quantization=quantization))
    runner = ModelRunner(config)
    if runner.quantized_linears:
        notes.append(f"--quantization {quantization}: the weights count {runner.quantized_linears} linear layers at "
                     f"one byte per weight plus their scales (worker/quantization.py)")
    gc.collect()
    bytes_per_token = KVCache.bytes_per_token_of(runner.geometry, runner.dtype)
    profile_kv = kv_cache_bytes(profile_blocks, block_size, bytes_per_token)
    loaded_rss = rss_bytes() - profile_kv
    vocab_size = runner.model.get_output_embeddings().weight.shape[0]
    with torch.inference_mode():
        peak, peak_step = _profile_steps(runner, model.max_model_len, max_num_batched_tokens, max_num_seqs, vocab_size)

    default_kv = CacheConfig().kv_cache_memory
    if num_kv_blocks is not None:
        budget, source = kv_cache_bytes(num_kv_blocks, block_size, bytes_per_token), "--num-kv-blocks"
        blocks = num_kv_blocks
    else:
        budget, source = kv_cache_memory or default_kv, "--kv-cache-memory" if kv_cache_memory else "default 1GiB"
        if gpu_memory_utilization is not None:
            if cuda:
                total = torch.cuda.get_device_properties(0).total_memory
                budget = int(total * gpu_memory_utilization) - runner.weight_bytes - peak
                source = (f"--gpu-memory-utilization {gpu_memory_utilization}: {gpu_memory_utilization} x "
                          f"{total / MiB:.0f} MiB less weights and peak activations")
                notes.append("on CUDA `shuttle serve --gpu-memory-utilization` sizes the KV cache itself from a "
                             "profiled step's torch peak and non-torch memory (worker/kv_sizing.py); this plan's "
                             "figure uses the step's resident-set peak instead")
            else:
                notes.append(f"--gpu-memory-utilization {gpu_memory_utilization} applies to a CUDA device only and "
                             f"there is none here: the KV budget is {source} instead")
        blocks = kv_blocks_for_memory(budget, bytes_per_token, block_size)
    if blocks < 1:
        raise ValueError(f"a KV budget of {budget} bytes holds no block of {block_size} tokens")
    if blocks * block_size < model.max_model_len:
        notes.append(f"the KV cache holds {blocks * block_size} tokens, fewer than max_model_len "
                     f"{model.max_model_len}: requests needing more are rejected")
    overhead = measure_process_overhead(model.model_dir) if measure_processes else {}
    queue_fixed, queue_per_token = measure_queue_memory(vocab_size, min(512, model.max_model_len))
    return MemoryPlan(
        model_dir=model.model_dir, dtype=runner.dtype_name, device=device, max_model_len=model.max_model_len,
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        max_waiting_requests=max_waiting_requests, weight_bytes=runner.weight_bytes,
        kv_bytes_per_token=bytes_per_token, kv_budget_bytes=budget, kv_budget_source=source, num_kv_blocks=blocks,
        kv_cache_bytes=kv_cache_bytes(blocks, block_size, bytes_per_token), peak_activation_bytes=peak,
        peak_activation_step=peak_step, worker_loaded_rss_bytes=loaded_rss,
        worker_token_state_bytes=WORKER_BYTES_PER_TOKEN, process_overhead_bytes=overhead,
        queue_bytes_per_request=queue_fixed, queue_bytes_per_prompt_token=queue_per_token, notes=notes,
        concurrency=concurrency_table(blocks, block_size, model.max_model_len, max_num_seqs))


# The worker keeps each running request's token ids in a Python list: an 8-byte pointer per token, plus a 28-byte
# int object for ids above CPython's small-int cache (256), which is nearly all of them.
WORKER_BYTES_PER_TOKEN = 36


def main(args) -> int:
    """`shuttle plan` (arguments from launcher/cli.py). Prints the plan (or JSON) and returns 0; 2 on bad input."""
    from shuttle.common.errors import ModelDirError
    from shuttle.common.model_dir import check_model_dir
    from shuttle.worker.model_loader import UnsupportedModelError

    if args.model_dir is None:
        print("shuttle: no MODEL_DIR given and the default ../shared/models/stories260K is missing", file=sys.stderr)
        return 2
    try:
        check_model_dir(args.model_dir)  # one line for a bad directory, as `shuttle serve` refuses it
        plan = build_plan(args.model_dir, args.max_model_len, args.dtype, args.kv_cache_memory,
                          args.gpu_memory_utilization, args.num_kv_blocks, args.block_size, args.max_num_seqs,
                          args.max_num_batched_tokens, args.max_waiting_requests, args.attention_backend,
                          measure_processes=not args.no_measure_processes,
                          quantization=getattr(args, "quantization", "none"))
    except (ModelDirError, UnsupportedModelError, ValueError) as exc:
        print(f"shuttle: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.render())
    return 0
