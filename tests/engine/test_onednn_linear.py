"""float32 linears on oneDNN's matmul (worker/onednn_linear.py): the product agrees with F.linear to float32 rounding
at every row count, every float32 linear is wrapped once sharing its weight (tied weights stay tied), what must be
left alone is, the start-up check catches a product outside rounding, and an engine on two threads gives
transformers' greedy tokens, token for token."""

import copy
import random
import time

import numba
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig
from shuttle.common.messages import Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker import onednn_linear as onednn_module
from shuttle.worker.cpu_linears import prepare_cpu_linears
from shuttle.worker.fused_projections import SharedInputLinear
from shuttle.worker.onednn_linear import (
    OneDnnLinear,
    onednn_is_close,
    onednn_linear,
    rounding_bound,
    route_linears_to_onednn,
)
from shuttle.worker.output_projection import MIN_COLUMNS, ColumnChunkedLinear
from shuttle.worker.worker import ModelRunner
from tests.server import MODEL_DIR

CPU = torch.device("cpu")
DEFAULT_MIN_WEIGHT_BYTES = onednn_module.MIN_WEIGHT_BYTES  # before this file's fixture sets it to 0
bf16_onednn = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                 reason="this CPU's oneDNN has no bfloat16 matmul")


def route_float32_linears(model: torch.nn.Module, device: torch.device = CPU, tensor_parallel: bool = False,
                          **options) -> int:
    """How many layers route_linears_to_onednn wraps on a CPU without bf16 units (float32 layers only)."""
    return route_linears_to_onednn(model, device, tensor_parallel, has_bf16_units=False, **options).wrapped


@pytest.fixture
def two_threads():
    """Two torch threads for the test, back to the suite's one after it, numba's too (the decode kernel's warm-up
    sets numba's count from torch's)."""
    torch.set_num_threads(2)
    yield
    numba.set_num_threads(1)
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def small_layers_too(monkeypatch):
    """These tests' models are tiny: every float32 linear goes to oneDNN whatever its size, except where a test
    restores the size rule."""
    monkeypatch.setattr(onednn_module, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(onednn_module, "MIN_BF16_WEIGHT_BYTES", 0)


def test_by_default_only_weights_of_at_least_min_weight_bytes_go_to_onednn(monkeypatch):
    monkeypatch.setattr(onednn_module, "MIN_WEIGHT_BYTES", DEFAULT_MIN_WEIGHT_BYTES)  # the size rule back
    model = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.Linear(64, 64))  # 2.25 MiB and 16 KiB
    assert route_float32_linears(model, CPU, tensor_parallel=False) == 1
    assert isinstance(model[0], OneDnnLinear) and type(model[1]) is torch.nn.Linear
    stories = _tiny_llama(512)
    assert route_float32_linears(stories, CPU, tensor_parallel=False) == 0  # tiny layers: all stay on F.linear
    assert route_float32_linears(stories, CPU, tensor_parallel=False, min_weight_bytes=0) == 2 * 7 + 1


def _within_rounding(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return bool(((got - F.linear(x, weight, bias)).abs() <= rounding_bound(x, weight, bias)).all())


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_every_row_count_agrees_with_f_linear_to_rounding(threads, packed):
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(0)
        for out_features, in_features, bias in ((2304, 768, False), (768, 768, True), (768, 2048, False)):
            linear = torch.nn.Linear(in_features, out_features, bias=bias)
            with torch.no_grad():
                linear.weight.copy_(torch.randn(out_features, in_features, generator=generator))
            layer = OneDnnLinear(copy.deepcopy(linear), packed=packed)
            assert (layer.packed_weight is not None) is packed and layer.weight.is_meta is packed
            with torch.inference_mode():
                for rows in (1, 2, 5, 9, 16, 64, 300):
                    x = torch.randn(rows, in_features, generator=generator)
                    assert _within_rounding(layer(x), x, linear.weight, linear.bias)
                x3 = torch.randn(2, 3, in_features, generator=generator).transpose(0, 1)  # [3, 2, K], not contiguous
                assert layer(x3).shape == (3, 2, out_features)
                assert _within_rounding(layer(x3).reshape(6, -1), x3.reshape(6, -1), linear.weight, linear.bias)
    finally:
        torch.set_num_threads(1)


def _tiny_llama(vocab: int, tied: bool = True) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tied", [True, False])
def test_every_float32_linear_is_wrapped_once_sharing_its_weight(tied, monkeypatch):
    monkeypatch.setattr(onednn_module, "packs_weights", lambda: False)  # an AVX2 CPU: row-major weights
    model = _tiny_llama(MIN_COLUMNS, tied)
    weights = {name: module.weight for name, module in model.named_modules() if type(module) is torch.nn.Linear}
    ids = torch.tensor([[5, 9, 2]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        done = prepare_cpu_linears(model, CPU, tensor_parallel=False, has_bf16_units=False, threads=2)
        assert (done.onednn, done.chunked_head) == (2 * 7 + 1, False)  # the head is oneDNN's, not chunked
        head = model.get_output_embeddings()
        assert isinstance(head, OneDnnLinear) and type(head.linear) is torch.nn.Linear
        assert (head.weight is model.get_input_embeddings().weight) is tied
        wrapped = {name: module for name, module in model.named_modules() if isinstance(module, OneDnnLinear)}
        assert set(wrapped) == set(weights) and all(wrapped[name].weight is weights[name] for name in weights)
        assert all(type(child) is not torch.nn.Linear or isinstance(parent, OneDnnLinear)
                   for parent in model.modules() for child in parent.children())  # no nn.Linear left unwrapped
        after = model(input_ids=ids).logits
        assert torch.equal(after.argmax(-1), before.argmax(-1))
        assert torch.allclose(after, before, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tied", [True, False])
def test_on_avx512_layers_compute_from_reordered_weights_and_release_all_but_a_tied_heads(tied, monkeypatch):
    monkeypatch.setattr(onednn_module, "packs_weights", lambda: True)
    model = _tiny_llama(MIN_COLUMNS, tied)
    embedding = model.get_input_embeddings().weight
    byte_count = sum(p.numel() * p.element_size() for p in model.parameters())
    ids = torch.tensor([[5, 9, 2]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        done = prepare_cpu_linears(model, CPU, tensor_parallel=False, has_bf16_units=False, threads=2)
        # q/k/v and gate/up in groups (test_fused_projections.py), o_proj, down_proj and the head alone
        assert (done.onednn, done.fused) == (2 * 2 + 1, 2 * 5)
        head = model.get_output_embeddings()
        layers = [module for module in model.modules() if isinstance(module, OneDnnLinear)]
        assert all(m.packed_weight is not None for m in layers)  # the head too, tied or not
        fused = [module for module in model.modules() if isinstance(module, SharedInputLinear)]
        assert all(m.weight.is_meta for m in layers + fused if m is not head)
        # a tied head's weight stays the embedding's, held beside its reordered copy, and that copy is counted
        assert (head.weight is embedding) is tied and model.get_input_embeddings().weight is embedding
        assert head.weight.is_meta is not tied and not embedding.is_meta
        assert done.copied_bytes == (embedding.numel() * 4 if tied else 0)
        # the model's byte count (the worker's weight_bytes, less the copies) and its shapes are the same
        assert sum(p.numel() * p.element_size() for p in model.parameters()) == byte_count
        after = model(input_ids=ids).logits
        assert torch.equal(after.argmax(-1), before.argmax(-1))
        assert torch.allclose(after, before, rtol=0, atol=1e-5)


@bf16_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_bfloat16_layers_compute_from_reordered_weights_only_where_the_cpu_has_bf16_units(tied, monkeypatch):
    model = _tiny_llama(MIN_COLUMNS, tied).to(torch.bfloat16)
    ids = torch.tensor([[5, 9, 2, 7, 7, 1]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        monkeypatch.setattr(onednn_module, "packs_weights", lambda: False)  # AVX2: bf16 is output_projection's
        assert route_linears_to_onednn(model, CPU, False, has_bf16_units=True).wrapped == 0
        monkeypatch.setattr(onednn_module, "packs_weights", lambda: True)
        assert route_linears_to_onednn(model, CPU, False, has_bf16_units=False).wrapped == 0  # no bf16 units
        done = prepare_cpu_linears(model, CPU, tensor_parallel=False, has_bf16_units=True, threads=2)
        assert (done.onednn, done.fused, done.widened, done.chunked_head) == (2 * 2 + 1, 2 * 5, 0, False)
        assert done.copied_bytes == (model.get_input_embeddings().weight.numel() * 2 if tied else 0)
        layers = [module for module in model.modules() if isinstance(module, OneDnnLinear)]
        assert all(m.packed_weight is not None and m.packed_weight.dtype == torch.bfloat16 for m in layers)
        after = model(input_ids=ids).logits
    assert after.dtype == torch.bfloat16 and torch.equal(after.argmax(-1), before.argmax(-1))
    # each layer's output within one bf16 rounding of F.linear's, compounded over two layers: a few bf16 ulps
    assert torch.allclose(after.float(), before.float(), rtol=2.0 ** -5, atol=2.0 ** -7)


@bf16_onednn
def test_bfloat16_layers_smaller_than_min_bf16_weight_bytes_stay_on_f_linear(monkeypatch):
    monkeypatch.setattr(onednn_module, "packs_weights", lambda: True)
    monkeypatch.setattr(onednn_module, "MIN_BF16_WEIGHT_BYTES", 128 << 10)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(128, 256)).to(torch.bfloat16)
    assert route_linears_to_onednn(model, CPU, False, has_bf16_units=True).wrapped == 1  # 128 KiB and 64 KiB
    assert isinstance(model[0], OneDnnLinear) and type(model[1]) is torch.nn.Linear


@bf16_onednn
def test_the_start_up_check_holds_for_bfloat16_and_fails_on_a_product_outside_rounding(monkeypatch):
    linear = torch.nn.Linear(768, 512).to(torch.bfloat16)
    assert onednn_is_close(linear.weight, linear.bias, packed=True)
    assert onednn_is_close(linear.weight, linear.bias, packed=False)
    monkeypatch.setattr(onednn_module, "onednn_linear", lambda *a: onednn_linear(*a) * (1 + 2.0 ** -5))
    assert not onednn_is_close(linear.weight, linear.bias, packed=True)


def _resident_bytes() -> int:
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return sum(int(fields[name].split()[0]) * 1024 for name in ("RssAnon", "RssFile"))


def test_reordering_a_checkpoints_weights_does_not_hold_them_twice(tmp_path, monkeypatch):
    """transformers maps the checkpoint: the reordered copies must replace the mapped weights in memory, not sit
    beside them (each linear's pages are dropped once it is reordered)."""
    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    linear_bytes = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2]]))  # every weight page resident, as after the start-up checks
        before = _resident_bytes()
        assert route_float32_linears(model, CPU, tensor_parallel=False, pack=True) == 2 * 7 + 1  # the tied head too
        # (the tied head's reordered copy, 2 MiB, sits beside the embedding: counted, and well under the bound)
        model(input_ids=torch.tensor([[1, 2]]))
    assert _resident_bytes() - before < 0.5 * linear_bytes, (before, _resident_bytes(), linear_bytes)  # not twice


def test_tensor_parallel_other_dtypes_other_devices_and_failing_shapes_are_left_alone(monkeypatch):
    assert route_float32_linears(_tiny_llama(512), CPU, tensor_parallel=True) == 0
    assert route_float32_linears(_tiny_llama(512).to(torch.bfloat16), CPU, tensor_parallel=False) == 0
    assert route_float32_linears(_tiny_llama(512), torch.device("meta"), tensor_parallel=False) == 0
    model = _tiny_llama(512)
    monkeypatch.setattr(onednn_module, "onednn_is_close", lambda weight, bias, packed: weight.shape != (64, 64))
    assert route_float32_linears(model, CPU, tensor_parallel=False) == 2 * 5 + 1  # not q_proj, o_proj
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = _tiny_llama(MIN_COLUMNS)
    done = prepare_cpu_linears(model, CPU, tensor_parallel=False, has_bf16_units=False, threads=1)
    assert (done.onednn, done.chunked_head) == (0, True)  # no oneDNN: the head is chunked as before
    assert isinstance(model.get_output_embeddings(), ColumnChunkedLinear)


def test_the_start_up_check_fails_on_a_product_outside_rounding(monkeypatch):
    linear = torch.nn.Linear(256, 64)
    assert onednn_is_close(linear.weight, linear.bias)
    monkeypatch.setattr(onednn_module, "onednn_linear", lambda *a: onednn_linear(*a) * (1 + 2.0 ** -10))
    assert not onednn_is_close(linear.weight, linear.bias)


@pytest.mark.parametrize("packed", [False, True])
def test_an_engine_on_two_threads_matches_transformers_on_two_threads(two_threads, packed, monkeypatch):
    """The worker's linears on oneDNN (every row count, prefill of these prompts included), the reference on
    torch's GEMM on the same two threads; one prompt at a time, as transformers' generate runs them, then all at
    once. (The rest of the suite runs on one thread, oneDNN's linears included.)"""
    monkeypatch.setattr(onednn_module, "packs_weights", lambda: packed)  # both layouts, whatever this CPU runs
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"), cache=CacheConfig(16, 200),
                           scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    runner = ModelRunner(config)
    assert runner.cpu_linears.onednn > 0 and (runner.cpu_linears.fused > 0) is packed  # reordered: q/k/v fused
    # stories260K's head is tied: reordered, its copy sits beside the embedding and the worker's bytes count it
    head_bytes = runner.model.get_input_embeddings().weight.numel() * 4
    assert runner.cpu_linears.copied_bytes == (head_bytes if packed else 0)
    assert runner.weight_bytes == sum(p.numel() * p.element_size() for p in runner.model.parameters()) + \
        runner.cpu_linears.copied_bytes
    hf = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(3, 512) for _ in range(n)] for n in (4, 5, 8, 10, 40, 120)]
    expected = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
            expected.append(out[0, len(prompt):].tolist())
    for together in (False, True):
        scheduler = Scheduler(config.scheduler, KVCacheManager(200, 16, False), model.max_model_len,
                              model.eos_token_ids)
        got = {str(i): [] for i in range(len(prompts))}

        def collect(batch, got=got):
            for out in batch:
                got[out.request_id] += out.new_token_ids

        for i, prompt in enumerate(prompts):
            scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, arrival_time=time.time(),
                                               sampling=SamplingParams(max_tokens=40, temperature=0.0)))
            if not together:
                drive(scheduler, runner, collect, max_in_flight=1, check_blocks=True)
        drive(scheduler, runner, collect, max_in_flight=1, check_blocks=True)
        assert [got[str(i)] for i in range(len(prompts))] == expected, f"together={together}"
