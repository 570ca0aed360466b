"""Decode-only steps on the CPU through the model forward compiled by torch.compile (inductor's C++ backend).

Why. On a CPU a decode step at a few rows is a few milliseconds of weight streaming (the linears) plus a long tail
of small operators and Python: each decoder layer's RMSNorms, rotary embedding, residual adds, SiLU-and-multiply and
views are a dozen eager torch calls and module calls, each costing microseconds of dispatch for nanoseconds of
arithmetic. Compiled, those fuse into a few C++ loops per layer and the Python disappears from the step; the
linears (worker/onednn_linear.py, already oneDNN on reordered weights) and the paged decode kernel
(worker/decode_kernel.py, registered as the operator `shuttle::paged_decode`) stay opaque calls inside the graph.
vLLM's CPU backend compiles its forward the same way. On the 110M Llama shape (2 cores, Zen 5, one row, in-engine
forward, eager and compiled interleaved in one process) the step took 9.4 against 11.8 ms in bfloat16 and 15.8
against 18.4 ms in float32.

Which steps. A step whose rows are all decodes of one token, with no prompt logprobs and no LoRA adapter row (the
same steps CUDA graphs replay, worker/graph_runner.py); every other step runs the eager forward. Rows are not
padded to buckets: the batch and the block table's width are dynamic dimensions, so one graph serves every batch of
2 rows and more and one serves a single row (torch specializes a dimension of size 1), both compiled at start-up
(`warm_up`); a block table of one column is padded to two with the null block for the same reason. After warm-up a
step never compiles (tests/engine/test_cpu_compiled_decode.py serves a spread of shapes under torch's
fail-on-recompile stance); were one to need it, it would run eagerly instead (SERVING_STANCE).

With --enable-lora, steps without an adapter row run compiled: the graph traces the LoRA layers' base-model path,
which reads no adapter weights, so loading adapters changes nothing it traced.

When it is off, said once at start-up: --enforce-eager; not on the CPU; an attention backend other than `cpu`;
bfloat16 linears widened by numba (a CPU without bf16 units); tensor parallel; no C++ compiler on the machine; or
the compile or its check failing.

Exactness. inductor is told to round to the model's dtype wherever eager torch rounds (`emulate_precision_casts`;
by default it keeps float32 across fused operators): in bfloat16 a compiled step's logits then equal the eager
forward's bit for bit in most shapes (stories260K at 1, 3 and 5 rows; the 110M shape at 1 and 5, within 0.03 in
a logit at 3), so a request's tokens do not depend on whether its steps ran compiled or eagerly, which the other
requests decide (without it, the first of four identical greedy requests diverged from the other three). In
float32 reductions may still sum in another order (logits within 1e-5). At warm-up both
forwards run the same rows (random tokens at several positions over two cache blocks, before any request exists)
and their log-probabilities must agree within the start-up exactness check's tolerance (worker/capability.py
`path_tolerance`: the model's dtype's, the bfloat16 one with int8 linears or a KV cache of another dtype);
otherwise the worker serves eagerly and says so. The engine tests hold greedy output token for token against
transformers' `generate` on this path.
"""

from __future__ import annotations

import logging
import shutil
import time
from typing import cast

import torch
import torch.nn.functional as F

from shuttle.worker.attention import AttentionMetadata, StepAttention
from shuttle.worker.capability import log_prob_difference, path_tolerance
from shuttle.worker.graph_runner import HostListUnavailable
from shuttle.worker.input_batch import StepInputs

log = logging.getLogger("shuttle.worker")

# What a step does whose shapes the warm-up's graphs do not cover (none should: the tests serve under
# "fail_on_recompile"): run eagerly rather than stall every request for a compile.
SERVING_STANCE = "eager_on_recompile"
MIN_TABLE_COLUMNS = 2  # a width-1 block table is padded: torch would specialize a size-1 dimension (module docstring)
_CHECK_ROWS = (1, 3)  # warm-up batches: the single-row graph, then the dynamic one


class CompiledCpuDecode:
    """Runs decode-only steps through the compiled model forward (module docstring).

    Args:
        model: the transformers model, loaded with shuttle's paged attention, linears already swapped.
        backend: the `cpu` attention backend.
        kv_caches: per layer (key, value) caches; block `null_block` is the null block.
        null_block: the null block's id (padding columns of the block table point there).
        block_size: tokens per KV block.
    """

    def __init__(self, model: torch.nn.Module, backend, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 null_block: int, block_size: int):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.null_block, self.block_size = null_block, block_size
        for key_cache, value_cache in kv_caches:  # one graph whatever the block count: an on-disk cache hit
            torch._dynamo.maybe_mark_dynamic(key_cache, 0)  # for every --kv-cache-memory of the same model
            torch._dynamo.maybe_mark_dynamic(value_cache, 0)
        # inductor rounds to the model's dtype wherever eager torch rounds (it keeps float32 across fused operators
        # by default): a bfloat16 step then equals the eager one bit for bit in most shapes, so a request's tokens do
        # not depend on whether its steps ran compiled or eagerly (which other requests decide)
        self._compiled = torch.compile(self._forward, fullgraph=True, options={"emulate_precision_casts": True})
        self._serving = self._compiled  # after warm_up: the compiled forward under SERVING_STANCE
        self.compile_seconds = 0.0
        self.difference = 0.0  # log-prob difference from the eager forward at warm-up (nats, as TOLERANCE)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 seq_lens: torch.Tensor, block_table: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """The model over B decode rows: int64 ids, positions and slots [B], int32 seq_lens [B], block table [B, W]
        and query_start_loc [B+1]; returns logits [B, vocab]. What torch.compile traces."""
        rows = input_ids.shape[0]
        meta = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=seq_lens, block_table=block_table, slot_mapping=slot_mapping,
            num_decodes=rows, max_query_len=1, max_seq_len=block_table.shape[1] * self.block_size,  # a bound
            query_start_list=cast(list[int], HostListUnavailable("query_start_list")),
            seq_lens_list=cast(list[int], HostListUnavailable("seq_lens_list")))
        output = self.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0), logits_to_keep=0,
                            use_cache=False, paged_attention=StepAttention(meta, self.kv_caches, self.backend))
        return output.logits[0]

    def can_run(self, inputs: StepInputs) -> bool:
        """Whether this step runs compiled: every row a one-token decode, no prompt logprobs, no LoRA row."""
        meta = inputs.attention
        return (meta.num_decodes == meta.seq_lens.shape[0] and not inputs.prompt_rows
                and inputs.token_slots is None)

    def _call(self, forward, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
              ) -> torch.Tensor:
        table = meta.block_table
        if table.shape[1] < MIN_TABLE_COLUMNS:
            table = F.pad(table, (0, MIN_TABLE_COLUMNS - table.shape[1]), value=self.null_block)
        args = (input_ids, positions, meta.slot_mapping, meta.seq_lens, table, meta.query_start_loc)
        for tensor in args:  # batch (and table width) dynamic from the first compile on: no graph per size
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
        torch._dynamo.maybe_mark_dynamic(table, 1)
        self.backend.begin_step()
        return forward(*args)

    def run(self, inputs: StepInputs) -> torch.Tensor:
        """The compiled forward over a decode-only step (can_run(inputs) must hold).

        Returns:
            logits [S, vocab] at the step's S sampling rows.
        """
        logits = self._call(self._serving, inputs.input_ids, inputs.positions, inputs.attention)
        sample_rows = inputs.sample_rows
        if sample_rows.shape[0] == logits.shape[0]:  # decode rows sample in row order
            return logits
        return logits.index_select(0, sample_rows)

    @torch.inference_mode()
    def warm_up(self, num_blocks: int, tolerance: float, vocab: int) -> None:
        """Compile both graphs over check rows and compare them with the eager forward (module docstring): their
        log-probabilities must agree within `tolerance` (nats, capability.path_tolerance: the start-up exactness
        check's, measured as it measures). `vocab`: the model's vocabulary size (the check rows' tokens are drawn
        below it).

        The check rows write K and V into cache blocks 0 and 1, which hold junk until requests write them (no block
        is a prefix-cache hit before a request has written it).

        Raises:
            RuntimeError: the compiled forward's log-probabilities differ from the eager forward's by more than
                `tolerance`.
        """
        began = time.perf_counter()
        generator = torch.Generator().manual_seed(0)
        blocks = [0, 1] if num_blocks >= 2 else [0]
        difference = 0.0
        for rows in _CHECK_ROWS:
            meta, input_ids, positions = _check_step(rows, blocks, self.block_size, self.null_block, vocab,
                                                     generator)
            eager = self._call(self._forward, input_ids, positions, meta)
            # torch counts the compiles of one code object against recompile_limit (8) and, with fullgraph, fails
            # past it; every instance's graphs live on `_forward`'s code (an engine of a configuration met before
            # reuses them), so a process building engines of many configurations (dtype, model shape, thread count:
            # a test process, a notebook) reached it and served eagerly. The limit is against runaway recompiles in
            # a loop, which cannot happen here: graphs are compiled only in this warm-up, served under
            # SERVING_STANCE. Only torch's process-wide cap applies.
            with torch._dynamo.config.patch(recompile_limit=torch._dynamo.config.accumulated_recompile_limit):
                compiled = self._call(self._compiled, input_ids, positions, meta)
            difference = max(difference, log_prob_difference(compiled.float().log_softmax(-1),
                                                             eager.float().log_softmax(-1), tolerance))
        self.compile_seconds = time.perf_counter() - began
        self.difference = difference
        if difference > tolerance:
            raise RuntimeError(f"its log-probabilities differ from the eager forward's by {difference:.3g} nats")
        self._serving = torch.compiler.set_stance(SERVING_STANCE)(self._compiled)


def _check_step(rows: int, blocks: list[int], block_size: int, null_block: int, vocab: int,
                generator: torch.Generator) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Decode rows for the warm-up check: random tokens at distinct positions over `blocks` (every row's table
    names them; each row writes its own slot and reads the slots before it)."""
    span = len(blocks) * block_size
    positions = torch.tensor([(span - 1 - 3 * row) % span for row in range(rows)], dtype=torch.long)
    table = torch.tensor(blocks + [null_block] * (MIN_TABLE_COLUMNS - len(blocks)), dtype=torch.int32)
    table = table.unsqueeze(0).expand(rows, -1).contiguous()
    slots = table[torch.arange(rows), positions // block_size].long() * block_size + positions % block_size
    seq_lens = (positions + 1).to(torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32), seq_lens=seq_lens, block_table=table,
        slot_mapping=slots, num_decodes=rows, max_query_len=1, max_seq_len=int(seq_lens.max()),
        query_start_list=list(range(rows + 1)), seq_lens_list=seq_lens.tolist())
    return meta, torch.randint(3, vocab, (rows,), generator=generator), positions


def compiled_decode_off_reason(device: torch.device, config, backend_name: str, widened_linears: int,
                               tensor_parallel: bool) -> str | None:
    """Why decode steps on this worker will not run compiled on the CPU, or None when compiled_decode_for compiles
    them. `widened_linears`: bfloat16 linear layers computed in float32 by worker/output_projection.py (a CPU
    without bf16 units)."""
    if device.type != "cpu":
        return "not on the CPU"
    if config.worker.enforce_eager:
        return "--enforce-eager"
    if backend_name != "cpu":
        return f"--attention-backend {backend_name}: only the cpu backend's decode kernel is compiled in"
    if widened_linears:
        return "bfloat16 linears widened to float32 by numba on a CPU without bf16 units, which inductor cannot trace"
    if tensor_parallel:
        return "tensor parallel"
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler (c++ or g++) on PATH for torch's inductor"
    return None


def compiled_decode_for(runner, config) -> CompiledCpuDecode | None:
    """The ModelRunner's compiled CPU decode forward, warmed up and checked, or None where it does not apply or
    failed (logged once, with the reason: every step then runs eagerly).

    Args:
        runner: a worker.worker.ModelRunner with its KV cache allocated.
        config: the ShuttleConfig it was built from.
    """
    reason = compiled_decode_off_reason(runner.device, config, runner.backend.name, runner.cpu_linears.widened,
                                        runner.parallel.enabled)
    if reason is not None:
        if runner.device.type == "cpu":
            log.info("compiled CPU decode off (%s): every step runs eagerly", reason)
        return None
    kv = runner.kv_cache
    compiled = CompiledCpuDecode(runner.model, runner.backend, kv.layers, kv.null_block, runner.block_size)
    try:
        compiled.warm_up(kv.num_blocks, path_tolerance(runner), runner.model.get_output_embeddings().weight.shape[0])
    except Exception as exc:  # a slower server, not a wrong or a dead one: say why once and serve eagerly
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("compiled CPU decode off (%s: %s): every step runs eagerly", type(exc).__name__, first_line)
        return None
    log.info("compiled the CPU decode forward (1 row, and 2 or more) in %.1f s; it matches the eager forward "
             "within %.2g nats", compiled.compile_seconds, compiled.difference)
    return compiled
