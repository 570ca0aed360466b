"""The column-chunked output projection gives the same logits, bit for bit, and is only used where it is exact."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from worker.output_projection import MIN_COLUMNS, ColumnChunkedLinear, chunk_output_projection


def test_chunked_linear_equals_linear_bit_for_bit():
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
