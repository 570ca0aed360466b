"""The GPU worker's CPU-checkable parts: --device parsing and the device each rank of each serving group owns
(fabricated device counts), the auto rules for dtype and attention backend, the KV-sizing arithmetic of
--gpu-memory-utilization from fabricated memory figures, the profiling step's shape, the staging of step inputs,
and the start-up lines."""

import argparse
import dataclasses

import pytest
import torch

from shuttle.common.capacity import kv_cache_bytes
from shuttle.common.config import IpcConfig, ShuttleConfig, WorkerConfig
from shuttle.common.devices import (
    DeviceError,
    check_device_count,
    parse_device,
    rank_device,
    resolve_attention_backend,
    resolve_config,
    resolve_device,
    resolve_dtype,
)
from shuttle.common.model_config import ModelConfig
from shuttle.launcher.cli import build_parser
from shuttle.launcher.commands import serve
from shuttle.launcher.launcher import capacity_lines
from shuttle.worker.flex_attention import max_kv_blocks_for
from shuttle.worker.input_batch import InputBatch
from shuttle.worker.kv_cache import KVCache
from shuttle.worker.kv_sizing import (
    KVSizingError,
    MemoryFigures,
    MemorySnapshot,
    figures_from_snapshots,
    plan_kv_blocks,
    profile_plan,
)
from shuttle.worker.model_loader import LayerGeometry
from shuttle.worker.parallel import local_device
from shuttle.worker.staging import StepStaging
from tests.server import MODEL_DIR

GiB, MiB = 2**30, 2**20


# ---- devices ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,want", [("auto", "auto"), ("cpu", "cpu"), ("cuda", "cuda:0"), ("CUDA:3", "cuda:3"),
                                       (" cuda:10 ", "cuda:10")])
def test_device_values(text, want):
    assert parse_device(text) == want


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:-1", "cpu:0", "auto:1", "cuda:x", ""])
def test_bad_device_values_are_usage_errors(text):
    with pytest.raises(argparse.ArgumentTypeError, match="auto, cpu, cuda or cuda:N"):
        parse_device(text)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--device", text])


def test_auto_is_cuda_when_there_is_one():
    assert resolve_device("auto", 0) == "cpu" and resolve_device("auto", 1) == "cuda:0"
    assert resolve_device("cpu", 8) == "cpu" and resolve_device("cuda:2", 0) == "cuda:2"


def test_each_rank_of_each_group_owns_a_device():
    # 2 groups x 2 ranks from cuda:1: group 0 on cuda:1, cuda:2; group 1 on cuda:3, cuda:4
    owned = {(g, r): rank_device("cuda:1", g, r, 2) for g in range(2) for r in range(2)}
    assert owned == {(0, 0): "cuda:1", (0, 1): "cuda:2", (1, 0): "cuda:3", (1, 1): "cuda:4"}
    assert len(set(owned.values())) == 4
    assert {rank_device("cpu", g, r, 2) for g in range(3) for r in range(2)} == {"cpu"}
    assert local_device("cuda:1", 1, 1, 2, cuda_devices=5) == torch.device("cuda:4")
    assert local_device("auto", 0, 1, 2, cuda_devices=0) == torch.device("cpu")
    with pytest.raises(DeviceError, match="rank 1 of serving group 1 would own cuda:4, but this machine has 4"):
        local_device("cuda:1", 1, 1, 2, cuda_devices=4)


def test_too_few_devices_are_refused_in_one_line():
    check_device_count("cuda:0", 2, 2, 4)
    check_device_count("cpu", 8, 8, 0)
    with pytest.raises(DeviceError) as refused:
        check_device_count("cuda:1", 2, 2, 4)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith("--device cuda:1: 2 serving group(s) x 2 tensor-parallel rank(s) need one CUDA device "
                              "each (cuda:1..cuda:4), but this machine has 4")
    with pytest.raises(DeviceError, match=r"\(cuda:0\), but this machine has 0"):
        check_device_count("cuda:0", 1, 1, 0)


def test_auto_dtype_and_backend_follow_the_device():
    assert resolve_dtype("auto", "cuda:1") == "bfloat16" and resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cuda:0") == "float16" and resolve_dtype("float32", "cuda:0") == "float32"
    assert resolve_attention_backend("auto", "cuda:0") == "flex" and resolve_attention_backend("auto", "cpu") == "cpu"
    assert resolve_attention_backend("reference", "cuda:0") == "reference"


def _config(*flags: str) -> ShuttleConfig:
    args = build_parser().parse_args(["serve", str(MODEL_DIR), *flags])
    return ShuttleConfig.from_args(args, IpcConfig.in_directory("/x", tensor_parallel_size=args.tensor_parallel_size))


def test_the_launcher_resolves_auto_once():
    config = _config()
    assert (config.worker.device, config.model.dtype, config.worker.attention_backend) == ("auto", "auto", "auto")
    on_cpu = resolve_config(config, 1, cuda_devices=0)
    assert (on_cpu.worker.device, on_cpu.model.dtype, on_cpu.worker.attention_backend) == ("cpu", "float32", "cpu")
    on_gpu = resolve_config(config, 1, cuda_devices=1)
    assert (on_gpu.worker.device, on_gpu.model.dtype, on_gpu.worker.attention_backend) == ("cuda:0", "bfloat16",
                                                                                           "flex")
    explicit = resolve_config(_config("--dtype", "float32", "--attention-backend", "reference"), 1, cuda_devices=1)
    assert (explicit.model.dtype, explicit.worker.attention_backend) == ("float32", "reference")
    assert ShuttleConfig.from_json(on_gpu.to_json()) == on_gpu  # what every child process reads


def test_tensor_and_data_parallel_device_counts():
    config = _config("--device", "cuda", "--tensor-parallel-size", "2")  # stories260K: 8 heads, 4 KV heads
    assert resolve_config(config, 2, cuda_devices=4).worker.device == "cuda:0"
    with pytest.raises(DeviceError, match="2 serving group\\(s\\) x 2 tensor-parallel rank\\(s\\)"):
        resolve_config(config, 2, cuda_devices=3)
    with pytest.raises(DeviceError, match="this machine has 0"):  # auto finds none: the CPU instead, never refused
        resolve_config(_config("--device", "cuda:0"), 1, cuda_devices=0)
    assert resolve_config(_config("--tensor-parallel-size", "2"), 4, cuda_devices=0).worker.device == "cpu"


def test_serve_refuses_a_missing_cuda_device_before_starting_anything(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    args = build_parser().parse_args(["serve", str(MODEL_DIR), "--device", "cuda:0", "--port", "0"])
    assert serve(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["shuttle: error: --device cuda:0: 1 serving group(s) x 1 tensor-parallel rank(s) need one CUDA "
                   "device each (cuda:0), but this machine has 0 (lower --data-parallel-size / "
                   "--tensor-parallel-size, or choose --device)"]


# ---- KV sizing arithmetic (fabricated figures) -------------------------------------------------------------------

def _figures(**changes) -> MemoryFigures:
    base = dict(total=100 * GiB, free_at_start=99 * GiB, weights=10 * GiB, activation_peak=2 * GiB,
                non_torch_increase=1 * GiB)
    return MemoryFigures(**{**base, **changes})


def test_the_budget_is_what_weights_activations_non_torch_and_graphs_leave():
    bytes_per_token, bs = 131072, 16  # Llama-3-8B in bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
    plan = plan_kv_blocks(_figures(), 0.9, bytes_per_token, bs, 8192, graph_allowance=512 * MiB)
    requested = 90 * GiB
    available = requested - 13 * GiB - 512 * MiB
    assert plan.requested == requested and plan.available == available and plan.total == 100 * GiB
    # available // one block's bytes, less the null block
    assert plan.num_blocks == available // (bs * bytes_per_token) - 1 == 39167
    assert plan.kv_bytes == kv_cache_bytes(plan.num_blocks, bs, bytes_per_token) <= available
    assert (plan.num_blocks + 2) * bs * bytes_per_token > available  # one more block would not fit
    assert plan.requests_fit == plan.num_blocks // 512 and not plan.capped and plan.flex_cap is None


def test_requested_rounds_up_and_a_negative_non_torch_change_counts_zero():
    plan = plan_kv_blocks(_figures(total=1000, free_at_start=1000, weights=0, activation_peak=0,
                                   non_torch_increase=-50), 0.333, 1, 1, 1)
    assert plan.requested == 333 and plan.available == 333 and plan.num_blocks == 332


def test_the_flex_cap_binds_for_few_wide_layers():
    geometry = [LayerGeometry(32, 128, 128)] * 4  # 4 layers of 32 KV heads x 128: 65536 bytes/token in bf16
    cap = max_kv_blocks_for(geometry, 16)
    assert cap == (2**31 - 1) // (16 * 32 * 128) - 1 == 32766
    assert (cap + 1) * 16 * 32 * 128 <= 2**31 - 1 < (cap + 2) * 16 * 32 * 128  # one layer's view stays addressable
    bytes_per_token = KVCache.bytes_per_token_of(geometry, torch.bfloat16)
    plan = plan_kv_blocks(_figures(total=139 * GiB, free_at_start=139 * GiB, weights=GiB), 0.9, bytes_per_token,
                          16, 4096, max_blocks=cap)
    assert plan.capped and plan.num_blocks == cap and plan.flex_cap == cap
    small = plan_kv_blocks(_figures(total=20 * GiB, free_at_start=20 * GiB, weights=GiB), 0.9, bytes_per_token, 16,
                           4096, max_blocks=cap)
    assert not small.capped and small.num_blocks < cap


def test_a_budget_without_room_for_one_max_model_len_request_is_refused():
    bytes_per_token, bs = 131072, 16
    with pytest.raises(KVSizingError, match="one request of max_model_len 131072 needs 8192 blocks") as refused:
        plan_kv_blocks(_figures(total=24 * GiB, free_at_start=24 * GiB, weights=15 * GiB), 0.9, bytes_per_token, bs,
                       131072)
    assert "raise --gpu-memory-utilization" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(KVSizingError, match="0 blocks"):  # weights alone over the budget
        plan_kv_blocks(_figures(total=16 * GiB, free_at_start=16 * GiB, weights=15 * GiB), 0.9, bytes_per_token,
                       bs, 16)
    blocks = 8192  # exactly one request's blocks (and the null block) fit: served
    budget = (blocks + 1) * bs * bytes_per_token
    plan = plan_kv_blocks(MemoryFigures(budget, budget, 0, 0, 0), 1.0, bytes_per_token, bs, 131072)
    assert plan.num_blocks == blocks and plan.requests_fit == 1


def test_a_device_already_in_use_is_refused():
    with pytest.raises(KVSizingError, match="only 40.00 GiB was free at start"):
        plan_kv_blocks(_figures(free_at_start=40 * GiB), 0.9, 1024, 16, 16)


def test_figures_from_snapshots():
    baseline = MemorySnapshot(free=95 * GiB, total=100 * GiB, torch_allocated=0, torch_peak=0, torch_reserved=0)
    before = MemorySnapshot(free=84 * GiB, total=100 * GiB, torch_allocated=11 * GiB, torch_peak=12 * GiB,
                            torch_reserved=11 * GiB)  # weights 10 GiB + a 1 GiB scratch cache
    peak = MemorySnapshot(free=80 * GiB, total=100 * GiB, torch_allocated=11 * GiB, torch_peak=14 * GiB,
                          torch_reserved=15 * GiB)
    after = MemorySnapshot(free=83 * GiB, total=100 * GiB, torch_allocated=11 * GiB, torch_peak=14 * GiB,
                           torch_reserved=11 * GiB)  # 1 GiB more outside torch (NCCL, cuBLAS) than at baseline
    assert baseline.non_torch == 5 * GiB and after.non_torch == 6 * GiB
    figures = figures_from_snapshots(baseline, before, peak, after, scratch_bytes=GiB)
    assert figures == MemoryFigures(total=100 * GiB, free_at_start=95 * GiB, weights=10 * GiB,
                                    activation_peak=3 * GiB, non_torch_increase=GiB)


# ---- the profiling step ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,seqs,max_len,lengths", [
    (2048, 128, 4096, [16] * 128), (100, 128, 4096, [1] * 100), (8192, 1, 2048, [2048]),
    (10, 4, 512, [3, 3, 2, 2])])
def test_profile_plan_spreads_the_step_budget(tokens, seqs, max_len, lengths):
    plan, blocks = profile_plan(tokens, seqs, max_len, 16, 512)
    assert [r.num_scheduled_tokens for r in plan.new_requests] == lengths
    assert all(len(r.token_ids) == r.num_scheduled_tokens and r.num_computed_tokens == 0 for r in plan.new_requests)
    ids = [b for r in plan.new_requests for b in r.block_ids]
    assert ids == list(range(blocks)) and blocks == sum(-(-n // 16) for n in lengths)
    params = plan.new_requests[0].sampling
    assert params.top_k and params.top_p < 1 and params.min_p > 0 and not params.greedy  # the sampler's full path
    assert all(0 <= t < 512 for r in plan.new_requests for t in r.token_ids)


def test_the_profiling_step_runs_on_the_worker(runner):
    plan, blocks = profile_plan(96, 8, 64, runner.block_size, 512)
    scratch = KVCache.allocate(runner.geometry, runner.block_size, runner.dtype, runner.device, blocks, 0)
    state = runner.sampler.generator.get_state()
    runner.profile_step(plan, scratch, 64)
    assert torch.equal(runner.sampler.generator.get_state(), state)  # the worker's random state is untouched
    assert not runner.batch.requests  # nothing of the step stays in the worker's own batch
    assert any(k.abs().sum() > 0 for k, _ in scratch.layers)  # it wrote into the scratch cache, not the real one


@pytest.fixture(scope="module")
def runner():
    from shuttle.worker.worker import ModelRunner
    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/nonexistent"),
                           worker=WorkerConfig(device="cpu"))
    made = ModelRunner(config)
    assert made.device == torch.device("cpu") and made.dtype == torch.float32 and made.backend.name == "cpu"
    assert made.kv_plan is None and made.activation_peak_bytes == 0 and made.kv_budget == "--kv-cache-memory 1024 MiB"
    return made


# ---- staging ------------------------------------------------------------------------------------------------------

def _step_inputs(block_size=4):
    from shuttle.common.messages import NewRequestData, StepPlan
    from shuttle.common.sampling import SamplingParams
    batch = InputBatch(block_size, 99, 8)
    plan = StepPlan(
        step_id=0,
        new_requests=[
            NewRequestData(
                request_id="a",
                token_ids=list(range(10)),
                sampling=SamplingParams(),
                block_ids=[3, 4, 5],
                num_computed_tokens=0,
                num_scheduled_tokens=10,
            ),
            NewRequestData(
                request_id="b",
                token_ids=[7, 8, 9],
                sampling=SamplingParams(),
                block_ids=[6],
                num_computed_tokens=0,
                num_scheduled_tokens=3,
            ),
        ],
        cached_requests=[],
    )
    return batch.pack(batch.apply(plan))


def test_staging_round_trip_keeps_values_and_dtypes():
    inputs = _step_inputs()
    assert StepStaging(torch.device("cpu"))(inputs, inputs.logits_rows).input_ids is inputs.input_ids  # CPU: as is
    staging = StepStaging(torch.device("cpu"), stage=True)
    step = staging(inputs, inputs.logits_rows)
    meta, staged = inputs.attention, step.attention
    for want, got in (
        (inputs.input_ids, step.input_ids),
        (inputs.positions, step.positions),
        (inputs.logits_rows, step.logits_rows),
        (meta.slot_mapping, staged.slot_mapping),
        (meta.query_start_loc, staged.query_start_loc),
        (meta.seq_lens, staged.seq_lens),
        (meta.block_table, staged.block_table),
    ):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert staged.seq_lens_list == meta.seq_lens_list and staged.num_decodes == meta.num_decodes
    before = step.input_ids.clone()
    staging(_step_inputs(block_size=2), inputs.logits_rows)  # the next step refills the buffer ...
    assert torch.equal(step.input_ids, before)  # ... without touching the previous step's tensors


# ---- start-up lines -----------------------------------------------------------------------------------------------


def test_start_up_lines_on_cuda():
    config = dataclasses.replace(_config("--tensor-parallel-size", "2"), model=ModelConfig.from_dir(MODEL_DIR))
    cap = {
        "num_kv_blocks": 1000,
        "block_size": 16,
        "kv_tokens": 16000,
        "kv_bytes_per_token": 1280,
        "weight_bytes": 2 * GiB + 50 * MiB,
        "activation_peak_bytes": 600 * MiB,
        "device": "cuda:0",
        "dtype": "bfloat16",
        "attention_backend": "flex",
        "kv_budget": "--gpu-memory-utilization 0.9 of 139.8 GiB",
    }
    lines = capacity_lines(config, cap, groups=2)
    assert lines == [
        "KV cache 1000 blocks x 16 tokens = 16000 tokens (1280 bytes/token) in 19.6 MiB; 31 requests of "
        "max_model_len 512 fit; weights 2.05 GiB, activation peak 600.0 MiB",
        "worker on cuda:0..cuda:3, bfloat16, flex attention; KV cache sized by --gpu-memory-utilization 0.9 of "
        "139.8 GiB",
    ]


def test_start_up_lines_on_the_cpu():
    config = ShuttleConfig(model=ModelConfig.from_dir(MODEL_DIR), ipc=IpcConfig.in_directory("/x"))
    cap = {
        "num_kv_blocks": 3275,
        "block_size": 16,
        "kv_tokens": 52400,
        "kv_bytes_per_token": 1280,
        "weight_bytes": 1 * MiB,
        "activation_peak_bytes": 0,
        "device": "cpu",
        "dtype": "float32",
        "attention_backend": "cpu",
        "kv_budget": "--kv-cache-memory 64 MiB",
    }
    first, second = capacity_lines(config, cap)
    assert first.endswith("; 102 requests of max_model_len 512 fit; weights 1.0 MiB")  # no profile on the CPU
    assert second == "worker on cpu, float32, cpu attention; KV cache sized by --kv-cache-memory 64 MiB"
