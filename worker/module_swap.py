"""Replacing one submodule of a loaded model by its dotted name, as the load-time rewrites of its linear layers
(quantization.py, output_projection.py, onednn_linear.py) do."""

from __future__ import annotations

import torch


def replace_module(model: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Put `module` where `model.get_submodule(name)` was (`name` dotted, as named_modules gives it).

    Raises:
        AttributeError: no submodule has `name`'s parent path.
    """
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, module)
