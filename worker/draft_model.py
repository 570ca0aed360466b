"""The draft model of --speculative-config's "draft_model" method: a smaller model with the target's vocabulary,
run by the same worker on the same device, proposing each speculating sequence's drafts at the start of the step
that verifies them.

Its paged KV cache has its own tensors but the target's block ids: a token's draft K/V sit at the same slot as its
target K/V, so the scheduler's block tables, slot mappings, prefix cache and preemption serve both models and the
draft needs no bookkeeping of its own. To keep that true, every step's rows (prefill chunks and decodes alike) go
through the draft model too, so the draft KV of every written block is written.

One step, for a sequence booked with d draft slots whose last known token t sits at position p (the scheduler
allocated slots for p .. p + d):
  - pass 0: the step's rows without drafts (t for that sequence) write the draft KV; the draft's argmax after t is
    draft 1;
  - pass j (1 .. d): draft j at position p + j writes its draft KV and, for j < d, its argmax is draft j + 1.
Pass d writes the KV of the last draft, which the next step needs when every draft is accepted. Drafts are the
draft model's argmax (one-hot proposals), so the verification of worker/speculation.py stays exact for any
sampling setting: what the draft model proposes changes the speed only, never the output distribution.
"""

from __future__ import annotations

import logging

import torch

from shuttle.common.devices import cpu_bf16_flags
from shuttle.worker.cpu_linears import prepare_cpu_linears
from shuttle.worker.input_batch import CachedRequestState, InputBatch, StepInputs
from shuttle.worker.kv_cache import KVCache
from shuttle.worker.model_loader import UnsupportedModelError, load_model, probe_geometry
from shuttle.worker.sampler import greedy_tokens

log = logging.getLogger("shuttle.worker")


class DraftModel:
    """The loaded draft model and its KV cache.

    Args:
        model_dir: the draft model's directory.
        dtype_name: the target's dtype (shuttle.worker.model_loader.DTYPES key); the draft runs in it too.
        device: the worker's device.
        vocab_size: the target's vocabulary size; the draft's must equal it.
        trust_remote_code: as for the target.
    Raises:
        UnsupportedModelError: the draft's vocabulary differs from the target's, or transformers cannot load it.
    """

    def __init__(self, model_dir: str, dtype_name: str, device: torch.device, vocab_size: int,
                 trust_remote_code: bool = False):
        self.model = load_model(model_dir, dtype_name, device, trust_remote_code=trust_remote_code)
        draft_vocab = self.model.get_output_embeddings().weight.shape[0]
        if draft_vocab != vocab_size:
            raise UnsupportedModelError(f"the draft model's vocabulary has {draft_vocab} tokens, the target's "
                                        f"{vocab_size}: a draft model must share the target's tokenizer")
        # the same CPU linears as the target's (the draft runs unsharded beside it)
        self.cpu_linears = prepare_cpu_linears(self.model, device, False, bool(cpu_bf16_flags()),
                                               torch.get_num_threads())
        self.geometry = probe_geometry(self.model)
        self.kv_cache: KVCache | None = None  # allocated once the target's cache is sized (same block ids)
        log.info("draft model %s: %d layers, %.1f M parameters", model_dir, len(self.geometry),
                 sum(p.numel() for p in self.model.parameters()) / 1e6)

    def bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Draft K + V bytes one token takes across the draft's layers."""
        return KVCache.bytes_per_token_of(self.geometry, kv_dtype)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the draft's weights, reordered copies of a tied head included."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) + self.cpu_linears.copied_bytes

    def allocate(self, num_blocks: int, block_size: int, kv_dtype: torch.dtype, device: torch.device) -> None:
        """Allocate the draft KV cache with the target's `num_blocks` blocks (and its null block)."""
        self.kv_cache = KVCache.allocate(self.geometry, block_size, kv_dtype, device, num_blocks, 0)

    @torch.inference_mode()
    def propose(self, forward, batch: InputBatch, scheduled: list[tuple[CachedRequestState, int]]
                ) -> StepInputs | None:
        """Run the step's draft passes (module docstring) and fill each speculating state's `draft_token_ids` (it
        arrives holding the scheduler's DRAFT_SLOT placeholders, one per draft).

        Returns:
            pass 0's packed inputs when no state drafts (they are then the target's inputs too, not packed
            twice), else None.

        Args:
            forward: the worker's forward (ModelRunner.forward's signature, with a `model` keyword).
            batch: the worker's InputBatch (its block table has the step's blocks already).
            scheduled: the step's (state, num_scheduled_tokens), as InputBatch.apply returned them.
        """
        assert self.kv_cache is not None
        layers = self.kv_cache.layers
        num_drafts = {state: len(state.draft_token_ids) for state, _ in scheduled}  # states hash by identity
        drafting = [state for state, _ in scheduled if num_drafts[state]]
        for state in drafting:
            state.draft_token_ids = []
        # pass 0: the step's rows as the target will run them, but the speculating sequences' last token alone
        first = [(state, 1 if num_drafts[state] else num_new) for state, num_new in scheduled]
        prompt_marks = [(state, state.next_prompt_logprob) for state, _ in first]
        inputs = batch.pack(first)
        if drafting:  # packing moved the prompt-logprob cursor; the target's own packing follows and owns it
            for state, mark in prompt_marks:
                state.next_prompt_logprob = mark
        drafting_rows = [i for i, state in enumerate(inputs.sampled_requests) if num_drafts[state]]
        rows = inputs.sample_rows[drafting_rows]
        tokens = greedy_tokens(forward(inputs, layers, rows, model=self.model)).tolist()  # runs even with no drafts
        proposed = {inputs.sampled_requests[i]: [t] for i, t in zip(drafting_rows, tokens)}
        # passes 1 .. d: one row per sequence with at least j drafts
        for j in range(1, max(num_drafts.values(), default=0) + 1):
            states = [state for state in drafting if num_drafts[state] >= j]
            positions = [len(state.token_ids) - 1 + j for state in states]
            step = batch.pack_decode_rows(states, [proposed[state][j - 1] for state in states], positions)
            wanted = [i for i, state in enumerate(states) if num_drafts[state] > j]
            logits = forward(step, layers, step.sample_rows[wanted], model=self.model)
            for i, token in zip(wanted, greedy_tokens(logits).tolist()):
                proposed[states[i]].append(token)
        for state in drafting:
            state.draft_token_ids = proposed[state]
        return None if drafting else inputs
