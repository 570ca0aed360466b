"""LoRA adapters in the worker: many adapters and the base model in one forward.

Every target linear (common/lora.py TARGET_MODULES) is wrapped once at load by a LoRALinear that holds the adapters'
A and B of all --max-loras slots side by side, zero-padded to --max-lora-rank R:

    A_cat [in, L * R]: slot s's A^T in columns s*R .. s*R + r_s        (L = --max-loras)
    B_cat [L * R, out]: slot s's B^T in rows s*R .. s*R + r_s

A step whose rows use adapters gives each packed token its slot (L for the base model) and gathers a mask
[T, L * R] from a table of the slots' scales (each slot's R columns hold its scale, the base row is zeros). Then

    y = base(x) + ((x @ A_cat) * mask) @ B_cat

adds `scale_i * (x @ A_i^T) @ B_i^T` to the rows of adapter i and nothing to the base model's rows: two batched
matmuls per linear for every adapter at once (no loop over requests or adapters; the same tensor ops a CUDA graph
can record), costing 2 * T * L * R * (in + out) FLOPs. A step with no adapter row skips them.

Under tensor parallel (worker/parallel.py: transformers' plan splits q/k/v/gate/up by output columns, o/down by
input rows) each rank holds the slice of A and B that matches its shard of the base layer: B's rows of its output
columns for a column-parallel layer (A whole), A's columns of its input rows for a row-parallel one (B whole). A
row-parallel layer's delta is then a partial sum, all-reduced like the base layer's own output (transformers reduces
that inside the base layer's forward, so the delta gets its own all-reduce, on steps with adapter rows only: every
rank runs the same plans, so the collectives pair up).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shuttle.common.adapter_weights import check_adapter_weights
from shuttle.common.lora import TARGET_MODULES, AdapterSpec, adapter_layers, read_adapter
from shuttle.worker.model_loader import UnsupportedModelError

log = logging.getLogger("shuttle.worker")

ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # split by input rows in transformers' plans; the rest by columns


class LoRAStep:
    """The step's per-token adapter mask, shared by every LoRALinear of the model (None: no adapter row)."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [T, L * R] in the model's dtype


class LoRALinear(torch.nn.Module):
    """A target linear plus the adapters of every slot (module docstring).

    Args:
        base: the linear layer (nn.Linear or a quantized one with in_features / out_features).
        step: the shared LoRAStep.
        num_slots, max_rank: L and R.
    """

    def __init__(self, base: torch.nn.Module, step: LoRAStep, num_slots: int, max_rank: int,
                 shard: tuple[str, int, int] | None = None):
        super().__init__()
        self.base = base
        self.step = step
        in_features, out_features, dtype, device = _linear_shape(base)  # this rank's shard of the layer
        # (kind, rank, size) under tensor parallel: "col" (output columns split) or "row" (input rows split)
        self.shard = shard
        kind, _, size = shard or ("", 0, 1)
        self.global_shape = (out_features * (size if kind == "col" else 1),
                             in_features * (size if kind == "row" else 1))  # the adapter's B [out, r] A [r, in]
        self.max_rank = max_rank
        # plain attributes, not buffers: the slots are serving state, never part of a state dict
        self.a_cat = torch.zeros(in_features, num_slots * max_rank, dtype=dtype, device=device)  # [in, L * R]
        self.b_cat = torch.zeros(num_slots * max_rank, out_features, dtype=dtype, device=device)  # [L * R, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        mask = self.step.mask
        if mask is None:
            return y
        delta = ((x @ self.a_cat) * mask) @ self.b_cat
        if self.shard is not None and self.shard[0] == "row":
            dist.all_reduce(delta)  # the rank's partial product, summed as the base layer's output is
        return y + delta

    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put A [r, in] and B [out, r] into `slot` (None: the adapter leaves this layer alone: zeros)."""
        columns = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.a_cat[:, columns] = 0
        self.b_cat[columns] = 0
        if a is not None and b is not None and self.shard is not None:
            kind, index, _ = self.shard
            if kind == "col":
                rows = self.b_cat.shape[1]
                b = b[index * rows:(index + 1) * rows]
            else:
                width = self.a_cat.shape[0]
                a = a[:, index * width:(index + 1) * width]
        if a is not None and b is not None:
            rank = a.shape[0]
            self.a_cat[:, slot * self.max_rank:slot * self.max_rank + rank] = a.t().to(self.a_cat.dtype)
            self.b_cat[slot * self.max_rank:slot * self.max_rank + rank] = b.t().to(self.b_cat.dtype)


class LoRAAdapters:
    """Wraps a model's target linears and loads adapters into its slots.

    Args:
        model: the loaded model (wrapped in place).
        num_slots: --max-loras; max_rank: --max-lora-rank.
    Raises:
        UnsupportedModelError: the model has none of the target modules.
    """

    def __init__(self, model: torch.nn.Module, num_slots: int, max_rank: int, tp_rank: int = 0, tp_size: int = 1):
        self.step = LoRAStep()
        self.max_rank = max_rank
        self.layers: dict[str, LoRALinear] = {}
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                if child_name in TARGET_MODULES:
                    kind = "row" if child_name in ROW_PARALLEL else "col"
                    shard = (kind, tp_rank, tp_size) if tp_size > 1 else None
                    wrapped = LoRALinear(child, self.step, num_slots, max_rank, shard)
                    setattr(module, child_name, wrapped)
                    self.layers[f"{name}.{child_name}" if name else child_name] = wrapped
        if not self.layers:
            raise UnsupportedModelError(f"--enable-lora: the model has none of the linear layers LoRA adapters "
                                        f"target ({', '.join(sorted(TARGET_MODULES))})")
        self.base_modules = frozenset(name.rsplit(".", 1)[-1] for name in self.layers)
        weight = next(iter(self.layers.values())).a_cat
        self.scales = torch.zeros(num_slots + 1, num_slots * max_rank, dtype=weight.dtype, device=weight.device)
        self.broken: dict[int, str] = {}  # slot -> why its last load failed (a step using it fails)

    def load(self, slot: int, name: str, path: str) -> AdapterSpec:
        """Load the PEFT adapter at `path` into `slot`. A failed load leaves the slot empty and marked broken, so
        that a step using it fails instead of serving base-model text for an adapter's request.

        Raises:
            ModelDirError: its config cannot be served (common/lora.py read_adapter).
            ModelDirError: a weight names a layer the model lacks, or has the wrong shape (adapter_layers).
        """
        try:
            spec, pairs = self._read(path)
        except Exception as exc:  # files changed since start-up: no request may run on a half-loaded slot
            self._clear(slot)
            self.broken[slot] = f"LoRA adapter {name} could not be loaded: {exc}"
            raise
        for module, layer in self.layers.items():
            found = pairs.get(module, {})
            layer.set_slot(slot, found.get("A"), found.get("B"))
        columns = slice(slot * self.max_rank, (slot + 1) * self.max_rank)
        self.scales[slot] = 0
        self.scales[slot, columns] = spec.scale
        self.broken.pop(slot, None)
        if name:
            log.info("LoRA adapter %s (rank %d, scale %g, %d layers) in slot %d", name, spec.rank, spec.scale,
                     len(pairs), slot)
        return spec

    def _read(self, path: str) -> tuple[AdapterSpec, dict[str, dict[str, torch.Tensor]]]:
        """The adapter's checked config and its (A, B) per adapted layer, every shape checked before any slot is
        written (common/lora.py adapter_layers)."""
        spec = read_adapter(path, self.max_rank, self.base_modules)
        check_adapter_weights(path, spec.rank, spec.scale)  # whole and finite: no NaN reaches a shared step
        tensors = load_file(str(Path(path) / "adapter_model.safetensors"))
        shapes = {name: layer.global_shape for name, layer in self.layers.items()}
        layers = adapter_layers({k: tuple(t.shape) for k, t in tensors.items()}, spec, path, shapes)
        return spec, {layer: {"A": tensors[a], "B": tensors[b]} for layer, (a, b) in layers.items()}

    def _clear(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.set_slot(slot, None, None)
        self.scales[slot] = 0

    def check(self, paths: list[str]) -> None:
        """Read and check each adapter against the model's layers at start-up, so that an adapter this model cannot
        take (a target module it lacks, a weight of the wrong shape) is refused before serving, not when a request
        first needs it.

        Raises:
            ModelDirError, UnsupportedModelError: as load() does.
        """
        for path in paths:
            self._read(path)

    def begin_step(self, token_slots: torch.Tensor | None) -> None:
        """Set the step's mask from the packed tokens' slots (int64 [T], -1 for a base-model token: the scales'
        last row, zeros; None: no adapter row in the step).

        Raises:
            RuntimeError: a token's slot is broken (its adapter failed to load).
        """
        if token_slots is not None and self.broken:
            failed = set(token_slots.unique().tolist()) & set(self.broken)
            if failed:  # the step fails, and with it its requests: never base-model text for an adapter's request
                raise RuntimeError(self.broken[min(failed)])
        self.step.mask = None if token_slots is None else self.scales[token_slots.to(self.scales.device)]


def _linear_shape(base: torch.nn.Module) -> tuple[int, int, torch.dtype, torch.device]:
    """(in_features, out_features, dtype, device) of a linear layer: nn.Linear, a widening ColumnChunkedLinear
    (worker/output_projection.py) or an Int8Linear (worker/quantization.py, computed in float32 then)."""
    inner = getattr(base, "linear", base)
    weight = next(inner.parameters())
    weight = weight.to_local() if hasattr(weight, "to_local") else weight  # a DTensor shard under tensor parallel
    dtype = weight.dtype if weight.is_floating_point() else torch.float32
    # a weight OneDnnLinear reordered is a meta tensor of its shape (worker/onednn_linear.py): the layer is on the CPU
    device = torch.device("cpu") if weight.is_meta else weight.device
    if weight.dim() == 2 and weight.is_floating_point():  # [out, in]: the shard this rank holds
        return int(weight.shape[1]), int(weight.shape[0]), dtype, device
    features = cast(tuple[int, int], (inner.in_features, inner.out_features))  # an Int8Linear's q is padded
    return features[0], features[1], dtype, device
