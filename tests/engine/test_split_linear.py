"""float32 linears split by output columns over the worker's threads (worker/split_linear.py): the one-row product is
F.linear's bit for bit where the start-up check passes, other row counts agree to float32 rounding, the right layers
are wrapped, and an engine on two threads gives transformers' greedy tokens, token for token."""

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
from shuttle.worker import split_linear as split_module
from shuttle.worker.output_projection import MIN_COLUMNS, ColumnChunkedLinear, chunk_output_projection
from shuttle.worker.split_linear import (
    SPLIT_MAX_ROWS,
    SplitColumnsLinear,
    column_groups,
    split_float32_linears,
    split_is_exact,
    split_linear,
)
from shuttle.worker.worker import ModelRunner
from tests.server import MODEL_DIR

CPU = torch.device("cpu")


@pytest.fixture
def two_threads():
    """Two torch threads for the test (the split needs two), back to the suite's one after it, numba's too (the
    decode kernel's warm-up sets numba's count from torch's)."""
    torch.set_num_threads(2)
    yield
    numba.set_num_threads(1)
    torch.set_num_threads(1)


def test_column_groups_divide_the_columns_evenly_over_the_threads():
    assert column_groups(768, 2) == 2
    assert column_groups(2304, 2) == 4  # 1152 columns would be over MAX_GROUP_COLUMNS
    assert column_groups(32000, 2) == 32  # groups of 1000
    assert column_groups(4096, 16) == 16
    assert column_groups(768, 1) == 1
    assert column_groups(7, 2) == 1  # nothing divides a prime: not split
    assert column_groups(9, 4) == 3  # no multiple of 4 divides 9: the most groups up to 4 that do


def test_one_row_is_f_linear_bit_for_bit_and_more_rows_agree_to_rounding(two_threads):
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features, bias in ((2304, 768, False), (768, 768, True), (768, 2048, False)):
        weight = torch.randn(out_features, in_features, generator=generator)
        b = torch.randn(out_features, generator=generator) if bias else None
        groups = column_groups(out_features, 2)
        row = torch.randn(1, in_features, generator=generator)
        assert torch.equal(split_linear(row, weight, b, groups), F.linear(row, weight, b))
        for rows in (2, 5, 9, 16, 64, SPLIT_MAX_ROWS):
            x = torch.randn(rows, in_features, generator=generator)
            # two float32 sums of the same K products in any orders differ by at most 2 K u sum|products| (u = 2^-24,
            # the classic bound of recursive summation: Higham, Accuracy and Stability of Numerical Algorithms, 4.2)
            bound = 2 * in_features * 2.0 ** -24 * (F.linear(x.abs(), weight.abs()) + (0 if b is None else b.abs()))
            assert ((split_linear(x, weight, b, groups) - F.linear(x, weight, b)).abs() <= bound).all()


def test_above_the_row_limit_the_wrapped_layer_computes(two_threads, monkeypatch):
    linear = torch.nn.Linear(64, 128)
    layer = SplitColumnsLinear(linear, column_groups(128, 2))
    calls = []
    monkeypatch.setattr(split_module, "split_linear", lambda *a: calls.append(a[0].shape) or F.linear(*a[:3]))
    with torch.inference_mode():
        assert layer(torch.randn(1, SPLIT_MAX_ROWS, 64)).shape == (1, SPLIT_MAX_ROWS, 128)
        assert calls == [(SPLIT_MAX_ROWS, 64)]
        hidden = torch.randn(1, SPLIT_MAX_ROWS + 1, 64)
        assert torch.equal(layer(hidden), linear(hidden))
    assert len(calls) == 1
    assert layer.weight is linear.weight and layer.bias is linear.bias


def _tiny_llama(vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def test_every_float32_linear_and_the_chunked_head_are_wrapped_once_and_stay_tied(two_threads):
    model = _tiny_llama(MIN_COLUMNS)
    assert chunk_output_projection(model, CPU, tensor_parallel=False)
    ids = torch.tensor([[5]])  # one row through every linear
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        assert split_float32_linears(model, CPU, tensor_parallel=False, threads=2) == 2 * 7 + 1
        head = model.get_output_embeddings()
        assert isinstance(head, SplitColumnsLinear) and isinstance(head.linear, ColumnChunkedLinear)
        assert type(head.linear.linear) is torch.nn.Linear  # the chunked head's own linear is not wrapped again
        assert head.weight is model.get_input_embeddings().weight
        assert all(type(child) is not torch.nn.Linear or isinstance(parent, SplitColumnsLinear) or parent is head.linear
                   for parent in model.modules() for child in parent.children())
        assert torch.equal(model(input_ids=ids).logits, before)


def test_one_thread_tensor_parallel_other_dtypes_and_inexact_shapes_are_left_alone(two_threads, monkeypatch):
    assert split_float32_linears(_tiny_llama(512), CPU, tensor_parallel=False, threads=1) == 0
    assert split_float32_linears(_tiny_llama(512), CPU, tensor_parallel=True, threads=2) == 0
    assert split_float32_linears(_tiny_llama(512).to(torch.bfloat16), CPU, tensor_parallel=False, threads=2) == 0
    model = _tiny_llama(512)
    monkeypatch.setattr(split_module, "split_is_exact", lambda layer, groups: layer.weight.shape != (64, 64))
    assert split_float32_linears(model, CPU, tensor_parallel=False, threads=2) == 2 * 5 + 1  # not q_proj, o_proj
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear


def test_the_start_up_check_fails_on_a_last_bit_difference(monkeypatch):
    linear = torch.nn.Linear(32, 64)
    assert split_is_exact(linear, 2)
    exact = split_module.split_linear
    monkeypatch.setattr(split_module, "split_linear", lambda *a: torch.nextafter(exact(*a), torch.tensor(1e9)))
    assert not split_is_exact(linear, 2)


def test_an_engine_on_two_threads_matches_transformers_on_two_threads(two_threads):
    """The worker's linears split (every row count up to SPLIT_MAX_ROWS, prefill of these prompts included), the
    reference on the same two threads; one prompt at a time, as transformers' generate runs them, then all at once."""
    model = ModelConfig.from_dir(MODEL_DIR)
    config = ShuttleConfig(model=model, ipc=IpcConfig.in_directory("/nonexistent"), cache=CacheConfig(16, 200),
                           scheduler=SchedulerConfig(max_num_batched_tokens=2048))
    runner = ModelRunner(config)
    assert runner.cpu_linears.split > 0
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
