"""Loads a Hugging Face decoder-only model with shuttle's paged attention, and learns its KV geometry by probing.

The geometry (which layers attend, with how many KV heads of which key and value widths) is read off one tiny
forward pass rather than from config field names, which differ between architectures (Falcon's `num_kv_heads`,
MLA's separate key and value head dims, ...): whatever the model hands its attention function is what the cache
must hold.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from shuttle.common.errors import ModelDirError
from shuttle.worker import attention

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(Exception):
    """The model cannot be served exactly by shuttle; the message names the architecture and the reason."""


@dataclass(frozen=True)
class LayerGeometry:
    """The K/V shape one attention layer caches per token."""

    num_kv_heads: int
    head_dim: int
    v_head_dim: int


def load_model(model_dir: str, dtype: str, device: torch.device, hf_overrides: dict | None = None,
               **load_kwargs) -> PreTrainedModel:
    """Load weights from `model_dir` (config.json + safetensors) in eval mode on `device`.

    `hf_overrides`: --hf-overrides, set on the model's configuration before it is built (overridden_config).
    `load_kwargs` go to `from_pretrained` (worker/parallel.py's tensor-parallel plan, trust_remote_code).

    Raises:
        ValueError: unknown dtype.
        UnsupportedModelError: transformers cannot load it as a causal LM with a pluggable attention function.
        ModelDirError: a weight file is missing, unreadable or corrupt (the launcher's check, common/model_dir.py,
            finds these before any process starts; this is for files changed since).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if hf_overrides:
        load_kwargs["config"] = overridden_config(model_dir, hf_overrides, load_kwargs.get("trust_remote_code", False))
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype],
                                                     attn_implementation=attention.register(), **load_kwargs)
    except (OSError, SafetensorError) as exc:
        raise ModelDirError(f"cannot load the weights in {model_dir}: {_first_line(exc)}") from None
    except (ValueError, KeyError, NotImplementedError, TypeError) as exc:  # unknown type, no attention interface
        name = _declared_architecture(model_dir)
        if isinstance(exc, KeyError) and attention.ATTENTION_NAME in str(exc):
            raise UnsupportedModelError(f"{name}: its transformers implementation does not support pluggable "
                                        f"attention functions (transformers' attention interface)") from None
        raise UnsupportedModelError(f"{name}: transformers cannot load it as a causal LM with pluggable attention "
                                    f"({type(exc).__name__}: {_first_line(exc)})") from None
    # transformers decorates PreTrainedModel.to with functools.wraps, which typeshed types as no method (self unbound)
    return model.to(device).eval()  # type: ignore[arg-type]


def overridden_config(model_dir: str, overrides: dict, trust_remote_code: bool = False) -> PretrainedConfig:
    """`model_dir`'s configuration with --hf-overrides set on it as vLLM sets them: a key naming a nested
    configuration (text_config) takes the override's keys into it, recursively; any other key is set to the
    override's value whole (common/model_config.py apply_hf_overrides does the same to config.json's dict, for the
    processes that read no PretrainedConfig)."""
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    for key, value in overrides.items():
        current = getattr(config, key, None)
        if isinstance(current, PretrainedConfig) and isinstance(value, dict):
            _update_nested(current, value)
        else:
            setattr(config, key, value)
    return config


def _update_nested(target: PretrainedConfig | dict, values: dict) -> None:
    for key, value in values.items():
        current = target.get(key) if isinstance(target, dict) else getattr(target, key, None)
        if isinstance(value, dict) and isinstance(current, (dict, PretrainedConfig)):
            _update_nested(current, value)
        elif isinstance(target, dict):
            target[key] = value
        else:
            setattr(target, key, value)


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else ""


def _declared_architecture(model_dir: str) -> str:
    try:
        return AutoConfig.from_pretrained(model_dir).architectures[0]
    except Exception:
        return str(model_dir)


def architecture(model: torch.nn.Module) -> str:
    names = getattr(model.config, "architectures", None)
    return names[0] if names else type(model).__name__


@torch.inference_mode()
def cache_kwargs(model: torch.nn.Module, cache) -> dict:
    """The keyword argument that hands transformers' own KV cache (a DynamicCache) to `model`'s forward:
    `{"cache": cache}` on transformers releases whose forward takes `cache` (renamed by 5.25), else
    `{"past_key_values": cache}` (5.17, the GPU machine's release). An unknown keyword would be swallowed by the
    forward's **kwargs, and every step would then run without the cache."""
    parameters = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in parameters else {"past_key_values": cache}


def probe_geometry(model: torch.nn.Module) -> list[LayerGeometry]:
    """Run a 3-token forward with a recording attention function; returns one LayerGeometry per layer index.

    Raises:
        UnsupportedModelError: no layer called the attention interface, a layer has no `layer_idx`, or layer
            indices are not 0..N-1.
    """
    seen: dict[int, LayerGeometry] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise UnsupportedModelError(f"{architecture(model)}: an attention layer has no layer_idx")
        seen[layer] = LayerGeometry(key.shape[1], key.shape[-1], value.shape[-1])
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None

    AttentionInterface.register(attention.ATTENTION_NAME, record)
    try:
        device = next(model.parameters()).device
        model(input_ids=torch.tensor([[1, 2, 3]], device=device), position_ids=torch.arange(3, device=device)[None],
              use_cache=False, logits_to_keep=1)
    except UnsupportedModelError:
        raise
    except Exception as exc:
        raise UnsupportedModelError(f"{architecture(model)}: the model fails with shuttle's attention interface "
                                    f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    finally:
        attention.register()
    if not seen:
        raise UnsupportedModelError(f"{architecture(model)}: its attention does not route through transformers' "
                                    f"attention interface, so it cannot use the paged KV cache")
    if sorted(seen) != list(range(len(seen))):
        config = getattr(model.config, "text_config", None) or model.config
        total = getattr(config, "num_hidden_layers", "?")
        raise UnsupportedModelError(f"{architecture(model)}: only layers {sorted(seen)} of {total} use attention; the "
                                    f"others (recurrent, linear attention or convolution) keep per-sequence state "
                                    f"that shuttle's paged KV cache does not hold")
    return [seen[i] for i in range(len(seen))]
