"""--quantization int8 (worker/quantization.py): the int8 module against its own dequantized weights, the round
trip's error bound, an in-process engine run, weight_bytes, and the start-up refusals."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.devices import DeviceError, quantization_error, resolve_config
from shuttle.common.messages import Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker.cpu_compiled_decode import CompiledCpuDecode
from shuttle.worker.quantization import DEQUANTIZED_ROWS, Int8Linear, dequantize, quantize_model, quantize_per_channel
from shuttle.worker.worker import ModelRunner
from tests.server import MODEL_DIR
from tests.unit.test_startup_refusals import refusal


def linear(out_features: int, in_features: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    layer = torch.nn.Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.normal_(0, 0.05)
        layer.weight[3] = 0  # an all-zero row: scale at its floor, q = 0
        layer.weight[5, 7] = 1.0  # an outlier sets its row's scale
    return layer


@pytest.mark.parametrize("out_features, in_features", [(96, 64), (64, 172), (2048, 768)])
def test_round_trip_error_is_at_most_half_a_scale_step(out_features, in_features):
    weight = linear(out_features, in_features).weight.detach()
    q, scales = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scales.dtype == torch.bfloat16 and q.shape == weight.shape
    assert int(q.abs().max()) <= 127
    error = (weight - dequantize(q, scales)).abs()  # [N, K]
    assert (error <= scales.float()[:, None] / 2 * (1 + 1e-6)).all()
    assert (q[3] == 0).all() and int(q[5, 7]) == 127


@pytest.mark.parametrize("out_features, in_features, bias", [(96, 64, False), (64, 172, True), (2048, 768, False)])
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wide_dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_is_the_matmul_with_its_dequantized_weights(out_features, in_features, bias, rows, dtype,
                                                                wide_dtype):
    layer = linear(out_features, in_features, bias).to(dtype)
    module = Int8Linear(layer, wide_dtype)
    x = torch.randn(2, rows, in_features).to(dtype)  # [B, M, K]
    with torch.inference_mode():
        y = module(x)
    assert y.shape == (2, rows, out_features) and y.dtype == dtype
    # The reference takes x as the kernel does (bfloat16 below DEQUANTIZED_ROWS rows, else wide_dtype) and is
    # accumulated in float32; the kernel's output is rounded to bfloat16 (and again with a bfloat16 bias added):
    # 2^-8 of the magnitudes summed bounds that rounding
    xb = x.to(torch.bfloat16 if 2 * rows < DEQUANTIZED_ROWS else wide_dtype).float()
    weight = dequantize(module.qweight[:, :in_features], module.scales)
    bias = torch.zeros(out_features) if layer.bias is None else layer.bias.detach().float()
    expected = xb @ weight.T + bias
    bound = 2 ** -8 * (xb.abs() @ weight.abs().T + bias.abs()) + 1e-6
    assert ((y.float() - expected).abs() <= bound).all()


def test_quantize_model_replaces_every_linear_but_the_lm_head():
    from transformers import LlamaConfig, LlamaForCausalLM
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                         tie_word_embeddings=False)).eval()
    assert quantize_model(model, "int8", torch.device("cpu"), tensor_parallel=False, has_bf16_units=False) == 2 * 7
    assert type(model.lm_head) is torch.nn.Linear
    assert not any(type(m) is torch.nn.Linear for name, m in model.named_modules() if name != "lm_head")
    with pytest.raises(ValueError, match="runs without tensor parallel"):
        quantize_model(model, "int8", torch.device("cpu"), tensor_parallel=True, has_bf16_units=False)
    with pytest.raises(ValueError, match="CPU only"):
        quantize_model(model, "int8", torch.device("cuda"), tensor_parallel=False, has_bf16_units=False)


def config_for(quantization: str) -> ShuttleConfig:
    return ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/nonexistent"),
                         cache=CacheConfig(16, 256), scheduler=SchedulerConfig(max_num_batched_tokens=64),
                         worker=WorkerConfig(quantization=quantization))


def test_an_int8_engine_generates_exact_counts_and_reports_its_int8_bytes():
    runner = ModelRunner(config_for("int8"))
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, Int8Linear)]
    assert runner.quantized_linears == len(linears) == 5 * 7  # stories260K: 5 layers of q/k/v/o, gate/up/down
    others = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                 if not name.endswith(("qweight", "scales")))
    int8 = sum(m.qweight.numel() + 2 * m.scales.numel() for m in linears)
    assert runner.weight_bytes == others + int8
    assert runner.weight_bytes < ModelRunner(config_for("none")).weight_bytes / 2
    assert isinstance(runner.graphs, CompiledCpuDecode)  # decode steps through the compiled forward

    config = config_for("int8")
    scheduler = Scheduler(config.scheduler, KVCacheManager(256, 16, True), config.model.max_model_len,
                          config.model.eos_token_ids)
    prompts = [[1] + list(range(10 + i, 40 + 7 * i)) for i in range(6)]  # 30 to 65 tokens: chunked prefills
    max_tokens = [5, 17, 40, 1, 23, 64]
    outputs = {str(i): [] for i in range(len(prompts))}

    def collect(batch):
        for out in batch:
            outputs[out.request_id] += out.new_token_ids

    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=m, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=params,
                                           arrival_time=time.time()))
    drive(scheduler, runner, collect, check_blocks=True)
    assert [len(outputs[str(i)]) for i in range(len(prompts))] == max_tokens
    vocab = model.config.vocab_size
    assert all(0 <= t < vocab for tokens in outputs.values() for t in tokens)


def test_the_refusals_name_what_is_supported():
    assert quantization_error("none", 4, "cuda") is None and quantization_error("int8") is None
    assert quantization_error("fp8") == "--quantization 'fp8' is not supported; choose one of none, int8"
    assert "-tp 2" in quantization_error("int8", 2)
    assert "CPU only" in quantization_error("int8", 1, "cuda")


def test_serve_refuses_an_unknown_method_and_tensor_parallel_in_one_line(no_launch, capsys):
    err = refusal(capsys, "serve", str(MODEL_DIR), "--port", "0", "--quantization", "awq")
    assert "--quantization 'awq' is not supported; choose one of none, int8" in err
    err = refusal(capsys, "serve", str(MODEL_DIR), "--port", "0", "--quantization", "int8", "-tp", "2")
    assert "runs without tensor parallel only (-tp 1), not -tp 2" in err


def on_device(config: ShuttleConfig, device: str) -> ShuttleConfig:
    return dataclasses.replace(config, worker=dataclasses.replace(config.worker, device=device))


def test_cuda_is_refused_before_any_process_starts():
    config = config_for("int8")
    for device in ("cuda:0", "auto"):  # auto is cuda:0 where torch sees a CUDA device
        with pytest.raises(DeviceError, match="CPU only"):
            resolve_config(on_device(config, device), 1, cuda_devices=1)
    assert resolve_config(on_device(config, "cpu"), 1, cuda_devices=1).worker.device == "cpu"
