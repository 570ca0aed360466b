"""The hardware side of the step cost (capacity/hardware.py) and `shuttle plan --device` (capacity/device_plan.py),
checked by hand against stories260K's config.json (hidden 64, 5 layers, 8 heads, 4 KV heads of 8, MLP 172, vocab
512, tied embeddings)."""

import pytest

from shuttle.capacity import device_plan, hardware
from shuttle.launcher.cli import main as shuttle
from tests.server import MODEL_DIR


def test_the_roofline_reads_the_models_dimensions():
    roofline = hardware.roofline_for(MODEL_DIR, "bfloat16", hardware.spec("H100"))
    assert (roofline.hidden, roofline.layers, roofline.heads, roofline.kv_heads, roofline.head_dim,
            roofline.intermediate, roofline.vocab, roofline.dtype_bytes) == (64, 5, 8, 4, 8, 172, 512, 2)
    # q 64x64, k and v 64x32 each, o 64x64, MLP 3 x 64x172: 45,312 weights a layer
    assert roofline.layer_params == 45312
    assert roofline.kv_bytes_per_token == 2 * 5 * 4 * 8 * 2
    assert (roofline.peak_flops, roofline.bandwidth, roofline.device) == (989e12, 3.35e12, "h100")


def test_an_unknown_device_or_a_model_without_dimensions_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown device 'tpu'; known: a10, a100, h100, h200, l4, l40s"):
        hardware.spec("tpu")
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    with pytest.raises(ValueError, match="num_attention_heads"):
        hardware.roofline_for(tmp_path, "float32", hardware.spec("l4"))


def test_the_device_plan_by_hand():
    """bf16 on an H100 (80 GB), 0.9 of it: weights 5 x 45,312 + 512 x 64 (tied) = 259,328 x 2 B; activations
    2,048 x (4 x 64 + 2 x 172) x 2 B + 128 x 512 x 4 B; KV 2 x 5 x 4 x 8 x 2 = 640 B per token. A decode step of 128
    sequences at context 256 is memory-bound: weights read once (259,328 x 2 B, the LM head counted once), 128 x 640 B
    of new K and V, 128 x 512 x 4 B of logits and 128 x 256 x 640 B of context, at 3.35 TB/s."""
    plan = device_plan.build(str(MODEL_DIR), "h100", "bfloat16", max_num_seqs=128, max_num_batched_tokens=2048)
    assert plan.weight_bytes == 259328 * 2
    assert plan.activation_bytes == 2048 * 600 * 2 + 128 * 512 * 4
    assert plan.kv_budget_bytes == int(80e9 * 0.9) - plan.weight_bytes - plan.activation_bytes
    assert plan.num_kv_blocks == plan.kv_budget_bytes // (640 * 16) - 1  # less the null block
    decode_bytes = 259328 * 2 + 128 * 640 + 128 * 512 * 4 + 128 * 256 * 640
    [decode, _] = plan.step_seconds().values()
    assert decode == pytest.approx(decode_bytes / 3.35e12)


def test_shuttle_plan_device_prints_a_plan_for_a_device_that_is_not_here(capsys):
    assert shuttle(["plan", "--device", "h100", "--dtype", "bfloat16", str(MODEL_DIR)]) == 0
    out = capsys.readouterr().out
    assert "on h100 (NVIDIA H100 SXM datasheet: 989 TFLOP/s, 3.35 TB/s, 80 GB)" in out
    assert "KV bytes per token                                     640 B" in out
    assert shuttle(["plan", "--device", "h100", str(MODEL_DIR)]) == 0  # --dtype auto: bfloat16, as serve on CUDA
    assert "(bfloat16) on h100" in capsys.readouterr().out
    assert shuttle(["plan", "--device", "tpu", str(MODEL_DIR)]) == 2
    assert "unknown device 'tpu'" in capsys.readouterr().err


def test_a_device_plan_takes_the_kv_flags_serve_takes(capsys):
    """A trial: --num-kv-blocks, --kv-cache-memory and --attention-backend were ignored by a --device plan, which
    printed the utilization's plan whatever they said."""
    assert device_plan.build(str(MODEL_DIR), "h100", num_kv_blocks=100).num_kv_blocks == 100
    fixed = device_plan.build(str(MODEL_DIR), "h100", kv_cache_memory=2**30)
    assert fixed.kv_budget_bytes == 2**30 and fixed.num_kv_blocks == 2**30 // (640 * 16) - 1
    assert shuttle(["plan", "--device", "h100", "--kv-cache-memory", "1GiB", str(MODEL_DIR)]) == 0
    assert "(--kv-cache-memory)" in capsys.readouterr().out
    for flags, says in ((["--kv-cache-memory", "1TiB"], "does not fit in the h100's memory"),
                        (["--kv-cache-memory", "1KiB"], "leaves the KV cache no block"),
                        (["--attention-backend", "cpu"], "a --device plan does not depend on the attention backend")):
        assert shuttle(["plan", "--device", "h100", *flags, str(MODEL_DIR)]) == 2
        assert says in capsys.readouterr().err


def test_the_microbenchmark_measures_positive_peaks():
    device = hardware.measure("float32", "cpu", matmul_size=128, copy_bytes=2 ** 20, repeats=2)
    assert device.peak_flops > 0 and device.bandwidth > 0 and device.source.startswith("measured")
