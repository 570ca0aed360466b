"""CUDA graphs for decode-only steps: the whole model forward of a decode step replayed from a graph captured at
start-up, one graph per bucketed batch size.

**Buckets.** Batch sizes 1, 2, 4, 8, then multiples of 16 up to max_bs = min(max_num_seqs, 512) (the same sizes
flex pads its decode rows to, worker/flex_attention.py `decode_bucket`). A decode step of B rows replays the
smallest bucket >= B; a step larger than the largest bucket, and every step with a prefill chunk (or prompt
logprobs), runs eagerly.

**Static buffers.** A graph replays fixed device addresses, so every input lives in a buffer allocated once and
refilled in place: input ids, positions and slot mapping (int64 [max_bs]), seq_lens (int32 [max_bs]), the block
table (int32 [max_bs, max_blocks_per_seq]) and the output logits [max_bs, vocab]. Each bucket's AttentionMetadata
is built once over slices of those buffers; the flex backend builds its block masks from them inside the forward
(tensor ops only), so the masks are recorded in the graph and recomputed on every replay. Each step fills the
first B rows of pinned host mirrors, copies them with non_blocking copies, replays, and returns logits[:B];
sampling then runs on the device and copies the sampled ids back once.

**Padding rows** (B .. bucket-1) are decodes of one token at position 0 of the null block: seq_len 1, a block-table
row of null blocks, and their slot at offset 0 of the null block, so the only cache block they write is the null
block, which no real row reads (tables are padded with it, never filled with it).

**No host sync inside the forward.** In graph mode the metadata's host lists (query_start_list, seq_lens_list) are
placeholders that raise when read, and nothing calls `.item()` or `.tolist()`; only backends in
GRAPH_SAFE_BACKENDS (whose per-layer path reads tensors alone) can be captured.

**Capture.** From the largest bucket down, each bucket runs once eagerly (on CUDA this compiles flex for that
shape), then is captured with torch.cuda.graph into one shared memory pool (a smaller graph reuses the larger
ones' pool). On the CPU (tests) the same runner "captures" by remembering the forward and "replays" by calling it
on the static buffers, so filling, padding and slicing run the same code; there the cpu and reference backends
work too, their host lists refilled in place each step.
"""

from __future__ import annotations

import bisect
import functools
import logging
import time
from typing import Callable, cast

import torch

from shuttle.worker.attention import AttentionMetadata, StepAttention
from shuttle.worker.input_batch import StepInputs

log = logging.getLogger("shuttle.worker")

MAX_GRAPH_BATCH = 512  # largest captured batch size (nano-vllm's and vLLM's bound)
GRAPH_SAFE_BACKENDS = frozenset({"flex"})  # read no host lists and never sync inside forward()


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The bucketed batch sizes, ascending: 1, 2, 4, 8, 16, 32, ... up to min(max_num_seqs, 512)."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH)
    return [size for size in (1, 2, 4, 8) if size <= max_bs] + list(range(16, max_bs + 1, 16))


def bucket_for(rows: int, sizes: list[int]) -> int | None:
    """The first of the ascending `sizes` that holds `rows` rows, None when none does (the step runs eagerly)."""
    index = bisect.bisect_left(sizes, rows)
    return sizes[index] if index < len(sizes) else None


class HostListUnavailable:
    """Stands in for AttentionMetadata's host lists in graph mode (and in worker/cpu_compiled_decode.py's compiled
    forward): a graph replays recorded device work, so a value read on the host at capture time would be replayed
    stale on every later step (and a compiled forward would guard on it, compiling again for new values). Any read
    raises."""

    def __init__(self, name: str):
        self.name = name

    def _refuse(self, *args):
        raise RuntimeError(f"AttentionMetadata.{self.name} is not available in a captured or compiled decode step: "
                           f"a backend that can be captured or compiled reads its step from tensors only")

    __len__ = __getitem__ = __iter__ = _refuse


class DecodeGraphRunner:
    """Runs decode-only steps from bucketed static buffers: CUDA graphs on CUDA, plain calls elsewhere.

    Args:
        model: the transformers model, loaded with shuttle's paged attention.
        backend: the attention backend (its `name` must be in GRAPH_SAFE_BACKENDS for CUDA graphs).
        kv_caches: per layer (key [N+1, block_size, Hkv, D], value [N+1, block_size, Hkv, Dv]); block N is null.
        block_size: tokens per KV block. null_block: the null block's id (N).
        max_blocks_per_seq: block-table columns (max_model_len / block_size, rounded up).
        max_num_seqs: the scheduler's bound on rows per step (buckets go up to min(it, 512)).
        device: where the model and cache live.
        cuda_graphs: capture CUDA graphs (default: on CUDA); False "captures" by remembering the call, which is
            how tests run this runner on the CPU.
    Raises:
        ValueError: CUDA graphs asked for off CUDA, or with a backend that reads host lists.
    """

    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 block_size: int, null_block: int, max_blocks_per_seq: int, max_num_seqs: int,
                 device: torch.device, cuda_graphs: bool | None = None):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.block_size, self.null_block, self.device = block_size, null_block, device
        self.cuda_graphs = device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.graph_safe = backend.name in GRAPH_SAFE_BACKENDS
        if self.cuda_graphs and not self.graph_safe:
            raise ValueError(f"the {backend.name} attention backend reads host lists in its forward, so it cannot "
                             f"be captured in a CUDA graph (use one of {', '.join(sorted(GRAPH_SAFE_BACKENDS))})")
        if self.cuda_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.sizes = capture_sizes(max_num_seqs)
        self.max_bs = max_bs = self.sizes[-1]
        self.null_slot = null_block * block_size  # offset 0 of the null block: where padding rows write
        long, int32 = torch.long, torch.int32
        self.input_ids = torch.zeros(max_bs, dtype=long, device=device)
        self.positions = torch.zeros(max_bs, dtype=long, device=device)
        self.slot_mapping = torch.full((max_bs,), self.null_slot, dtype=long, device=device)
        self.seq_lens = torch.ones(max_bs, dtype=int32, device=device)
        self.block_table = torch.full((max_bs, max_blocks_per_seq), null_block, dtype=int32, device=device)
        self.query_start_loc = torch.arange(max_bs + 1, dtype=int32, device=device)  # decodes: row b is token b
        self.logits: torch.Tensor | None = None  # [max_bs, vocab], allocated by the first (largest) warm-up
        self._buffers = (self.input_ids, self.positions, self.slot_mapping, self.seq_lens, self.block_table)
        pin = device.type == "cuda"
        self._host = tuple(torch.empty_like(b, device="cpu").pin_memory() if pin else torch.empty_like(b, device="cpu")
                           for b in self._buffers)
        self._copied = torch.cuda.Event() if pin else None  # the last H2D copies: host mirrors are free once done
        self._seq_lens_lists: dict[int, list[int]] = {}  # host lists per bucket (non-graph-safe backends only)
        self._steps = {size: StepAttention(self._metadata(size), kv_caches, backend) for size in self.sizes}
        self._graphs: dict[int, Callable[[], object]] = {}  # bucket -> its replay
        self.pool: torch.cuda._POOL_HANDLE | None = None
        self.capture_seconds = 0.0

    def _metadata(self, size: int) -> AttentionMetadata:
        """Bucket `size`'s metadata over slices of the static buffers (host lists: placeholders, or for a backend
        that reads them on the CPU, lists refilled in place by each step)."""
        if self.graph_safe:
            # stand-ins for the lists, typed as them: a graph-safe backend never reads them, and any read raises
            starts = cast(list[int], HostListUnavailable("query_start_list"))
            lens = cast(list[int], HostListUnavailable("seq_lens_list"))
        else:
            starts, lens = list(range(size + 1)), [1] * size
            self._seq_lens_lists[size] = lens
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size], slot_mapping=self.slot_mapping[:size], num_decodes=size,
            max_query_len=1, max_seq_len=self.block_table.shape[1] * self.block_size,  # a bound; read by no backend
            query_start_list=starts, seq_lens_list=lens)

    # --- which steps -------------------------------------------------------------------------------------------

    def bucket(self, num_rows: int) -> int | None:
        """The captured batch size a step of `num_rows` decode rows replays, None when it runs eagerly."""
        return bucket_for(num_rows, self.sizes)

    def can_run(self, inputs: StepInputs) -> bool:
        """Whether this step replays a graph: every row has exactly one query token, no row asks for prompt
        logprobs or runs through a LoRA adapter (those steps run eagerly), and a bucket holds the rows (after
        capture())."""
        meta = inputs.attention
        rows = meta.seq_lens.shape[0]
        return (bool(self._graphs) and meta.num_decodes == rows and not inputs.prompt_rows
                and inputs.token_slots is None and self.bucket(rows) is not None)

    # --- capture and replay ------------------------------------------------------------------------------------

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first, into one pool (the buffers hold padding rows only, so
        nothing but the null block is written)."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._fill_padding(0, size)
            self._forward(size)  # eager warm-up: compiles flex for this shape on CUDA, allocates the logits
            if self.cuda_graphs:
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._forward(size)
                self.pool = graph.pool() if self.pool is None else self.pool
                self._graphs[size] = graph.replay
            else:
                self._graphs[size] = functools.partial(self._forward, size)
        if self.cuda_graphs:
            torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - start

    def _forward(self, size: int) -> None:
        """The model over the first `size` static rows; logits into self.logits[:size]. What a graph records."""
        self.backend.begin_step()
        output = self.model(input_ids=self.input_ids[:size].unsqueeze(0),
                            position_ids=self.positions[:size].unsqueeze(0), logits_to_keep=0, use_cache=False,
                            paged_attention=self._steps[size])
        logits = output.logits[0]  # [size, vocab]
        if self.logits is None:
            self.logits = torch.empty(self.max_bs, logits.shape[-1], dtype=logits.dtype, device=self.device)
        self.logits[:size].copy_(logits)
        self.backend.begin_step()  # drop the step's masks: nothing made inside the forward outlives it

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """Replay the bucket of a decode-only step (can_run(inputs) must hold).

        Returns:
            logits [S, vocab] at the step's S sampling rows (a view of the static logits when every row samples,
            valid until the next step), on the device.
        """
        meta = inputs.attention
        rows = meta.seq_lens.shape[0]
        size = self.bucket(rows)
        assert size is not None and self.logits is not None  # can_run(inputs): a bucket holds it, captured
        self._fill(inputs, rows, size)
        self._graphs[size]()
        sample_rows = inputs.sample_rows
        if sample_rows.shape[0] == rows:  # decode rows sample in row order: rows 0 .. B-1
            return self.logits[:rows]
        return self.logits.index_select(0, sample_rows.to(self.device, non_blocking=True))

    def _fill(self, inputs: StepInputs, rows: int, size: int) -> None:
        """The step's B rows into the host mirrors, padding rows after them up to `size`, then to the device."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies have read the mirrors (the sample sync implies it)
        meta = inputs.attention
        ids, positions, slots, lens, table = self._host
        ids[:rows].copy_(inputs.input_ids)
        positions[:rows].copy_(inputs.positions)
        slots[:rows].copy_(meta.slot_mapping)
        lens[:rows].copy_(meta.seq_lens)
        table[:size].fill_(self.null_block)
        table[:rows, :meta.block_table.shape[1]].copy_(meta.block_table)
        self._pad_host(rows, size)
        for device_buffer, host in zip(self._buffers, self._host):
            device_buffer[:size].copy_(host[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if not self.graph_safe:
            self._seq_lens_lists[size][:rows] = meta.seq_lens_list
            self._seq_lens_lists[size][rows:] = [1] * (size - rows)

    def _pad_host(self, first: int, size: int) -> None:
        """Host rows first .. size-1 become padding: token 0 at position 0, seq_len 1, the null block's first slot
        (the block-table rows are already null)."""
        ids, positions, slots, lens, _ = self._host
        ids[first:size] = 0
        positions[first:size] = 0
        slots[first:size] = self.null_slot
        lens[first:size] = 1

    def _fill_padding(self, first: int, size: int) -> None:
        """Rows first .. size-1 of the device buffers (and their host mirrors) become padding rows."""
        self._host[4][first:size].fill_(self.null_block)
        self._pad_host(first, size)
        for device_buffer, host in zip(self._buffers, self._host):
            device_buffer[first:size].copy_(host[first:size])
        if not self.graph_safe:
            self._seq_lens_lists[size][first:] = [1] * (size - first)


def graphs_off_reason(device: torch.device, config, backend_name: str, tensor_parallel: bool) -> str | None:
    """Why decode steps will not replay CUDA graphs on this worker, or None when graph_runner_for captures them
    (the KV sizing keeps the graph pool's allowance back exactly then)."""
    if device.type != "cuda":
        return "not on CUDA"
    if config.worker.enforce_eager:
        return "--enforce-eager"
    if backend_name not in GRAPH_SAFE_BACKENDS:
        return f"the {backend_name} attention backend cannot be captured (flex can)"
    if tensor_parallel:
        return "tensor parallel: its collectives are not captured yet"
    return None


class GraphCaptureError(RuntimeError):
    """The decode CUDA graphs could not be built or captured on this device (the message names --enforce-eager)."""


def graph_runner_for(runner, config) -> DecodeGraphRunner | None:
    """The ModelRunner's captured decode graphs, or None where they do not apply (logged): not on CUDA,
    --enforce-eager, a backend that cannot be captured, or tensor parallel (its collectives are not captured yet).

    Args:
        runner: a worker.worker.ModelRunner with its KV cache allocated (graphs are captured after it, in the
            memory the KV sizing left over).
        config: the ShuttleConfig it was built from.
    Raises:
        GraphCaptureError: building or capturing the graphs raised.
    """
    reason = graphs_off_reason(runner.device, config, runner.backend.name, runner.parallel.enabled)
    if reason is not None:
        if runner.device.type == "cuda":
            log.info("CUDA graphs off (%s): every step runs eagerly", reason)
        return None
    kv = runner.kv_cache
    try:
        graphs = DecodeGraphRunner(runner.model, runner.backend, kv.layers, runner.block_size, kv.null_block,
                                   -(-config.model.max_model_len // runner.block_size), config.scheduler.max_num_seqs,
                                   runner.device)
        graphs.capture()
    except Exception as exc:  # one clear line at start-up (the worker exits 2), not a traceback on every restart
        raise GraphCaptureError(f"capturing the decode CUDA graphs failed ({type(exc).__name__}: {exc}); "
                                "--enforce-eager serves without them") from exc
    log.info("captured %d CUDA graphs for decode steps (batch sizes %s) in %.1f s", len(graphs.sizes),
             ", ".join(map(str, graphs.sizes)), graphs.capture_seconds)
    return graphs
