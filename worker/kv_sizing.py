"""KV-cache sizing on CUDA from a profiled peak (`--gpu-memory-utilization`), the way vLLM sizes it.

The order of events in the worker (worker/worker.py), every figure in bytes:
1. `baseline = snapshot(device)` once CUDA (and NCCL, under tensor parallel) is up, before the weights load.
2. The weights load; the exactness check runs.
3. `profile_peak(...)` runs one dummy step at the largest step shape (profile_plan: max_num_batched_tokens spread
   over min(tokens, max_num_seqs) prefilling sequences, each of which samples) over a scratch KV cache, and
   measures the torch allocator's peak above what was allocated before it (the activation peak) and how much the
   memory used outside torch's allocator grew since the baseline (NCCL, cuBLAS and other workspaces).
4. `plan_kv_blocks(...)` (pure arithmetic, tested with fabricated figures):
       requested = ceil(total * utilization)            (refused if the baseline had less free)
       non_kv    = weights + activation peak + non-torch increase
       available = requested - non_kv - CUDA-graph allowance
       blocks    = available // (block_size * bytes_per_token) - 1   (common/capacity.kv_blocks_for_memory:
                                                                       one more block is the null block)
   capped, under the flex backend, so that one layer's K or V view stays under 2^31 elements (its kernels use
   32-bit offsets; worker/flex_attention.max_kv_blocks_for), and refused when it cannot hold one request of
   max_model_len tokens.

CUDA graphs are captured after the KV cache is allocated, into the allowance kept back here (worker/graph_runner.py).
Only `snapshot` and `profile_peak` touch CUDA; everything else runs anywhere.
"""

from __future__ import annotations

import gc
import logging
import math
from dataclasses import dataclass
from typing import Callable

import torch

from shuttle.common.capacity import blocks_per_request, kv_blocks_for_memory, kv_cache_bytes, requests_that_fit
from shuttle.common.messages import NewRequestData, StepPlan
from shuttle.common.sampling import SamplingParams

log = logging.getLogger("shuttle.worker")

GiB = 2**30
MiB = 2**20
# Kept back for the decode CUDA graphs' shared pool, which is captured after the KV cache (not yet measured on a
# GPU: scripts/gpu_check.sh reports the real pool size; vLLM's estimate is off by default for the same reason).
CUDA_GRAPH_ALLOWANCE = 512 * MiB


class KVSizingError(ValueError):
    """The device's memory budget cannot hold the KV cache the server needs (the message says what to change)."""


@dataclass(frozen=True)
class MemorySnapshot:
    """A CUDA device's memory at one moment, in bytes.

    Attributes:
        free, total: torch.cuda.mem_get_info (the driver's view, every process included).
        torch_allocated: bytes in live tensors (memory_stats allocated_bytes.all.current).
        torch_peak: the allocator's high-water mark since the last reset (allocated_bytes.all.peak).
        torch_reserved: bytes torch's caching allocator holds from the driver (reserved_bytes.all.current).
    """

    free: int
    total: int
    torch_allocated: int
    torch_peak: int
    torch_reserved: int

    @property
    def non_torch(self) -> int:
        """Bytes used on the device outside torch's allocator (CUDA context, NCCL, cuBLAS workspaces, other
        processes)."""
        return self.total - self.free - self.torch_reserved


@dataclass(frozen=True)
class MemoryFigures:
    """What the sizing arithmetic needs, in bytes (measured by profile_peak, or fabricated in tests).

    Attributes:
        total: the device's memory.
        free_at_start: free at the baseline, before the weights.
        weights: torch bytes the weights (and whatever else stays allocated before the step: buffers, workspaces)
            took.
        activation_peak: the profiling step's torch peak above what was allocated before it.
        non_torch_increase: growth of non-torch memory from the baseline to after the profiling step (>= 0).
    """

    total: int
    free_at_start: int
    weights: int
    activation_peak: int
    non_torch_increase: int


@dataclass(frozen=True)
class KVPlan:
    """The outcome of plan_kv_blocks.

    Attributes:
        num_blocks: usable KV blocks (the null block not counted).
        kv_bytes: bytes the K and V tensors take, null block included.
        total: the device's memory.
        requested: total * utilization, rounded up.
        available: what is left for KV (requested - non-KV - graph allowance).
        flex_cap: the flex 2^31 cap on num_blocks when it applied (None otherwise); capped: it bound.
        requests_fit: requests of max_model_len tokens the cache holds at once.
    """

    num_blocks: int
    kv_bytes: int
    total: int
    requested: int
    available: int
    flex_cap: int | None
    capped: bool
    requests_fit: int


def plan_kv_blocks(figures: MemoryFigures, utilization: float, bytes_per_token: int, block_size: int,
                   max_model_len: int, graph_allowance: int = 0, max_blocks: int | None = None) -> KVPlan:
    """KV blocks for `--gpu-memory-utilization utilization` (module docstring, step 4).

    Args:
        figures: measured (or fabricated) memory figures, bytes.
        bytes_per_token: K + V bytes of one token over all layers (worker.kv_cache.KVCache.bytes_per_token_of).
        graph_allowance: bytes kept back for CUDA graphs captured after the cache (0 when none are).
        max_blocks: a cap on the usable blocks (the flex backend's max_kv_blocks_for), None for none.
    Returns:
        a KVPlan.
    Raises:
        KVSizingError: the device had less free memory at start than the requested share (another process holds
            it), or the budget left for KV cannot hold one request of max_model_len tokens.
    """
    requested = math.ceil(figures.total * utilization)
    if figures.free_at_start < requested:
        raise KVSizingError(
            f"--gpu-memory-utilization {utilization} asks for {requested / GiB:.2f} GiB of the device's "
            f"{figures.total / GiB:.2f} GiB, but only {figures.free_at_start / GiB:.2f} GiB was free at start (another "
            f"process holds the rest): lower --gpu-memory-utilization or free the device")
    non_kv = figures.weights + figures.activation_peak + max(figures.non_torch_increase, 0)
    available = requested - non_kv - graph_allowance
    blocks = kv_blocks_for_memory(max(available, 0), bytes_per_token, block_size)
    capped = False
    if max_blocks is not None and blocks > max_blocks:
        capped = True
        log.info("KV blocks capped at %d (from %d): the flex attention backend addresses one layer's cache with "
                 "32-bit offsets", max_blocks, blocks)
        blocks = max_blocks
    needed = blocks_per_request(max_model_len, block_size)
    if blocks < needed:
        raise KVSizingError(
            f"the KV cache gets {max(available, 0) / GiB:.2f} GiB ({max(blocks, 0)} blocks of {block_size} tokens) "
            f"of --gpu-memory-utilization {utilization} x {figures.total / GiB:.2f} GiB after weights "
            f"{figures.weights / GiB:.2f} GiB, activation peak {figures.activation_peak / GiB:.2f} GiB, non-torch "
            f"{max(figures.non_torch_increase, 0) / GiB:.2f} GiB and CUDA graphs {graph_allowance / GiB:.2f} GiB; "
            f"one request of max_model_len {max_model_len} needs {needed} blocks: raise --gpu-memory-utilization, or "
            f"lower --max-model-len or --max-num-batched-tokens")
    return KVPlan(blocks, kv_cache_bytes(blocks, block_size, bytes_per_token), figures.total, requested, available,
                  max_blocks, capped, requests_that_fit(blocks, block_size, max_model_len))


# ---------------------------------------------------------------------------------------------------------------
# The profiling step (any device) and the measurement around it (CUDA only)


def profile_plan(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 vocab_size: int, step_id: int = -1) -> tuple[StepPlan, int]:
    """The largest step shape as a StepPlan of new requests over a scratch cache whose blocks are numbered from 0.

    min(max_num_batched_tokens, max_num_seqs) sequences share the tokens as evenly as they can (none longer than
    max_model_len, so the step may hold fewer tokens when max_num_seqs x max_model_len is smaller), each
    prefilled whole so that every one samples, with top-k, top-p and min-p on (the sampler's largest path).

    Returns:
        (plan, blocks): the plan and how many scratch blocks its requests use.
    """
    num_seqs = max(1, min(max_num_batched_tokens, max_num_seqs))
    base, extra = divmod(max_num_batched_tokens, num_seqs)
    params = SamplingParams(max_tokens=1, temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=0, ignore_eos=True)
    requests, next_block = [], 0
    for i in range(num_seqs):
        length = min(base + (i < extra), max_model_len)
        if length < 1:
            continue
        count = blocks_per_request(length, block_size)
        token_ids = [(7 * i + j) % vocab_size for j in range(length)]
        requests.append(NewRequestData(request_id=f"profile-{i}", token_ids=token_ids, sampling=params,
                                       block_ids=list(range(next_block, next_block + count)),
                                       num_computed_tokens=0, num_scheduled_tokens=length))
        next_block += count
    return StepPlan(step_id=step_id, new_requests=requests, cached_requests=[]), next_block


def snapshot(device: torch.device) -> MemorySnapshot:
    """The device's memory now (CUDA only; syncs with the device)."""
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    stats = torch.cuda.memory_stats(device)
    return MemorySnapshot(free, total, stats.get("allocated_bytes.all.current", 0),
                          stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.current", 0))


def profile_peak(run_step: Callable[[], None], device: torch.device, baseline: MemorySnapshot,
                 scratch_bytes: int) -> MemoryFigures:
    """Run `run_step` (the profiling step) once and measure it against `baseline` (CUDA only).

    Args:
        run_step: runs the step (it is synchronised here).
        baseline: snapshot(device) taken before the weights loaded.
        scratch_bytes: bytes of the scratch KV cache the step writes into, allocated before this call; it is not
            counted as weights (the torch bytes held before the step, less it, less the baseline's).
    Raises:
        KVSizingError: free memory rose during profiling (another process freed some: the figures are unsound).
    """
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = snapshot(device)
    run_step()
    peak = snapshot(device)
    gc.collect()
    torch.cuda.empty_cache()
    after = snapshot(device)
    if after.free > baseline.free:
        raise KVSizingError(f"free device memory rose from {baseline.free / GiB:.2f} to {after.free / GiB:.2f} GiB "
                            f"while profiling: another process released memory, so the profile is unsound; restart "
                            f"when the device is quiet")
    return figures_from_snapshots(baseline, before, peak, after, scratch_bytes)


def figures_from_snapshots(baseline: MemorySnapshot, before: MemorySnapshot, peak: MemorySnapshot,
                           after: MemorySnapshot, scratch_bytes: int) -> MemoryFigures:
    """MemoryFigures from the four snapshots of profile_peak (pure; bytes): weights are the torch bytes held before
    the step less the scratch cache and the baseline's; the activation peak is the step's torch peak above what
    was allocated before it; the non-torch increase runs from the baseline to after the step (the scratch cache
    released)."""
    return MemoryFigures(total=baseline.total, free_at_start=baseline.free,
                         weights=max(before.torch_allocated - scratch_bytes - baseline.torch_allocated, 0),
                         activation_peak=max(peak.torch_peak - before.torch_allocated, 0),
                         non_torch_increase=max(after.non_torch - baseline.non_torch, 0))
