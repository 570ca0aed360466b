"""The `flex` attention backend (worker/flex_attention.py) against `reference`, on hand-built steps over a random
paged cache whose null block is poisoned, and the in-process engine with `--attention-backend flex` against
transformers token for token.

Eager flex ignores the BlockMask's block lists and evaluates mask_mod everywhere, so output equality alone cannot
catch a wrong list; the block-list tests check what the compiled kernel relies on instead: every slot mask_mod
admits lies in a listed block, and a block listed full is admitted wholly.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.model_config import ModelConfig
from shuttle.launcher.cli import build_parser
from shuttle.worker import flex_attention as fx
from shuttle.worker import flex_masks as fm
from shuttle.worker.attention import AttentionMetadata, LayerFeatures
from shuttle.worker.attention_backends import ReferenceBackend, make_backend


def make_cache(num_blocks, block_size, kv_heads, head_dim, v_head_dim, dtype, seed=0):
    """Random K/V [N+1, bs, Hkv, *]; the null block (N) holds huge values, so reading it shows."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(num_blocks + 1, block_size, kv_heads, head_dim, generator=g, dtype=torch.float64)
    values = torch.randn(num_blocks + 1, block_size, kv_heads, v_head_dim, generator=g, dtype=torch.float64)
    keys[num_blocks], values[num_blocks] = 1e4, 1e4
    return keys.to(dtype), values.to(dtype)


def make_step(rows, num_blocks, block_size, seed=0, shared_prefix=0):
    """AttentionMetadata for rows [(tokens already computed, new tokens)], decodes (1 new token) first.

    Blocks are drawn at random from the cache; with shared_prefix > 0, every row whose context reaches past that
    many blocks holds the same first shared_prefix blocks (position-aligned, as the prefix cache shares them).
    """
    rows = sorted(rows, key=lambda r: r[1] != 1)
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared_prefix)]
    lens = [done + new for done, new in rows]
    width = max(-(-n // block_size) for n in lens)
    table, slots, starts = [], [], [0]
    for (done, new), length in zip(rows, lens):
        count = -(-length // block_size)
        blocks = prefix[:count] if count > shared_prefix else []
        blocks = blocks + [free.pop() for _ in range(count - len(blocks))]
        table.append(blocks + [num_blocks] * (width - count))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(done, length)]
        starts.append(starts[-1] + new)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_table=torch.tensor(table, dtype=torch.int32), slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decodes=sum(1 for _, new in rows if new == 1), max_query_len=max(new for _, new in rows),
        max_seq_len=max(lens), query_start_list=starts, seq_lens_list=lens)


def run_both(meta, features, block_size, heads=8, kv_heads=2, head_dim=16, v_head_dim=16, dtype=torch.float32,
             num_blocks=48, backend=None):
    """(flex output, reference output) of one layer over a random cache; the step's own keys/values are the cache's
    contents at its slots (the backends read both)."""
    keys, values = make_cache(num_blocks, block_size, kv_heads, head_dim, v_head_dim, dtype)
    tokens = meta.slot_mapping.shape[0]
    query = torch.randn(heads, tokens, head_dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    query = query.to(dtype).transpose(0, 1)  # [T, H, D] with heads-first strides, as transformers hands it over
    key = keys.view(-1, kv_heads, head_dim)[meta.slot_mapping]
    value = values.view(-1, kv_heads, v_head_dim)[meta.slot_mapping]
    flex = backend or fx.FlexBackend(block_size, check_invariants=True)
    reference = ReferenceBackend(block_size)
    flex.begin_step()
    reference.begin_step()
    got = flex.forward(query, key, value, keys, values, meta, features)
    want = reference.forward(query, key, value, keys, values, meta, features)
    return got, want


def features(window=None, softcap=None, sinks=False, heads=8, dtype=torch.float32):
    sink = torch.linspace(-1.0, 2.0, heads, dtype=dtype) if sinks else None
    return LayerFeatures(0.3, window, softcap, sink)


DECODES = [(0, 1), (15, 1), (16, 1), (31, 1), (40, 1), (63, 1)]  # lengths 1, 16, 17, 32, 41, 64
PREFILLS = [(0, 21), (17, 9), (32, 40), (5, 2)]  # a first chunk, continuations crossing blocks, a 2-token chunk
FEATURES = {"plain": {}, "window": {"window": 13}, "window-small": {"window": 3}, "softcap": {"softcap": 5.0},
            "sinks": {"sinks": True}, "all": {"window": 13, "softcap": 5.0, "sinks": True}}


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("kind", ["decode", "prefill", "mixed"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_flex_matches_reference(block_size, kind, feature):
    rows = {"decode": DECODES, "prefill": PREFILLS, "mixed": DECODES[::2] + PREFILLS}[kind]
    num_blocks = 48 if block_size == 16 else 160
    meta = make_step(rows, num_blocks, block_size, seed=block_size)
    got, want = run_both(meta, features(**FEATURES[feature]), block_size, num_blocks=num_blocks)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_gqa_and_value_head_dim(heads, kv_heads):
    meta = make_step(DECODES[:3] + PREFILLS[:2], 48, 16)
    got, want = run_both(meta, features(window=13, sinks=True, heads=heads), 16, heads, kv_heads, head_dim=16,
                         v_head_dim=8)
    assert got.shape[-1] == 8 and (got - want).abs().max() < 1e-5


def test_shared_prefix_blocks():
    """Rows holding the same first blocks (the prefix cache): one query block of the packed form reads them once."""
    rows = [(40, 1), (50, 1), (33, 4), (48, 5), (0, 36)]
    meta = make_step(rows, 48, 16, shared_prefix=2)
    table = meta.block_table
    assert (table[:, :2] == table[0, :2]).all()
    for feature in ("plain", "window", "all"):
        got, want = run_both(meta, features(**FEATURES[feature]), 16)
        assert (got - want).abs().max() < 1e-5


@pytest.mark.parametrize("feature", ["plain", "all"])
def test_float64(feature):
    """In float64 the two backends agree to rounding: any difference of substance would show."""
    meta = make_step(DECODES + PREFILLS, 48, 16)
    got, want = run_both(meta, features(**FEATURES[feature], dtype=torch.float64), 16, dtype=torch.float64)
    assert got.dtype == torch.float64 and (got - want).abs().max() < 1e-12


def test_padded_shapes_change_nothing():
    """Bucket padding (rows, tokens, table width), as the compiled path uses it, leaves the real rows' outputs alone."""
    meta = make_step(DECODES[:3] + PREFILLS[:3], 48, 16)
    feature = features(**FEATURES["all"])
    padded, want = run_both(meta, feature, 16, backend=fx.FlexBackend(16, pad_shapes=True))
    plain, _ = run_both(meta, feature, 16, backend=fx.FlexBackend(16, pad_shapes=False))
    assert (padded - want).abs().max() < 1e-5
    assert (padded - plain).abs().max() < 1e-6


def test_buckets():
    assert [fx.decode_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 33)] == [1, 2, 4, 8, 8, 16, 16, 32, 48]
    assert [fx.token_bucket(n) for n in (1, 16, 17, 100, 2048)] == [16, 16, 32, 128, 2048]
    assert [fx.width_bucket(n) for n in (1, 8, 9, 200)] == [8, 8, 16, 256]


# --- the block lists, as the compiled kernel reads them ---------------------------------------------------------


def _coverage(counts, indices, num_cache_blocks, block_size):
    """bool [query blocks, slots]: slots of the listed blocks; asserts no block is listed twice."""
    counts, indices = counts.reshape(-1), indices.reshape(counts.numel(), -1)
    cover = torch.zeros(counts.numel(), num_cache_blocks, dtype=torch.bool)
    for q, n in enumerate(counts.tolist()):
        listed = indices[q, :n]
        assert listed.unique().numel() == n, "a block listed twice would be read twice"
        cover[q, listed.long()] = True
    return cover.repeat_interleave(block_size, dim=1)


def _dense_mask(mod, batch, queries, num_cache_blocks, block_size):
    """mask_mod evaluated everywhere: bool [batch, queries, slots]."""
    kv = torch.arange(num_cache_blocks * block_size)
    return torch.stack([torch.stack([mod(torch.tensor(b), torch.tensor(0), torch.tensor(q), kv)
                                     for q in range(queries)]) for b in range(batch)])


@pytest.mark.parametrize("window", [None, 3, 13, 40])
@pytest.mark.parametrize("block_size", [4, 16])
def test_block_lists_cover_the_mask(window, block_size):
    rows = [(0, 1), (15, 1), (16, 1), (40, 1), (0, 21), (17, 9), (32, 40), (5, 2), (3, 30)]
    num_blocks = 60 if block_size == 16 else 200
    meta = make_step(rows, num_blocks, block_size, seed=3, shared_prefix=1)
    backend = fx.FlexBackend(block_size, pad_shapes=True)
    keys, values = make_cache(num_blocks, block_size, 1, 4, 4, torch.float32)
    step = backend._prepare(meta, keys, values, meta.slot_mapping.shape[0])
    n = num_blocks + 1
    for form, lists_of, by_batch in ((step.decode, fm.decode_block_lists, True),
                                     (step.packed, fm.packed_block_lists, False)):
        mod = fm.step_mask_mod(form.table, step.p2l, form.row_of, form.qpos_of, by_batch, block_size, window)
        partial_n, partial, full_n, full = lists_of(form, block_size, window)
        partial = _coverage(partial_n, partial, n, block_size)
        full = _coverage(full_n, full, n, block_size)
        if by_batch:
            mask = _dense_mask(mod, form.num_queries, 1, n, block_size)[:, 0]  # [rows, slots]
        else:
            mask = _dense_mask(mod, 1, form.num_queries, n, block_size)[0]  # [tokens, slots]
            partial = partial.repeat_interleave(fm.QUERY_BLOCK, dim=0)
            full = full.repeat_interleave(fm.QUERY_BLOCK, dim=0)
        assert mask.any(), "the step attends something"
        assert not (partial & full).any(), "a block both partial and full would be read twice"
        assert not (mask & ~(partial | full)).any(), "mask_mod admits a slot of a block that is not listed"
        assert not (full & ~mask).any(), "a block listed full holds a slot mask_mod rejects"
        assert not mask[:, (n - 1) * block_size:].any(), "the null block is never attended"
        if window is None or window >= 2 * block_size + fm.QUERY_BLOCK:
            assert full.any(), "blocks wholly inside every query's view are listed full"


def test_logical_block_map_and_its_invariant():
    table = torch.tensor([[3, 5, 9, 9], [3, 7, 9, 9]], dtype=torch.int32)  # block 3 shared at index 0, 9 = null
    lens = torch.tensor([20, 17], dtype=torch.int32)
    p2l = fm.logical_block_map(table, lens, 10, 16)
    assert p2l.tolist() == [-1, -1, -1, 0, -1, 1, -1, 1, -1, -1]
    fm.check_logical_blocks(table, lens, 16)
    with pytest.raises(ValueError, match="block 5 sits at logical index 1"):
        fm.check_logical_blocks(torch.tensor([[3, 5], [5, 7]], dtype=torch.int32), lens, 16)


def test_kv_block_cap():
    """One layer's K or V view stays within 2**31 - 1 elements (flex's int32 offsets)."""
    n = fx.max_kv_blocks(16, 8, 128)
    assert (n + 1) * 16 * 8 * 128 <= 2**31 - 1 < (n + 2) * 16 * 8 * 128
    geometry = [type("G", (), {"num_kv_heads": 8, "head_dim": 64, "v_head_dim": 128})()]
    assert fx.max_kv_blocks_for(geometry, 16) == n
    fits = torch.empty(n + 1, 16, 8, 128, device="meta")
    fx.check_cache_fits(fits, fits)
    too_big = torch.empty(n + 2, 16, 8, 128, device="meta")
    with pytest.raises(ValueError, match=f"at most {n} blocks fit"):
        fx.check_cache_fits(fits, too_big)


# --- compiled: no graph break, no recompile within a bucket ------------------------------------------------------


def test_compiled_path_has_no_graph_break_and_no_recompile_within_buckets():
    """fullgraph dynamo tracing (backend "eager": no inductor, so it runs in seconds on a CPU) of both forms; later
    steps of the same buckets, with new block tables and lengths, run under no_recompiles()."""
    torch._dynamo.reset()
    backend = fx.FlexBackend(16, compile_backend="eager")
    assert backend.compiled and backend.pad_shapes
    feature = features(window=13, softcap=5.0, sinks=True)
    first = make_step([(15, 1), (40, 1), (3, 1), (0, 21), (17, 9)], 48, 16, seed=1)
    got, want = run_both(first, feature, 16, backend=backend)
    assert (got - want).abs().max() < 1e-5
    with fx.no_recompiles():
        for seed, rows in enumerate([[(20, 1), (33, 1), (9, 1), (0, 18), (5, 9)],
                                       [(7, 1), (1, 1), (2, 1), (60, 1), (0, 20), (10, 5)]]):
            got, want = run_both(make_step(rows, 48, 16, seed=seed + 5), feature, 16, backend=backend)
            assert (got - want).abs().max() < 1e-5
        with pytest.raises(RuntimeError, match="recompil"):  # a new bucket (8 decode rows) must compile, and says so
            run_both(make_step([(9, 1)] * 5, 48, 16, seed=9), feature, 16, backend=backend)


def test_fixed_width_leaves_token_and_decode_buckets_the_only_compiled_shapes():
    """With max_blocks_per_seq (what ModelRunner passes), tables of any width and any number of prefill rows run
    the shapes compiled for their token and decode buckets: steps of 2 to 10 table columns and 1 to 5 prefill rows
    in the 64-token bucket compile nothing after the first (without the fixed width and the rows padded to the token
    bucket, 10 columns and 5 prefill rows were buckets of their own, compiled while their requests waited). A new
    token bucket still compiles."""
    torch._dynamo.reset()
    backend = fx.FlexBackend(16, compile_backend="eager", max_blocks_per_seq=16)
    feature = features()
    got, want = run_both(make_step([(3, 1), (0, 40)], 48, 16, seed=1), feature, 16, backend=backend)
    assert (got - want).abs().max() < 1e-5
    with fx.no_recompiles():
        for seed, rows in enumerate([[(20, 1), (0, 9), (0, 9), (5, 9), (0, 9), (1, 9)],  # 5 rows, 2 columns
                                     [(150, 1), (20, 40)],  # 10 columns
                                     [(2, 1), (0, 33), (0, 2)]]):
            got, want = run_both(make_step(rows, 48, 16, seed=seed + 5), feature, 16, backend=backend)
            assert (got - want).abs().max() < 1e-5
        with pytest.raises(RuntimeError, match="recompil"):  # 17 prefill tokens: the 32-token bucket
            run_both(make_step([(3, 1), (0, 17)], 48, 16, seed=9), feature, 16, backend=backend)


def test_compiled_flex_refuses_heads_below_sixteen(monkeypatch):
    """Inductor's flex lowering refuses head_dim < 16 (seen on an H200): a worker with a compiled flex backend
    refuses such a model (stories260K: head_dim 8) at start-up by name, pointing at the reference backend."""
    from shuttle.worker import worker as worker_module
    from shuttle.worker.model_loader import LayerGeometry, UnsupportedModelError
    from tests.server import MODEL_DIR

    assert fx.compiled_head_dim_problem([LayerGeometry(2, 16, 16)]) is None
    assert "head_dim 8" in fx.compiled_head_dim_problem([LayerGeometry(2, 16, 16), LayerGeometry(2, 8, 16)])
    monkeypatch.setattr(worker_module, "make_backend",
                        lambda name, bs, device, width: fx.FlexBackend(bs, device, compile_backend="eager",
                                                                       max_blocks_per_seq=width))
    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(16, 40), worker=WorkerConfig(attention_backend="flex"))
    with pytest.raises(UnsupportedModelError, match="head_dim 8 is below the 16 .* --attention-backend reference"):
        worker_module.ModelRunner(config)


def test_token_buckets_cover_every_prefill_size():
    assert fx.token_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert fx.token_buckets(3000)[-1] == 4096 and fx.token_buckets(8) == [16]
    for tokens in range(2, 3001):
        assert fx.token_bucket(tokens) in fx.token_buckets(3000)


def test_eager_flex_calls_the_operator_without_dynamo(monkeypatch):
    """Outside torch.compile, flex_attention traces itself with dynamo once per new shape unless its private module
    flag says not to (torch 2.13.0); the CPU path sets it around each call. Fails if the flag is gone or ignored."""
    import torch.nn.attention.flex_attention as torch_flex
    assert torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False

    def no_compile(*args, **kwargs):
        raise AssertionError("eager flex went through torch.compile")
    monkeypatch.setattr(torch, "compile", no_compile)
    query = torch.randn(1, 2, 5, 8)
    out = fx.flex_function(torch.device("cpu"))(query, query, query)
    want = torch.nn.functional.scaled_dot_product_attention(query, query, query)
    assert (out - want).abs().max() < 1e-6
    assert torch_flex._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG is False  # restored after the call
    with pytest.raises(AssertionError, match="torch.compile"), warnings.catch_warnings():  # the check bites
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        torch_flex.flex_attention(query, query, query)


# --- selection and the engine ----------------------------------------------------------------------------------


def test_selectable_by_flag():
    args = build_parser().parse_args(["serve", "model", "--attention-backend", "flex"])
    assert args.attention_backend == "flex"
    assert make_backend("flex", 16, torch.device("cpu")).name == "flex"
    assert make_backend("auto", 16, torch.device("cpu")).name == "cpu"  # the CPU default stays


def test_engine_greedy_matches_transformers():
    """The in-process engine (scheduler + ModelRunner, start-up exactness check included) on stories260K with the
    flex backend: chunked prefill, decodes, mixed steps and prefix-cache hits, token for token against transformers."""
    from shuttle.scheduler.kv_cache import KVCacheManager
    from shuttle.scheduler.scheduler import Scheduler
    from shuttle.worker.worker import ModelRunner
    from tests.conftest import hf_greedy
    from tests.engine.test_engine_inprocess import greedy_outputs
    from tests.server import MODEL_DIR

    num_blocks, block_size = 40, 16
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(block_size, num_blocks),
                           scheduler=SchedulerConfig(max_num_batched_tokens=24),
                           worker=WorkerConfig(attention_backend="flex"))
    runner = ModelRunner(config)
    assert runner.backend.name == "flex"
    scheduler = Scheduler(config.scheduler, KVCacheManager(num_blocks, block_size, True), model.max_model_len,
                          model.eos_token_ids)
    rng = random.Random(2)
    shared = [1] + [rng.randrange(3, 512) for _ in range(40)]
    prompts = [shared + [rng.randrange(3, 512) for _ in range(rng.randrange(0, 30))] for _ in range(4)]
    max_tokens = [rng.randrange(10, 25) for _ in prompts]
    outputs, _ = greedy_outputs(scheduler, runner, prompts, max_tokens)
    assert outputs == [hf_greedy(prompt, m) for prompt, m in zip(prompts, max_tokens)]
    assert scheduler.kv.prefix_hits > 0


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "mistral-window8", "gemma2-softcap1", "gpt2", "gpt_oss"])
def test_startup_exactness_check_passes_on_the_architecture_set(name, tmp_path):
    """ModelRunner's start-up check (worker/capability.py: chunked prefill, continuation and decodes against
    transformers' eager attention) with the flex backend, on tiny random models with GQA, a window of 8 (2 blocks
    of 4), soft-cap, sinks (gpt-oss) and learned positions (GPT-2)."""
    from scripts.dev.check_architectures import VARIANTS, build_model_dir
    from shuttle.worker.worker import ModelRunner

    model_type, extra = VARIANTS.get(name, (name, {}))
    build_model_dir(model_type, tmp_path, extra)
    config = ShuttleConfig(model=ModelConfig.from_dir(tmp_path, max_model_len=128),
                           ipc=IpcConfig.in_directory("/nonexistent"), cache=CacheConfig(4, 64),
                           worker=WorkerConfig(attention_backend="flex"))
    runner = ModelRunner(config)  # raises UnsupportedModelError past the tolerance
    assert runner.backend.name == "flex" and runner.check_difference < 1e-4
