"""worker/graph_runner.py's DecodeGraphRunner on the CPU, where its "capture" remembers the forward and its "replay"
calls it on the static buffers: bucket choice, padding rows, refilling the buffers across batch sizes, the null
block as the only block padding writes, replay against the eager forward (flex, cpu and reference backends), and
the in-process engine with the runner forced on against transformers token for token.

What only a GPU can check (scripts/gpu_check.sh): the torch.cuda.graph capture itself, the pool, and that the
transformers forward and compiled flex launch no host sync under capture.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.model_config import ModelConfig
from shuttle.launcher.cli import build_parser
from shuttle.worker import flex_attention as fx
from shuttle.worker import graph_runner as gr
from shuttle.worker.attention import StepAttention, paged_attention_forward
from shuttle.worker.attention_backends import make_backend
from shuttle.worker.input_batch import StepInputs
from tests.engine.test_flex_attention import make_cache, make_step

NUM_BLOCKS, BLOCK_SIZE, WIDTH = 300, 16, 8  # the cache, and the block-table width (max_model_len 128)
HEADS, KV_HEADS, DIM, VOCAB = 4, 2, 8, 50


def test_capture_sizes_and_bucket_choice():
    sizes = gr.capture_sizes(1000)
    assert sizes[:6] == [1, 2, 4, 8, 16, 32] and sizes[-1] == 512 and len(sizes) == 4 + 32
    assert gr.capture_sizes(100)[-1] == 96 and gr.capture_sizes(5) == [1, 2, 4] and gr.capture_sizes(1) == [1]
    sizes = gr.capture_sizes(64)
    assert [gr.bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33, 64)] == [1, 2, 4, 8, 8, 16, 16, 32, 48, 64]
    assert gr.bucket_for(65, sizes) is None and gr.bucket_for(5, [1, 2, 4]) is None  # above the largest: eager
    assert all(gr.bucket_for(n, sizes) == fx.decode_bucket(n) for n in range(1, 65))  # flex pads to the same sizes


class AttentionOnly(torch.nn.Module):
    """A one-layer stand-in for a model, called as ModelRunner calls one: q, k and v are embedding lookups of the
    input ids (no matmul whose rounding could depend on the batch size), the "logits" the attention output
    [1, T, HEADS * DIM], so padded and unpadded rows can be compared bit for bit."""

    layer_idx = 0

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.q, self.k, self.v = (torch.randn(VOCAB, h, DIM, generator=g) for h in (HEADS, KV_HEADS, KV_HEADS))
        self.calls = 0

    def forward(self, input_ids, position_ids, logits_to_keep, use_cache, paged_attention):
        self.calls += 1
        ids = input_ids[0]
        q, k, v = (table[ids].transpose(0, 1).unsqueeze(0) for table in (self.q, self.k, self.v))  # [1, H, T, D]
        out, _ = paged_attention_forward(self, q, k, v, None, scaling=0.3, paged_attention=paged_attention)
        return SimpleNamespace(logits=out.flatten(2))  # [1, T, HEADS * DIM]


def decode_inputs(lengths, seed=0) -> StepInputs:
    """A decode-only step: one row per context length (its new token included), random blocks and token ids."""
    meta = make_step([(n - 1, 1) for n in lengths], NUM_BLOCKS, BLOCK_SIZE, seed=seed)
    ids = torch.tensor([random.Random(seed + i).randrange(VOCAB) for i in range(len(lengths))])
    positions = meta.seq_lens.long() - 1
    rows = torch.arange(len(lengths))
    return StepInputs(ids, positions, meta, rows, [None] * len(lengths))


def eager(model, backend, caches, inputs):
    """The eager forward on the unpadded step (what ModelRunner.forward does): [B, HEADS * DIM]."""
    backend.begin_step()
    return model(input_ids=inputs.input_ids.unsqueeze(0), position_ids=inputs.positions.unsqueeze(0),
                 logits_to_keep=0, use_cache=False,
                 paged_attention=StepAttention(inputs.attention, caches, backend)).logits[0]


def make_runner(backend_name="flex", max_num_seqs=32):
    model = AttentionOnly()
    backend = make_backend(backend_name, BLOCK_SIZE, torch.device("cpu"))
    keys, values = make_cache(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, DIM, DIM, torch.float32)  # null block poisoned
    caches = [(keys, values)]
    runner = gr.DecodeGraphRunner(model, backend, caches, BLOCK_SIZE, NUM_BLOCKS, WIDTH, max_num_seqs,
                                  torch.device("cpu"))
    assert not runner.cuda_graphs  # the CPU default: plain calls
    return runner, model, backend, caches


def clone(caches):
    return [(k.clone(), v.clone()) for k, v in caches]


BACKENDS = ["flex", "cpu", "reference"]


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_padding_rows_change_no_real_row_and_write_only_the_null_block(backend_name):
    runner, model, backend, caches = make_runner(backend_name)
    with torch.inference_mode():
        runner.capture()
        assert sorted(runner._graphs) == runner.sizes == [1, 2, 4, 8, 16, 32]
        for lengths in ([17, 1, 40], [5, 64, 33, 16, 2], [9] * 9):  # buckets 4, 8 and 16
            inputs = decode_inputs(lengths, seed=len(lengths))
            before = clone(caches)
            reference_caches = clone(caches)
            want = eager(model, backend, reference_caches, inputs)
            assert runner.can_run(inputs)
            got = runner.run(inputs)
            assert got.shape == want.shape and torch.equal(got, want), "real rows padded == unpadded, bit for bit"
            size = runner.bucket(len(lengths))
            assert size > len(lengths) and torch.isfinite(runner.logits[:size]).all()
            for (k, v), (rk, rv), (bk, bv) in zip(caches, reference_caches, before):
                assert torch.equal(k[:NUM_BLOCKS], rk[:NUM_BLOCKS]) and torch.equal(v[:NUM_BLOCKS], rv[:NUM_BLOCKS])
                assert torch.equal(k[NUM_BLOCKS, 1:], bk[NUM_BLOCKS, 1:]), "padding writes only the null slot"
                assert torch.equal(v[NUM_BLOCKS, 1:], bv[NUM_BLOCKS, 1:]), "padding writes only the null slot"
                assert torch.equal(k[NUM_BLOCKS, 0], model.k[0]) and torch.equal(v[NUM_BLOCKS, 0], model.v[0])


def test_static_buffers_refilled_across_batch_sizes():
    """One runner serves steps of varying sizes in one bucket and across buckets from the same buffers (the same
    storage every step, as a replayed graph needs), and each step equals the eager forward."""
    runner, model, backend, caches = make_runner("flex")
    addresses = [b.data_ptr() for b in runner._buffers]
    with torch.inference_mode():
        runner.capture()
        logits_address = runner.logits.data_ptr()
        calls = model.calls
        rng = random.Random(3)
        for step, rows in enumerate([5, 7, 3, 8, 6, 1, 2, 12, 20, 4, 32]):
            inputs = decode_inputs([rng.randrange(1, WIDTH * BLOCK_SIZE + 1) for _ in range(rows)], seed=step)
            want = eager(model, backend, clone(caches), inputs)
            got = runner.run(inputs)
            assert torch.equal(got, want)
            assert got.data_ptr() == logits_address  # a view of the static logits
            size = runner.bucket(rows)
            assert torch.equal(runner.seq_lens[rows:size], torch.ones(size - rows, dtype=torch.int32))
            assert (runner.block_table[rows:size] == NUM_BLOCKS).all()
            assert (runner.slot_mapping[rows:size] == NUM_BLOCKS * BLOCK_SIZE).all()
    assert [b.data_ptr() for b in runner._buffers] == addresses and runner.logits.data_ptr() == logits_address
    assert model.calls == calls + 11 * 2  # one replay per step (plus the eager reference)


def test_what_runs_eagerly():
    runner, model, backend, caches = make_runner("flex", max_num_seqs=20)
    assert runner.sizes == [1, 2, 4, 8, 16]
    inputs = decode_inputs([3, 4])
    assert not runner.can_run(inputs), "nothing to replay before capture()"
    with torch.inference_mode():
        runner.capture()
    assert runner.can_run(inputs)
    assert not runner.can_run(decode_inputs([3] * 17)), "more rows than the largest bucket"
    mixed = make_step([(3, 1), (0, 5)], NUM_BLOCKS, BLOCK_SIZE)
    assert not runner.can_run(StepInputs(torch.zeros(6, dtype=torch.long), torch.zeros(6, dtype=torch.long), mixed,
                                         torch.tensor([0, 5])))
    inputs.prompt_rows.append((None, 0, [0], [1]))
    assert not runner.can_run(inputs), "prompt logprobs need the eager path's extra logits rows"


def test_rows_that_do_not_all_sample():
    """A step of one-token rows where one is a prompt chunk that does not reach its end: replayed, and only the
    sampling rows' logits come back."""
    runner, model, backend, caches = make_runner("flex")
    inputs = decode_inputs([10, 20, 30])
    inputs = StepInputs(inputs.input_ids, inputs.positions, inputs.attention, torch.tensor([0, 2]), [None, None])
    with torch.inference_mode():
        runner.capture()
        want = eager(model, backend, clone(caches), inputs)
        assert torch.equal(runner.run(inputs), want[[0, 2]])


def test_graph_mode_reads_no_host_list():
    """In graph mode the metadata's host lists are placeholders that raise when read (a captured graph would replay
    whatever a backend read there at capture time); flex never reads them."""
    runner, *_ = make_runner("flex")
    meta = runner._steps[4].metadata
    for host_list in (meta.query_start_list, meta.seq_lens_list):
        with pytest.raises(RuntimeError, match="not available in a captured or compiled decode step"):
            len(host_list)
        with pytest.raises(RuntimeError):
            host_list[0]
    with pytest.raises(ValueError, match="reads host lists"):
        gr.DecodeGraphRunner(AttentionOnly(), make_backend("reference", 16, torch.device("cpu")), [], 16, 0, 1, 4,
                             torch.device("cpu"), cuda_graphs=True)
    with pytest.raises(ValueError, match="need a CUDA device"):
        gr.DecodeGraphRunner(AttentionOnly(), make_backend("flex", 16, torch.device("cpu")), [], 16, 0, 1, 4,
                             torch.device("cpu"), cuda_graphs=True)


def test_a_failed_capture_is_one_clear_error_naming_enforce_eager(monkeypatch):
    """Building or capturing the graphs raising (here: CUDA buffers on a machine without CUDA) becomes
    GraphCaptureError, which the worker reports in one line before exiting 2."""
    monkeypatch.setattr(gr.DecodeGraphRunner, "capture", lambda self: pytest.fail("capture after a failed build"))
    kv = SimpleNamespace(layers=[], null_block=0)
    runner = SimpleNamespace(device=torch.device("cuda"), backend=SimpleNamespace(name="flex"), kv_cache=kv,
                             parallel=SimpleNamespace(enabled=False), model=AttentionOnly(), block_size=16)
    config = SimpleNamespace(worker=WorkerConfig(), model=SimpleNamespace(max_model_len=64),
                             scheduler=SchedulerConfig(max_num_seqs=4))
    with pytest.raises(gr.GraphCaptureError, match="--enforce-eager serves without them"):
        gr.graph_runner_for(runner, config)


def test_enforce_eager_flag():
    args = build_parser().parse_args(["serve", "model", "--enforce-eager"])
    assert args.enforce_eager is True
    assert build_parser().parse_args(["serve", "model"]).enforce_eager is False
    assert WorkerConfig().enforce_eager is False


# --- the real model -------------------------------------------------------------------------------------------


class CheckedGraphs(gr.DecodeGraphRunner):
    """The runner, with each replayed step checked against the eager forward of the same step (run first, on a copy
    of the cache, so the graph path's own writes are the ones that stay), and the replays counted per bucket."""

    def __init__(self, runner, config, tolerance):
        kv = runner.kv_cache
        super().__init__(runner.model, runner.backend, kv.layers, runner.block_size, kv.null_block,
                         -(-config.model.max_model_len // runner.block_size), config.scheduler.max_num_seqs,
                         runner.device)
        self.model_runner, self.tolerance, self.replays = runner, tolerance, {}

    def run(self, inputs):
        want = self.model_runner.forward(inputs, clone(self.kv_caches), inputs.logits_rows)
        got = super().run(inputs)
        assert (got - want).abs().max() <= self.tolerance
        size = self.bucket(inputs.attention.seq_lens.shape[0])
        self.replays[size] = self.replays.get(size, 0) + 1
        return got


@pytest.mark.parametrize("backend_name", ["flex", "cpu"])
def test_engine_greedy_with_the_runner_forced_on_matches_transformers(backend_name):
    """The in-process engine (scheduler + ModelRunner) on stories260K with the graph runner forced on: decode-only
    steps replay the static buffers in several buckets and equal the eager forward; mixed steps and chunked
    prefills run eagerly; every output equals transformers' greedy generate token for token."""
    from shuttle.scheduler.kv_cache import KVCacheManager
    from shuttle.scheduler.scheduler import Scheduler
    from shuttle.worker.worker import ModelRunner
    from tests.conftest import hf_greedy
    from tests.engine.test_engine_inprocess import greedy_outputs
    from tests.server import MODEL_DIR

    num_blocks, block_size = 60, 16
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(block_size, num_blocks),
                           scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48),
                           worker=WorkerConfig(attention_backend=backend_name, enforce_eager=True))
    runner = ModelRunner(config)
    assert runner.graphs is None  # eager: no graphs, no compiled decode
    runner.graphs = CheckedGraphs(runner, config, tolerance=1e-4)
    with torch.inference_mode():
        runner.graphs.capture()
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, block_size, True), model.max_model_len,
                          model.eos_token_ids)
    rng = random.Random(4)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(rng.randrange(2, 40))] for _ in range(8)]
    max_tokens = [rng.randrange(6, 24) for _ in prompts]
    outputs, _ = greedy_outputs(scheduler, runner, prompts, max_tokens, first_alone=False)
    assert outputs == [hf_greedy(prompt, m) for prompt, m in zip(prompts, max_tokens)]
    replays = runner.graphs.replays
    assert len(replays) >= 3 and 8 in replays, replays  # bucket 8 (8 rows), then the smaller ones as rows finish


HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


def test_captured_forward_reads_no_tensor_on_the_host(monkeypatch):
    """The decode forward of the real model (stories260K, flex), run as under capture, turns no tensor into a Python
    value (.item(), .tolist(), bool(), int(), ...: each a host sync on CUDA, which capture refuses). Flex is traced
    by dynamo as on CUDA (backend "eager": eager flex reads its scale back internally, the traced call does not).
    transformers skips its one such read, the packed-sequence probe of the position ids, while a CUDA stream
    captures, so this pretends one does."""
    from shuttle.worker.worker import ModelRunner
    from tests.server import MODEL_DIR

    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(16, 40), scheduler=SchedulerConfig(max_num_seqs=8),
                           worker=WorkerConfig(attention_backend="flex"))
    runner = ModelRunner(config)
    kv = runner.kv_cache
    backend = fx.FlexBackend(16, compile_backend="eager")
    graphs = gr.DecodeGraphRunner(runner.model, backend, kv.layers, 16, kv.null_block, 8, 8, runner.device)
    reads = []

    def refuse(name):
        def read(self, *args, **kwargs):
            reads.append(name)
            raise AssertionError(f"Tensor.{name} inside the captured forward")
        return read

    with torch.inference_mode():
        graphs.capture()
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}
        try:
            for name in HOST_READS:
                setattr(torch.Tensor, name, refuse(name))
            graphs._graphs[8]()
        finally:
            for name, method in originals.items():
                setattr(torch.Tensor, name, method)
    assert reads == [] and torch.isfinite(graphs.logits[:8]).all()
