"""bfloat16 on the CPU (issue 29): the numba decode kernel over a bfloat16 cache, what `--dtype auto` means on a CPU,
and `--kv-cache-dtype` (an fp32 model over a bf16 cache) through the in-process engine."""

import time

import pytest
import torch

from shuttle.common.config import CacheConfig, IpcConfig, SchedulerConfig, ShuttleConfig, WorkerConfig
from shuttle.common.devices import (
    AUTO_CPU_DTYPE_ENV,
    DeviceError,
    auto_dtype_reason,
    cpu_auto_dtype,
    cpu_bf16_flags,
    resolve_config,
    resolve_dtype,
)
from shuttle.common.messages import Submit
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.launcher.cli import build_parser
from shuttle.scheduler.in_process import drive
from shuttle.scheduler.kv_cache import KVCacheManager
from shuttle.scheduler.scheduler import Scheduler
from shuttle.worker.attention import LayerFeatures
from shuttle.worker.decode_kernel import paged_decode
from tests.engine.test_decode_kernel import _case, _reference
from tests.server import MODEL_DIR


@pytest.mark.parametrize("window,softcap,with_sinks", [(None, None, False), (5, None, False), (3, 1.0, True)])
def test_bf16_kernel_widens_exactly_and_stays_within_bf16_of_fp32(window, softcap, with_sinks):
    query, key_cache, value_cache, table, seq_lens = _case([1, 4, 7, 13, 30, 77], head_dim=64, v_head_dim=64)
    sinks = torch.randn(query.shape[1]) if with_sinks else None
    features = LayerFeatures(scaling=0.125, sliding_window=window, softcap=softcap, sinks=sinks)
    q16, k16, v16 = query.bfloat16(), key_cache.bfloat16(), value_cache.bfloat16()
    got = paged_decode(q16, k16, v16, table, seq_lens, 0.125, window, softcap, sinks)
    assert got.dtype == torch.float32
    # the widening is exact: the fp32 reference over the same bf16-rounded values agrees to fp32 rounding
    rounded = _reference(q16.float(), k16.float(), v16.float(), table, seq_lens, features)
    torch.testing.assert_close(got, rounded, atol=2e-5, rtol=1e-5)
    # and against the unrounded fp32 inputs, within what bf16 inputs cost (8 mantissa bits)
    fp32 = _reference(query, key_cache, value_cache, table, seq_lens, features)
    torch.testing.assert_close(got, fp32, atol=3e-2, rtol=2e-2)


def test_cpu_backend_decodes_bf16_through_the_kernel_and_answers_in_the_query_dtype(monkeypatch):
    from shuttle.worker import decode_kernel
    from shuttle.worker.attention_backends import CpuBackend

    calls = []
    real = decode_kernel.paged_decode
    monkeypatch.setattr(decode_kernel, "paged_decode", lambda *a: calls.append(a[1].dtype) or real(*a))
    query, key_cache, value_cache, table, seq_lens = _case([3, 9])
    meta = type("Meta", (), dict(num_decodes=2, num_seqs=2, block_table=table, seq_lens=seq_lens))()
    features = LayerFeatures(scaling=0.25, sliding_window=None, softcap=None, sinks=None)
    backend = CpuBackend(4)
    for q_dtype, kv_dtype in ((torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)):
        out = backend.forward(query.to(q_dtype), None, None, key_cache.to(kv_dtype), value_cache.to(kv_dtype), meta,
                              features)
        assert out.dtype == q_dtype
    assert calls == [torch.bfloat16, torch.bfloat16]


def test_auto_dtype_on_a_cpu_follows_its_bf16_flags(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_bf16_flags(str(info)) == ("amx_bf16", "avx512_bf16")
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert cpu_bf16_flags(str(info)) == () and cpu_bf16_flags(str(tmp_path / "missing")) == ()
    monkeypatch.delenv(AUTO_CPU_DTYPE_ENV)  # tests/server.py pins it to float32 for the suite
    assert cpu_auto_dtype(("avx512_bf16",))[0] == "bfloat16" and cpu_auto_dtype(())[0] == "float32"
    assert "avx512_bf16" in cpu_auto_dtype(("avx512_bf16",))[1]
    assert resolve_dtype("auto", "cuda:0") == "bfloat16" and resolve_dtype("float32", "cpu") == "float32"
    monkeypatch.setenv(AUTO_CPU_DTYPE_ENV, "float32")
    assert cpu_auto_dtype(("amx_bf16",)) == ("float32", f"${AUTO_CPU_DTYPE_ENV}=float32")
    assert resolve_dtype("auto", "cpu") == "float32" and auto_dtype_reason("cpu").startswith("float32 (auto: $")
    monkeypatch.setenv(AUTO_CPU_DTYPE_ENV, "fp8")
    with pytest.raises(DeviceError, match="fp8"):
        resolve_dtype("auto", "cpu")


def _serve_config(*flags: str) -> ShuttleConfig:
    args = build_parser().parse_args(["serve", str(MODEL_DIR), *flags])
    return ShuttleConfig.from_args(args, IpcConfig.in_directory("/x"))


def test_kv_cache_dtype_flag_and_its_refusal_under_flex():
    assert _serve_config().cache.kv_cache_dtype == "auto"
    config = _serve_config("--dtype", "float32", "--kv-cache-dtype", "bfloat16")
    assert resolve_config(config, 1, cuda_devices=0).cache.kv_cache_dtype == "bfloat16"
    with pytest.raises(DeviceError, match="flex"):
        resolve_config(config, 1, cuda_devices=1)
    same = _serve_config("--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16")
    assert resolve_config(same, 1, cuda_devices=1).model.dtype == "bfloat16"


def _greedy(dtype: str, kv_cache_dtype: str, prompts, tokens: int):
    from shuttle.worker.worker import ModelRunner

    model = ModelConfig.from_dir(MODEL_DIR, dtype=dtype)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(16, 64, kv_cache_dtype=kv_cache_dtype), scheduler=SchedulerConfig(),
                           worker=WorkerConfig(device="cpu", attention_backend="cpu"))
    runner = ModelRunner(config)
    scheduler = Scheduler(config.scheduler, KVCacheManager(64, 16, True), model.max_model_len, model.eos_token_ids)
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        scheduler.add_request(b"c", Submit(request_id=str(i), prompt_token_ids=prompt, sampling=params,
                                           arrival_time=time.time()))
    drive(scheduler, runner, lambda batch: [outputs[o.request_id].extend(o.new_token_ids) for o in batch])
    return runner, [outputs[str(i)] for i in range(len(prompts))]


def test_fp32_model_over_a_bf16_cache_and_a_bf16_model_serve_in_process():
    prompts = [[1, 403, 407, 261], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]
    fp32_runner, fp32 = _greedy("float32", "auto", prompts, 24)
    mixed_runner, mixed = _greedy("float32", "bfloat16", prompts, 24)
    bf16_runner, bf16 = _greedy("bfloat16", "auto", prompts, 24)
    assert mixed_runner.kv_cache.layers[0][0].dtype == torch.bfloat16 and mixed_runner.dtype == torch.float32
    assert mixed_runner.kv_cache.bytes_per_token * 2 == fp32_runner.kv_cache.bytes_per_token
    assert mixed_runner.dtype_label == "float32 (KV cache bfloat16)" and bf16_runner.dtype_label == "bfloat16"
    for outputs in (mixed, bf16):
        assert [len(o) for o in outputs] == [24, 24]
        # bf16 is not token-exact with fp32, but on this trained model greedy agrees for a good while
        assert all(o[:4] == f[:4] for o, f in zip(outputs, fp32))


def test_the_start_up_check_in_bf16_weighs_differences_by_probability():
    """bfloat16 rounding moves the log-probs of tokens the model rules out; the check weighs each difference by the
    reference probability, so stories260K in bf16 passes with a wide margin (the plain max is near 0.2 nats), while
    the same log-probs compared one position off (a structural mistake) are far past the tolerance."""
    from shuttle.worker import capability
    runner, _ = _greedy("bfloat16", "auto", [[1, 403]], 1)
    assert runner.check_difference < 0.4 * capability.TOLERANCE[torch.bfloat16]  # 0.046 on a CPU without bf16 units
    g = torch.Generator().manual_seed(0)
    reference = torch.randn(12, 512, generator=g).mul(3).log_softmax(-1)
    rounded = reference.to(torch.bfloat16).float().log_softmax(-1)
    bf16, fp32 = capability.TOLERANCE[torch.bfloat16], capability.TOLERANCE[torch.float32]
    assert capability.log_prob_difference(rounded, reference, bf16) < 0.05  # measured as bfloat16's tolerance does
    assert capability.log_prob_difference(reference[1:], reference[:-1], bf16) > 4 * bf16
    assert capability.log_prob_difference(rounded, reference, fp32) > fp32  # float32's: the plain max
