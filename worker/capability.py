"""Start-up exactness check: the paged path must reproduce transformers' eager attention on this very model.

Two sequences run packed through the worker's real step path (plans, InputBatch, attention backend, a small
paged cache), with a chunked prefill, a chunk continuation and decodes, so cross-sequence isolation, positions,
chunk masks and cache reads are all exercised; their log-probabilities at every position are compared with
the model run one sequence at a time under transformers' own eager attention. An architecture whose layers do
something the paged path does not reproduce (recurrent state, ALiBi computed outside the attention function,
an attention class that ignores the interface, ...) is refused before the server reports ready.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from shuttle.common.messages import CachedRequestData, NewRequestData, StepPlan
from shuttle.common.sampling import SamplingParams
from shuttle.worker import attention
from shuttle.worker.input_batch import InputBatch
from shuttle.worker.kv_cache import KVCache
from shuttle.worker.model_loader import UnsupportedModelError, architecture, cache_kwargs

# Tolerated difference (nats) between the paths: in float32 the max |log-probability difference| over every position
# and vocabulary entry; in reduced precision (bfloat16, float16, int8 linears) the max over positions of the
# reference-probability-weighted mean |difference|, sum_v p(v) |log p'(v) - log p(v)|. Rounding moves the log-prob of
# tokens the model all but rules out the most (on stories260K in bfloat16 the plain max is 0.19-0.23 nats, the
# weighted one 0.05), while a structural mistake moves the likely ones: the same sequence compared one position off
# gives a weighted difference of up to 7.4 nats.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}


def log_prob_difference(paged: torch.Tensor, reference: torch.Tensor, tolerance: float) -> float:
    """The difference TOLERANCE bounds, between log-probabilities [positions, vocab] (float32) of two paths, as the
    `tolerance` (nats) it will be held to measures it: float32's (or tighter), the max absolute difference; a
    reduced-precision one, the max over positions of the reference-probability-weighted mean absolute difference."""
    difference = (paged.float() - reference.float()).abs()
    if tolerance <= TOLERANCE[torch.float32]:
        return float(difference.max())
    return float((reference.float().exp() * difference).sum(-1).max())


PROBE_FLOOR = 16  # tokens: the shortest probe sequence check_exactness runs where the model's context allows


def path_tolerance(runner) -> float:
    """The TOLERANCE (nats) two paths of `runner`'s model must agree within: its dtype's, the bfloat16 one where
    linears are int8 or the KV cache is rounded to another dtype (log_prob_difference measures by it)."""
    # int8 linears take bfloat16 activations (worker/quantization.py): a rounding step that amplifies the paths'
    # last-bit differences as bfloat16 weights do
    tolerance = TOLERANCE[torch.bfloat16] if getattr(runner, "quantized_linears", 0) else \
        TOLERANCE.get(runner.dtype, 0.25)
    kv_dtype = getattr(runner, "kv_dtype", runner.dtype)
    if kv_dtype != runner.dtype:  # a cache rounded to another dtype (--kv-cache-dtype): the looser tolerance
        tolerance = max(tolerance, TOLERANCE.get(kv_dtype, 0.25))
    return tolerance


@torch.inference_mode()
def check_exactness(runner, max_model_len: int) -> float:
    """Compare the paged path with eager attention; returns their difference as TOLERANCE measures it (nats).

    Args:
        runner: a ModelRunner (model, geometry, backend, block_size, dtype, device, forward()).
    Raises:
        UnsupportedModelError: the difference exceeds TOLERANCE for the model's dtype, or a path fails.
    """
    model, block_size = runner.model, runner.block_size
    vocab = model.get_output_embeddings().weight.shape[0]
    window = _smallest_window(model.config)
    # the probes stay within the served context, but are never shorter than a few blocks' worth the model can take
    # (a --max-model-len of 1 to 7 made them too short to split into a cached prefix and a decode)
    positions = getattr(model.config, "max_position_embeddings", None) or max_model_len
    bound = max(max_model_len, min(PROBE_FLOOR, positions))
    long_len = min(bound, max(2 * block_size + 3, (window or 0) + block_size + 3, 21))
    short_len = min(bound, max(block_size // 2 + 3, 7))
    generator = torch.Generator().manual_seed(0)
    sequences = {name: torch.randint(3, vocab, (length,), generator=generator).tolist()
                 for name, length in (("a", long_len), ("b", short_len))}
    try:
        paged = _paged_logprobs(runner, sequences)
    except Exception as exc:  # e.g. an attention class that does not pass shuttle's metadata keyword through
        raise UnsupportedModelError(f"{architecture(model)}: the model fails on shuttle's paged attention path "
                                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    try:
        reference, cached = _eager_logprobs(model, sequences, runner.device)
    except UnsupportedModelError:
        raise
    except Exception as exc:
        raise UnsupportedModelError(f"{architecture(model)}: transformers' eager attention fails on it, so the paged "
                                    f"path cannot be checked ({type(exc).__name__})") from None
    tolerance = path_tolerance(runner)
    prefix = len(sequences["a"]) // 2  # the cached decode covers positions prefix - 1 .. len - 2
    disagreement = log_prob_difference(cached, reference["a"][prefix - 1:-1], tolerance)
    if not disagreement <= tolerance:
        raise UnsupportedModelError(f"{architecture(model)}: transformers' own cached decoding and its full forward "
                                    f"disagree by {disagreement:.3g} nats on this model (e.g. a sliding-window cache "
                                    f"its attention does not apply), so there is no single output to reproduce")
    worst = 0.0
    for name in sequences:
        worst = max(worst, log_prob_difference(paged[name], reference[name], tolerance))
    if not worst <= tolerance:
        raise UnsupportedModelError(f"{architecture(model)}: the paged attention path differs from transformers' "
                                    f"eager attention by {worst:.3g} nats (tolerance {tolerance:g}); refusing to "
                                    f"serve output that would not match the model")
    return worst


def _smallest_window(config) -> int | None:
    config = getattr(config, "text_config", None) or config
    window = getattr(config, "sliding_window", None)
    return window if isinstance(window, int) and window > 0 else None


def _paged_logprobs(runner, sequences: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """Run the sequences packed in four steps (chunked prefill, continuation, decodes); log-softmax per position."""
    bs = runner.block_size
    needed = sum(-(-len(ids) // bs) for ids in sequences.values())
    cache = KVCache.allocate(runner.geometry, bs, getattr(runner, "kv_dtype", runner.dtype), runner.device, needed, 0)
    batch = InputBatch(bs, cache.null_block, max(-(-len(ids) // bs) for ids in sequences.values()))
    tables, next_block = {}, 0
    for name, ids in sequences.items():
        count = -(-len(ids) // bs)
        tables[name], next_block = list(range(next_block, next_block + count)), next_block + count
    a, b = sequences["a"], sequences["b"]
    cut = len(a) // 2 + 1
    steps = [  # per step: {name: (start, num_tokens)}
        {"a": (0, cut), "b": (0, len(b) - 2)},
        {"a": (cut, len(a) - 2 - cut), "b": (len(b) - 2, 1)},
        {"a": (len(a) - 2, 1), "b": (len(b) - 1, 1)},
        {"a": (len(a) - 1, 1)},
    ]
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in sequences}
    for step_id, step in enumerate(steps):
        plan = StepPlan(step_id=step_id, new_requests=[], cached_requests=[])
        for name, (start, count) in step.items():
            if step_id == 0:
                plan.new_requests.append(NewRequestData(request_id=name, token_ids=sequences[name],
                                                        sampling=SamplingParams(), block_ids=tables[name],
                                                        num_computed_tokens=start, num_scheduled_tokens=count))
            else:
                plan.cached_requests.append(CachedRequestData(request_id=name, new_block_ids=[],
                                                              num_computed_tokens=start, num_scheduled_tokens=count))
        scheduled = batch.apply(plan)
        inputs = batch.pack(scheduled)
        logits = runner.forward(inputs, cache.layers, torch.arange(inputs.input_ids.shape[0])).float()
        starts = inputs.attention.query_start_list
        for index, (state, _) in enumerate(_ordered(scheduled)):
            rows[state.request_id].append(logits[starts[index]:starts[index + 1]].log_softmax(-1))
    return {name: torch.cat(parts) for name, parts in rows.items()}


def _ordered(scheduled):
    """The row order InputBatch.pack uses: decodes first, then prefill chunks."""
    return [item for item in scheduled if item[1] == 1] + [item for item in scheduled if item[1] != 1]


def _eager_logprobs(model, sequences: dict[str, list[int]],
                    device: torch.device) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Eager attention, one sequence at a time: log-softmax at every position of each sequence (no cache), and,
    for sequence "a", its last positions decoded one token at a time through transformers' own cache."""
    try:
        model.set_attn_implementation("eager")
        if model.config._attn_implementation != "eager":
            raise UnsupportedModelError(f"{architecture(model)}: its attention implementation cannot be switched, "
                                        f"so shuttle cannot check its paged path")
        out = {}
        for name, ids in sequences.items():
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
            out[name] = logits.float().log_softmax(-1)
        ids = sequences["a"]
        prefix = len(ids) // 2
        cache = cache_kwargs(model, DynamicCache(config=model.config))
        step = model(input_ids=torch.tensor([ids[:prefix]], device=device), **cache, use_cache=True)
        cached = [step.logits[0, -1]]
        for token in ids[prefix:-1]:
            step = model(input_ids=torch.tensor([[token]], device=device), **cache, use_cache=True)
            cached.append(step.logits[0, -1])
        return out, torch.stack(cached).float().log_softmax(-1)
    finally:
        model.set_attn_implementation(attention.ATTENTION_NAME)
