"""The column-chunked output projection gives the same logits, bit for bit, and is only used where it is exact; bf16
linears on a CPU without bf16 units compute the float32 product of their bf16 values, rounded once."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shuttle.worker import bf16_gemv
from shuttle.worker.bf16_gemv import bf16_linear_rows
from shuttle.worker.output_projection import (
    MIN_COLUMNS,
    WIDEN_CHUNK,
    ColumnChunkedLinear,
    chunk_output_projection,
    widen_bf16_linears,
)


def test_chunked_linear_equals_linear_bit_for_bit():
    """At one torch thread (tests/conftest.py starts every test so). With more, torch's single-row product splits
    its work by the column count, so chunks round differently from the whole in the last bit."""
    generator = torch.Generator().manual_seed(0)
    for bias in (False, True):
        linear = torch.nn.Linear(96, MIN_COLUMNS + 300, bias=bias)  # a last chunk shorter than the others
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator))
        for rows in (1, 7, 64):
            hidden = torch.randn(1, rows, 96, generator=generator)
            assert torch.equal(ColumnChunkedLinear(linear)(hidden), linear(hidden))


def _tiny_llama(vocab: int, tie: bool) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tie)
    return LlamaForCausalLM(config).eval()


def test_a_large_float32_head_on_the_cpu_is_swapped_and_stays_tied():
    model = _tiny_llama(MIN_COLUMNS, tie=True)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert chunk_output_projection(model, torch.device("cpu"), tensor_parallel=False)
        assert isinstance(model.get_output_embeddings(), ColumnChunkedLinear)
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        assert torch.equal(model(input_ids=ids).logits, before)


def test_small_heads_other_dtypes_and_tensor_parallel_keep_the_plain_head():
    assert not chunk_output_projection(_tiny_llama(512, tie=False), torch.device("cpu"), tensor_parallel=False)
    assert not chunk_output_projection(_tiny_llama(MIN_COLUMNS, tie=False), torch.device("cpu"), tensor_parallel=True)
    assert not chunk_output_projection(_tiny_llama(MIN_COLUMNS, tie=False).to(torch.bfloat16), torch.device("cpu"),
                                       tensor_parallel=False)


@pytest.mark.parametrize("leading", [(1,), (3, 5), (4, 9)], ids=["1 row", "15 rows", "36 rows"])
def test_widened_bf16_linear_is_the_float32_product_of_its_bf16_values_rounded_once(leading, monkeypatch):
    """Up to GEMV_MAX_ROWS rows through worker/bf16_gemv.py's kernel, more through the widened float32 chunks: the
    same products either way."""
    calls = []
    monkeypatch.setattr(bf16_gemv, "bf16_linear_rows", lambda *a: calls.append(1) or bf16_linear_rows(*a))
    torch.manual_seed(0)
    for out_features, bias in ((600, True), (MIN_COLUMNS, False)):  # a partial last chunk; no bias
        linear = torch.nn.Linear(96, out_features, bias=bias).to(torch.bfloat16)
        hidden = torch.randn(*leading, 96).to(torch.bfloat16)
        with torch.inference_mode():
            out = ColumnChunkedLinear(linear, WIDEN_CHUNK, widen=True)(hidden)
            # the same dot products in float64 from the same bf16 values, rounded to bf16 once
            exact = torch.nn.functional.linear(hidden.double(), linear.weight.double(),
                                               None if linear.bias is None else linear.bias.double())
        assert out.dtype == torch.bfloat16 and out.shape == (*leading, out_features)
        rounded = exact.to(torch.bfloat16)
        # float32 accumulation can land on the neighbouring bf16 value when the exact sum sits near a tie
        assert (out.double() - rounded.double()).abs().le(rounded.double().abs() * 2 ** -7 + 1e-6).all()
        assert (out == rounded).float().mean() > 0.95
    rows = torch.Size(leading).numel()
    assert len(calls) == (2 if rows <= bf16_gemv.GEMV_MAX_ROWS else 0)


def test_bf16_rows_kernel_refuses_a_weight_it_cannot_read():
    with pytest.raises(ValueError, match="bf16_linear_rows: weight"):
        bf16_linear_rows(torch.ones(1, 4), torch.ones(3, 4))  # float32 weight
    with pytest.raises(ValueError, match="bf16_linear_rows: weight"):
        bf16_linear_rows(torch.ones(1, 4), torch.ones(3, 5, dtype=torch.bfloat16))


def test_widening_swaps_every_bf16_linear_keeps_tied_weights_and_only_without_bf16_units():
    model = _tiny_llama(512, tie=True).to(torch.bfloat16)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    cpu = torch.device("cpu")
    assert widen_bf16_linears(model, cpu, tensor_parallel=False, has_bf16_units=True) == 0
    assert widen_bf16_linears(model, cpu, tensor_parallel=True, has_bf16_units=False) == 0
    assert widen_bf16_linears(model, cpu, tensor_parallel=False, has_bf16_units=False) == linears
    wrapped = {id(m.linear) for m in model.modules() if isinstance(m, ColumnChunkedLinear) and m.widen}
    assert len(wrapped) == linears  # every plain linear left is one a widening wrapper holds
    assert all(id(m) in wrapped for m in model.modules() if type(m) is torch.nn.Linear)
    head = model.get_output_embeddings()
    assert isinstance(head, ColumnChunkedLinear) and head.widen
    assert head.weight is model.get_input_embeddings().weight  # still tied
    ids = torch.tensor([[1, 5, 9, 13]])
    with torch.inference_mode():
        assert model(ids).logits.dtype == torch.bfloat16
