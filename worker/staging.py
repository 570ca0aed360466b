"""One step's input tensors onto the worker's device: on CUDA one non-blocking copy from a pinned host buffer.

InputBatch (worker/input_batch.py) packs each step on the host. On the CPU those tensors are used as they are. On
CUDA, StepStaging copies them, all in one int64 buffer, into a pinned host buffer that lives as long as the worker,
issues one non-blocking host-to-device copy of it, and hands out device views (int32 fields cast back on the
device). The pinned buffer is reused step after step, so before refilling it the staging waits for the previous
step's copy alone (a CUDA event recorded after it), never for the previous step's forward.
"""

from __future__ import annotations

import dataclasses

import torch

from shuttle.worker.attention import AttentionMetadata
from shuttle.worker.input_batch import StepInputs


@dataclasses.dataclass
class DeviceStep:
    """A step's model inputs where the model runs.

    Attributes:
        input_ids, positions: int64 [T]; logits_rows: int64 [R], the rows whose logits are kept.
        attention: the step's AttentionMetadata with query_start_loc (int32 [B+1]), seq_lens (int32 [B]),
            block_table (int32 [B, W]) and slot_mapping (int64 [T]) on the device; its host lists unchanged.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_rows: torch.Tensor
    attention: AttentionMetadata


class StepStaging:
    """Moves each step's inputs to `device` (see the module docstring).

    Args:
        device: the worker's device.
        stage: copy through the staging buffer (default: on CUDA only; tests turn it on for the CPU, where the
            buffer is not pinned and the copy is an ordinary one, to check the packing round trip).
    """

    def __init__(self, device: torch.device, stage: bool | None = None):
        self.device = device
        self.stage = device.type == "cuda" if stage is None else stage
        self._pin = device.type == "cuda"
        self._host = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None

    def __call__(self, inputs: StepInputs, logits_rows: torch.Tensor) -> DeviceStep:
        """The step's inputs on the device (on the CPU without staging: the very same tensors)."""
        meta = inputs.attention
        if not self.stage:
            return DeviceStep(inputs.input_ids, inputs.positions, logits_rows, meta)
        parts = [inputs.input_ids, inputs.positions, logits_rows, meta.slot_mapping, meta.query_start_loc,
                 meta.seq_lens, meta.block_table]
        sizes = [p.numel() for p in parts]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy out of the buffer has finished
        if self._host.numel() < total:
            capacity = max(total, 2 * self._host.numel(), 1024)
            self._host = torch.empty(capacity, dtype=torch.int64, pin_memory=self._pin)
        offset = 0
        for part, size in zip(parts, sizes):
            self._host[offset:offset + size].copy_(part.reshape(-1))  # int32 fields widen to int64 here
            offset += size
        staged = self._host[:total] if self._pin else self._host[:total].clone()  # unpinned: never alias the buffer
        on_device = staged.to(self.device, non_blocking=self._pin)
        if self._pin:
            self._copied = torch.cuda.Event()
            self._copied.record()
        views = list(torch.split(on_device, sizes))
        input_ids, positions, rows, slots, query_start, seq_lens, table = views
        attention = dataclasses.replace(meta, slot_mapping=slots, query_start_loc=query_start.to(torch.int32),
                                        seq_lens=seq_lens.to(torch.int32),
                                        block_table=table.view(meta.block_table.shape).to(torch.int32))
        return DeviceStep(input_ids, positions, rows, attention)
