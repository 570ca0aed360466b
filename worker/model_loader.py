"""Loads a Hugging Face decoder-only model with shuttle's paged attention backend."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from worker import attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_dir: str, dtype: str, device: torch.device) -> torch.nn.Module:
    """Load weights from `model_dir` (config.json + safetensors) in eval mode on `device`.

    Raises:
        ValueError: unknown dtype. Errors of transformers propagate (unsupported architecture, bad files).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=DTYPES[dtype], attn_implementation=attention.register())
    return model.to(device).eval()


def kv_geometry(model_dir: str) -> tuple[int, int, int]:
    """(num_layers, num_kv_heads, head_dim) from the model's config."""
    config = AutoConfig.from_pretrained(model_dir)
    config = getattr(config, "text_config", config)
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    return config.num_hidden_layers, num_kv_heads, head_dim
