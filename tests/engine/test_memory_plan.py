"""`shuttle plan`: the memory arithmetic, and KV figures that agree with the worker's allocation and the
launcher's start-up line because they come from the same code (common/capacity.py)."""


import pytest
import torch

from shuttle.capacity.memory_plan import build_plan, concurrency_table
from shuttle.common.capacity import blocks_per_request, kv_blocks_for_memory, kv_cache_bytes, requests_that_fit
from shuttle.common.config import CacheConfig, IpcConfig, ShuttleConfig
from shuttle.common.model_config import ModelConfig
from shuttle.launcher.cli import build_parser
from shuttle.launcher.launcher import capacity_lines
from shuttle.worker.kv_cache import KVCache
from shuttle.worker.kv_sizing import KVSizingError
from shuttle.worker.model_loader import LayerGeometry
from tests.server import MODEL_DIR

MiB = 2**20


def test_kv_arithmetic():
    # 64 MiB / (1280 B x 16 tokens) = 3276.8: 3276 whole blocks, one of them the null block
    assert kv_blocks_for_memory(64 * MiB, 1280, 16) == 3275
    assert kv_cache_bytes(3275, 16, 1280) == 3276 * 16 * 1280
    assert blocks_per_request(512, 16) == 32 and blocks_per_request(513, 16) == 33 and blocks_per_request(1, 16) == 1
    assert requests_that_fit(3275, 16, 512) == 102 and requests_that_fit(3275, 16, 500) == 102
    assert requests_that_fit(100, 16, 4096) == 0


def test_concurrency_table_rows():
    rows = concurrency_table(3275, 16, 512, max_num_seqs=128)
    assert [(r.context_len, r.blocks_per_request, r.fit_in_kv, r.concurrent, r.limited_by) for r in rows] == [
        (256, 16, 204, 128, "max_num_seqs"), (512, 32, 102, 102, "KV cache")]
    assert [r.context_len for r in concurrency_table(10**6, 16, 8192, 128)] == [256, 1024, 4096, 8192]


def test_worker_allocates_what_the_arithmetic_says():
    geometry = [LayerGeometry(2, 16, 16)] * 5
    cache = KVCache.allocate(geometry, 16, torch.float32, torch.device("cpu"), None, 4 * MiB)
    assert cache.bytes_per_token == 5 * 2 * 32 * 4
    assert cache.num_blocks == kv_blocks_for_memory(4 * MiB, cache.bytes_per_token, 16)
    assert sum(k.numel() * 4 + v.numel() * 4 for k, v in cache.layers) == kv_cache_bytes(cache.num_blocks, 16,
                                                                                      cache.bytes_per_token)


def test_a_budget_without_a_block_is_a_start_up_refusal():
    """`--kv-cache-memory 2048` (bytes, meant as MiB) is refused with the error the worker turns into one line."""
    geometry = [LayerGeometry(2, 16, 16)] * 5
    with pytest.raises(KVSizingError, match="--kv-cache-memory 2048 bytes holds no KV block of 16 tokens "
                                            r"\(1280 bytes/token, and one null block\); it takes bytes or a unit"):
        KVCache.allocate(geometry, 16, torch.float32, torch.device("cpu"), None, 2048)


@pytest.fixture(scope="module")
def plan():
    return build_plan(str(MODEL_DIR), dtype="float32", kv_cache_memory=64 * MiB, gpu_memory_utilization=0.9,
                      max_num_seqs=64, max_num_batched_tokens=512, measure_processes=False)


def test_plan_agrees_with_the_start_up_line(plan):
    """The launcher's line from the figures a worker with the same flags reports, next to the plan's."""
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"),
                           cache=CacheConfig(kv_cache_memory=64 * MiB))
    worker_blocks = kv_blocks_for_memory(64 * MiB, plan.kv_bytes_per_token, 16)
    cap = {"num_kv_blocks": worker_blocks, "block_size": 16, "kv_tokens": worker_blocks * 16,
           "kv_bytes_per_token": plan.kv_bytes_per_token}
    line = "shuttle: " + capacity_lines(config, cap)[0]
    row = plan.concurrency[-1]
    assert row.context_len == model.max_model_len == 512
    assert line == (f"shuttle: KV cache {plan.num_kv_blocks} blocks x 16 tokens = {plan.kv_tokens} tokens "
                    f"({plan.kv_bytes_per_token} bytes/token) in {plan.kv_cache_bytes / MiB:.1f} MiB; {row.fit_in_kv} "
                    f"requests of max_model_len 512 fit")


def test_plan_figures(plan):
    assert plan.kv_bytes_per_token == 1280  # stories260K: 5 layers x 4 KV heads x (8 + 8) dims x 4 bytes
    assert plan.num_kv_blocks == 3275 and plan.kv_tokens == 52400
    from tests.conftest import hf_model
    assert plan.weight_bytes == sum(p.numel() * 4 for p in hf_model().parameters())
    assert 0 < plan.peak_activation_bytes < 256 * MiB and plan.peak_activation_step
    assert plan.worker_peak_rss_bytes == (plan.worker_loaded_rss_bytes + plan.kv_cache_bytes
                                          + plan.peak_activation_bytes + 36 * plan.kv_tokens)
    assert plan.queue_bytes_per_prompt_token > 8  # a list slot, plus an int object for most ids
    assert any("CUDA device only" in note for note in plan.notes)
    text = plan.render()
    assert "worker peak RSS at full KV use" in text
    assert "     512          32        102          64  max_num_seqs" in text
    data = plan.to_json()
    assert data["kv_tokens"] == 52400 and data["concurrency"][-1]["fit_in_kv"] == 102


def test_cli_accepts_one_kv_budget_only():
    args = build_parser().parse_args(["plan", "m", "--gpu-memory-utilization", "0.8", "--json"])
    assert args.gpu_memory_utilization == 0.8 and args.kv_cache_memory is None and args.json
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "m", "--gpu-memory-utilization", "0.8", "--kv-cache-memory", "1GiB"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "m", "--gpu-memory-utilization", "1.5"])


def test_plan_resolves_auto_dtype_as_serve_does():
    """`shuttle plan` defaults to --dtype auto and plans the dtype `shuttle serve` picks on this machine (bfloat16 on a
    CPU with bf16 matrix units): a new user's plan said float32 where the server started in bfloat16."""
    from shuttle.common.devices import resolve_dtype
    from shuttle.launcher.cli import build_parser

    assert build_parser().parse_args(["plan"]).dtype == "auto"
    auto = build_plan(str(MODEL_DIR), kv_cache_memory=16 * MiB, max_num_seqs=8, max_num_batched_tokens=64,
                      measure_processes=False)
    assert auto.dtype == resolve_dtype("auto", "cpu")
    assert auto.kv_bytes_per_token == (640 if auto.dtype == "bfloat16" else 1280)
