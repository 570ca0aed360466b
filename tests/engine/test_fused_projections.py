"""Sibling projections as one oneDNN matmul (worker/fused_projections.py): only where weights are reordered, only
complete groups of unshared weights of one dtype and input width; each member's product is its own within rounding
for any input, one matmul serves a group that reads one tensor, and a model's logits stay its own."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from shuttle.worker import onednn_linear as onednn_module
from shuttle.worker.fused_projections import SharedInputLinear, fuse_sibling_projections
from shuttle.worker.onednn_linear import rounding_bound

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def reordering_cpu_and_small_layers(monkeypatch):
    """An AVX-512 CPU (weights reordered, so siblings fuse) whatever this one is, and tiny layers counted too."""
    monkeypatch.setattr(onednn_module, "packs_weights", lambda: True)
    monkeypatch.setattr(onednn_module, "MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(onednn_module, "MIN_BF16_WEIGHT_BYTES", 0)


def _tiny_llama(tied: bool = False, bias: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         attention_bias=bias)
    return LlamaForCausalLM(config).eval()


def _weights(model: torch.nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    return {name: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone())
            for name, m in model.named_modules() if type(m) is torch.nn.Linear}


@pytest.mark.parametrize("bias", [False, True])
def test_each_member_computes_its_own_product_for_any_input_and_the_logits_stay(bias):
    model = _tiny_llama(bias=bias)
    weights = _weights(model)
    ids = torch.tensor([[5, 9, 2, 44, 7]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert fuse_sibling_projections(model, CPU, tensor_parallel=False, has_bf16_units=False) == 2 * 5
        attention = model.model.layers[1].self_attn
        members = {name: m for name, m in model.named_modules() if isinstance(m, SharedInputLinear)}
        assert sorted(n.rsplit(".", 1)[1] for n in members) == sorted(["q_proj", "k_proj", "v_proj", "gate_proj",
                                                                          "up_proj"] * 2)
        assert all(m.weight.is_meta and m.weight.shape == weights[n][0].shape for n, m in members.items())
        assert attention.q_proj.fused is attention.v_proj.fused is not model.model.layers[0].self_attn.q_proj.fused
        x, other = torch.randn(3, 64), torch.randn(3, 64)
        for name, inputs in (("q_proj", x), ("k_proj", other), ("v_proj", x)):  # k fed another tensor
            weight, b = weights[f"model.layers.1.self_attn.{name}"]
            got = getattr(attention, name)(inputs)
            assert ((got - F.linear(inputs, weight, b)).abs() <= rounding_bound(inputs, weight, b)).all(), name
        after = model(input_ids=ids).logits
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    assert torch.allclose(after, before, rtol=0, atol=1e-5)


def test_one_matmul_serves_a_group_reading_one_tensor(monkeypatch):
    model = _tiny_llama()
    fuse_sibling_projections(model, CPU, tensor_parallel=False, has_bf16_units=False)
    calls = []
    product = onednn_module.onednn_linear
    monkeypatch.setattr(onednn_module, "onednn_linear", lambda *a: calls.append(a[0]) or product(*a))
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    x = torch.randn(2, 64)
    with torch.inference_mode():
        q, k, v = attention.q_proj(x), attention.k_proj(x), attention.v_proj(x)
        assert len(calls) == 1 and [t.shape[-1] for t in (q, k, v)] == [64, 32, 32]
        attention.q_proj(x)  # a member asked again: the group's product anew (never one kept past its use)
        mlp.up_proj(x), mlp.gate_proj(x)  # any order
        assert len(calls) == 3
    assert attention.q_proj.fused._input is not None and mlp.up_proj.fused._input is None  # let go once all took


def test_incomplete_shared_mixed_or_unreordered_groups_stay_apart(monkeypatch):
    tied = _tiny_llama(tied=True)
    attention = tied.model.layers[0].self_attn
    tied.model.layers[1].mlp.up_proj.weight = tied.model.layers[1].mlp.gate_proj.weight  # one weight, two places
    tied.model.layers[1].self_attn.v_proj = torch.nn.Identity()  # q and k without v
    tied.model.layers[0].mlp.up_proj = tied.model.layers[0].mlp.up_proj.to(torch.bfloat16)  # two dtypes
    assert fuse_sibling_projections(tied, CPU, tensor_parallel=False, has_bf16_units=True) == 3  # layer 0's q/k/v
    assert isinstance(attention.q_proj, SharedInputLinear)
    assert type(tied.model.layers[1].self_attn.q_proj) is torch.nn.Linear
    assert type(tied.model.layers[0].mlp.gate_proj) is torch.nn.Linear
    assert type(tied.model.layers[1].mlp.gate_proj) is torch.nn.Linear
    assert fuse_sibling_projections(_tiny_llama(), CPU, tensor_parallel=True, has_bf16_units=False) == 0
    monkeypatch.setattr(onednn_module, "packs_weights", lambda: False)  # row-major weights: no fusing
    assert fuse_sibling_projections(_tiny_llama(), CPU, tensor_parallel=False, has_bf16_units=False) == 0


def test_a_group_whose_fused_product_fails_the_start_up_check_stays_apart(monkeypatch):
    model = _tiny_llama()
    monkeypatch.setattr(onednn_module, "onednn_is_close", lambda weight, bias, packed: weight.shape[0] != 64 + 2 * 32)
    assert fuse_sibling_projections(model, CPU, tensor_parallel=False, has_bf16_units=False) == 2 * 2  # gate/up
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no bfloat16 oneDNN matmul here")
def test_bfloat16_groups_fuse_where_the_cpu_has_bf16_units():
    model = _tiny_llama().to(torch.bfloat16)
    assert fuse_sibling_projections(model, CPU, tensor_parallel=False, has_bf16_units=False) == 0
    assert fuse_sibling_projections(model, CPU, tensor_parallel=False, has_bf16_units=True) == 2 * 5
    assert model.model.layers[0].mlp.up_proj.fused.weight.dtype == torch.bfloat16
