"""Sibling projections of one input computed as one oneDNN matmul on the CPU: a decoder layer's q/k/v projections
and its MLP's gate/up projections each read the same hidden states, so their reordered weights are concatenated and
one call computes all of them, as vLLM's fused QKVParallelLinear and MergedColumnParallelLinear do.

Why. At a decode step's few rows a linear layer is bound by its weights' bytes and by oneDNN's cost per call; one
call over the concatenated weight saves the calls' fixed cost. Measured on a 2-core Zen 5 with reordered weights
(2 threads, one row): q/k/v of 768 x 768 took 63 us as three calls and 39 us as one in bfloat16 (84 and 57 us in
float32), gate/up of 2048 x 768 70 and 57 us (100 and 83 us); at 16 rows 111 against 82 and 142 against 127 us.

How. The model's code stays transformers': each member keeps its place and name (`q_proj`, ...) as a
`SharedInputLinear`, and the first member called with a hidden-states tensor computes the whole group's product and
keeps it; the others, called with that same tensor object, take their columns from it. A member called with any
other tensor computes the group's product for that tensor (never a stale one: the kept input is referenced, so its
identity cannot be reused), so a model that feeds the siblings different inputs (cross-attention) still gets each
product right, only without the saving. The product is dropped once every member has taken its columns. What the
identity cannot see is a tensor changed in place between two members' calls (inference tensors keep no version
counter to compare); no transformers decoder does that to the hidden states its projections read.

Exactness. The fused product of each output column is the same dot product as the member's own, summed in
oneDNN's order: within the rounding bound onednn_linear.py checks at start-up, which the fused weight passes too.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import cast

import torch

from shuttle.worker import onednn_linear as onednn  # as a module: its rule (packs_weights, sizes) read at call time
from shuttle.worker.module_swap import replace_module
from shuttle.worker.output_projection import LinearWrapper

log = logging.getLogger(__name__)

# Sibling projections that read the same hidden states, by their names under one parent module (Llama, Mistral,
# Qwen2/3, Gemma and the other transformers decoders that name them so).
SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(eq=False)
class FusedProjection:
    """The reordered concatenation of a group's weights and the product last computed from it.

    Attributes:
        weight: opaque oneDNN tensor, the members' [N_i, K] weights stacked along N and reordered.
        bias: [sum N_i] of the weights' dtype, or None (all members alike).
        widths: each member's N_i, in member order.
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    widths: tuple[int, ...]
    _input: torch.Tensor | None = field(default=None, repr=False)
    _parts: tuple[torch.Tensor, ...] = field(default=(), repr=False)
    _taken: int = field(default=0, repr=False)  # bit i: member i has its columns

    def member_output(self, index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Member `index`'s product for `hidden` ([..., K]): [..., N_index], a column slice of the group's product."""
        bit = 1 << index
        if hidden is not self._input or self._taken & bit:
            self._parts = tuple(onednn.onednn_linear(hidden, self.weight, self.bias).split(self.widths, dim=-1))
            self._input, self._taken = hidden, 0
        self._taken |= bit
        part = self._parts[index]
        if self._taken == (1 << len(self.widths)) - 1:  # every member has its columns: let the product go
            self._input, self._parts, self._taken = None, (), 0
        return part


class SharedInputLinear(LinearWrapper):
    """Member `index` of a FusedProjection, in the place of the nn.Linear it wraps (whose weight was released: a
    meta tensor of its shape and dtype). Input [..., K], output [..., N_index], in the weights' dtype."""

    def __init__(self, linear: torch.nn.Module, fused: FusedProjection, index: int):
        super().__init__(linear)
        self.fused = fused
        self.index = index

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fused.member_output(self.index, hidden)


def sibling_groups(model: torch.nn.Module, eligible: dict[str, torch.nn.Linear]
                   ) -> list[list[tuple[str, torch.nn.Linear]]]:
    """The groups of `eligible` layers (name -> nn.Linear) that SIBLING_GROUPS names under one parent, each complete,
    of one dtype and one input width, with a bias in all or none; members by name, in SIBLING_GROUPS' order."""
    groups = []
    for parent_name, _ in model.named_modules():
        prefix = f"{parent_name}." if parent_name else ""
        for names in SIBLING_GROUPS:
            members = [(prefix + name, eligible[prefix + name]) for name in names if prefix + name in eligible]
            if len(members) == len(names) and \
                    len({(layer.weight.dtype, layer.in_features, layer.bias is None) for _, layer in members}) == 1:
                groups.append(members)
    return groups


def fuse_sibling_projections(model: torch.nn.Module, device: torch.device, tensor_parallel: bool,
                             has_bf16_units: bool, min_weight_bytes: int | None = None) -> int:
    """Where oneDNN computes `model`'s linears from reordered weights (onednn_linear.onednn_targets with
    packs_weights()), put each complete group of SIBLING_GROUPS whose weights no other module shares behind one
    FusedProjection: the members become SharedInputLinear and release their weights. A group whose fused product
    fails onednn_is_close is left to route_linears_to_onednn, as are all layers elsewhere. Returns the number of
    layers fused.
    """
    if not onednn.packs_weights():
        return 0
    eligible = dict(onednn.onednn_targets(model, device, tensor_parallel, has_bf16_units, True, min_weight_bytes))
    uses = onednn.parameter_uses(model)
    fused = 0
    for members in sibling_groups(model, eligible):
        layers = [layer for _, layer in members]
        if any(uses[id(layer.weight)] > 1 for layer in layers):
            continue
        weight = torch.cat([layer.weight.detach() for layer in layers])
        bias = None if layers[0].bias is None else torch.cat([cast(torch.Tensor, layer.bias).detach()
                                                              for layer in layers])
        if not onednn.onednn_is_close(weight, bias, packed=True):
            log.info("%s: the fused product was outside rounding of torch's; its layers stay apart", members[0][0])
            continue
        group = FusedProjection(onednn.reordered_weight(weight), bias, tuple(layer.out_features for layer in layers))
        for index, (name, layer) in enumerate(members):
            onednn.release_weight(layer)
            replace_module(model, name, SharedInputLinear(layer, group, index))
        fused += len(members)
    if fused:
        log.info("%d linear layers computed in groups of siblings that read the same input (q/k/v, gate/up)", fused)
    return fused
