"""LoRA adapters in the PEFT format: `--lora-modules` parsed, and an adapter's adapter_config.json read and checked
against the served model (what the launcher refuses before anything starts, and the worker again when it loads one).

An adapter directory holds adapter_config.json and adapter_model.safetensors. Each target linear W [out, in] of the
base model gains `scale * B @ A`, A [r, in] and B [out, r], with scale = lora_alpha / r (lora_alpha / sqrt(r) under
use_rslora: Kalajdzievski 2023, rsLoRA), as PEFT's LoraLayer computes it (Hu et al. 2021, LoRA).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import msgspec

from shuttle.common.adapter_weights import check_adapter_weights
from shuttle.common.arg_types import option, positive
from shuttle.common.errors import ModelDirError
from shuttle.common.model_dir import safetensors_header

# The linear layers shuttle adapts, by the names transformers' decoder layers give them (Llama, Qwen, Mistral,
# Gemma, Phi-3's fused ones excepted: an adapter naming another module is refused)
ALL_LINEAR = "all-linear"  # PEFT's target_modules for every linear layer but the output projection
TARGET_MODULES = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
# adapter_config.json keys that change what the adapter computes, and the values shuttle serves exactly
_MUST_BE = {"use_dora": (False, None), "bias": ("none", None), "fan_in_fan_out": (False, None),
            "modules_to_save": (None, []), "layers_to_transform": (None, []), "layers_pattern": (None, []),
            "rank_pattern": ({}, None), "alpha_pattern": ({}, None), "lora_bias": (False, None),
            "megatron_config": (None,), "layer_replication": (None, [])}


class LoRAModule(msgspec.Struct, frozen=True, kw_only=True):
    """One --lora-modules entry: the name requests give as their `model`, the adapter's directory (absolute once
    the launcher has checked it), and the model /v1/models names as its parent ("" = the served model). `load_id`
    tells one runtime load from another of the same name and directory (whose files may have changed between
    them): the scheduler's slots and prefix cache name an adapter's weights by all three ("" for --lora-modules)."""

    name: str
    path: str
    base_model_name: str = ""
    load_id: str = ""


class AdapterSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What a checked adapter computes: its rank, scale and target modules."""

    rank: int
    scale: float
    target_modules: tuple[str, ...]


MAX_ADAPTER_NAME_CHARS = 256


def adapter_name_error(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None: it is a model name in every answer and a label value in /metrics
    (whose running_lora_adapters joins names with commas)."""
    if len(name) > MAX_ADAPTER_NAME_CHARS or not name.isprintable() or "," in name:
        return f"an adapter name must be at most {MAX_ADAPTER_NAME_CHARS} printable characters without a comma"
    if name != name.strip():  # " " or "sql " would be told from "sql" by whitespace no one sees in a log line
        return "an adapter name must not start or end with whitespace"
    return None


def parse_lora_module(value: str) -> LoRAModule:  # defined before LoRAConfig, whose declaration names it
    """One --lora-modules value: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}.

    Raises:
        argparse.ArgumentTypeError: neither form, an empty name or path, or an unknown JSON key.
    """
    if value.lstrip().startswith("{"):
        try:
            raw = json.loads(value)
        except json.JSONDecodeError:
            raise argparse.ArgumentTypeError(f"not JSON: {value!r}") from None
        unknown = sorted(set(raw) - {"name", "path", "base_model_name"})
        if unknown:
            raise argparse.ArgumentTypeError(f"key {unknown[0]!r} is not implemented (name, path, base_model_name)")
        try:
            module = msgspec.convert({"base_model_name": "", **raw}, LoRAModule)
        except msgspec.ValidationError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    else:
        name, sep, path = value.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=PATH or a JSON object, got {value!r}")
        module = LoRAModule(name=name.strip(), path=path.strip())
    if not module.name or not module.path:
        raise argparse.ArgumentTypeError(f"an adapter needs a name and a path, got {value!r}")
    why = adapter_name_error(module.name)
    if why is not None:
        raise argparse.ArgumentTypeError(f"{why}, got {module.name[:100]!r}")
    return module


def read_adapter(path: str | Path, max_lora_rank: int, base_modules: frozenset[str] | None = None) -> AdapterSpec:
    """Read and check `path`'s adapter_config.json.

    Args:
        max_lora_rank: --max-lora-rank; a larger rank is refused.
        base_modules: the linear-layer names the served model has (None: not checked here).
    Raises:
        ModelDirError: one line naming the adapter and what shuttle cannot serve exactly.
    """
    directory = Path(path)
    config_path = directory / "adapter_config.json"
    if not config_path.is_file():
        raise ModelDirError(f"LoRA adapter {directory}: no adapter_config.json")
    if not (directory / "adapter_model.safetensors").is_file():
        raise ModelDirError(f"LoRA adapter {directory}: no adapter_model.safetensors (the PEFT format's weights)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelDirError(f"LoRA adapter {directory}: adapter_config.json unreadable: {e}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"LoRA adapter {directory}: adapter_config.json is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelDirError(f"LoRA adapter {directory}: peft_type {config.get('peft_type')!r} is not LORA")
    for key, allowed in _MUST_BE.items():
        if key in config and config[key] not in allowed:
            raise ModelDirError(f"LoRA adapter {directory}: {key} = {json.dumps(config[key])} is not implemented")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ModelDirError(f"LoRA adapter {directory}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ModelDirError(f"LoRA adapter {directory}: rank {rank} exceeds --max-lora-rank {max_lora_rank}")
    targets = config.get("target_modules")
    if targets == ALL_LINEAR:
        targets = _adapted_modules(directory)
    elif isinstance(targets, str):
        raise ModelDirError(f"LoRA adapter {directory}: target_modules as a regular expression is not implemented")
    if not isinstance(targets, list) or not targets:
        raise ModelDirError(f"LoRA adapter {directory}: target_modules must list module names")
    unknown = sorted(set(targets) - TARGET_MODULES)
    if unknown:
        raise ModelDirError(f"LoRA adapter {directory}: target module {unknown[0]!r} is not one shuttle adapts "
                            f"({', '.join(sorted(TARGET_MODULES))})")
    if base_modules is not None:
        missing = sorted(set(targets) - base_modules)
        if missing:
            raise ModelDirError(f"LoRA adapter {directory}: target module {missing[0]!r} is not in the served model")
    alpha = config.get("lora_alpha", rank)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise ModelDirError(f"LoRA adapter {directory}: lora_alpha must be a finite number, got {alpha!r}")
    if not isinstance(config.get("use_rslora", False), bool):
        raise ModelDirError(f"LoRA adapter {directory}: use_rslora must be true or false, got "
                            f"{config['use_rslora']!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterSpec(rank=rank, scale=float(scale), target_modules=tuple(sorted(targets)))


def _adapted_modules(directory: Path) -> list[str]:
    """The module names (q_proj, ...) whose lora_A weights `directory`'s adapter_model.safetensors holds: what PEFT's
    target_modules "all-linear" expanded to when it trained and saved the adapter (every linear layer but the
    output projection), read from the file's header alone.

    Raises:
        ModelDirError: the header is unreadable, or names no lora_A weight.
    """
    path = directory / "adapter_model.safetensors"
    header, _, _ = safetensors_header(path, lambda why: ModelDirError(f"LoRA adapter {directory}: {path.name}: {why}"))
    modules = sorted({name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name in header if ".lora_A." in name})
    if not modules:
        raise ModelDirError(f"LoRA adapter {directory}: target_modules is \"{ALL_LINEAR}\" but its weights adapt no "
                            "module")
    return modules


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters, under vLLM's flag names (docs/lora.md). Each field's help says what it means."""

    enable_lora: bool = option(False, "serve LoRA adapters: requests name one as their model (--lora-modules)")
    lora_modules: tuple[LoRAModule, ...] = option(
        (), "adapters served, each NAME=PATH or vLLM's JSON {\"name\": ..., \"path\": ..., \"base_model_name\": "
            "...}; a PEFT directory (adapter_config.json, adapter_model.safetensors)", type=parse_lora_module,
        nargs="+", action="extend", metavar="NAME=PATH")
    max_loras: int = option(1, "adapters in one step (one slot each): a request for another adapter waits until a "
                               "slot is free", type=positive)
    max_lora_rank: int = option(16, "largest adapter rank served (the slots' width)", type=positive)
    max_cpu_loras: int | None = option(None, "adapters kept loaded in host memory (vLLM's name; shuttle keeps every "
                                             "--lora-modules adapter: at least --max-loras)", type=positive)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lora_modules", tuple(self.lora_modules or ()))  # from argparse: a list or None


def lora_config_error(config: LoRAConfig, tensor_parallel_size: int) -> str | None:
    """Why the LoRA flags cannot be served (None when they can)."""
    if config.lora_modules and not config.enable_lora:
        return "--lora-modules needs --enable-lora"
    if not config.enable_lora:
        return None
    names = [m.name for m in config.lora_modules]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        return f"--lora-modules names adapter {repeated[0]!r} twice"
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        return f"--max-cpu-loras {config.max_cpu_loras} is below --max-loras {config.max_loras}"
    return None


def checked_lora_config(config: LoRAConfig, served_names: tuple[str, ...]) -> LoRAConfig:
    """The config with every adapter's directory checked (read_adapter) and made absolute.

    Raises:
        ModelDirError: one line naming the adapter and what is wrong with it.
    """
    modules = []
    for module in config.lora_modules:
        if module.name in served_names:
            raise ModelDirError(f"--lora-modules: adapter name {module.name!r} is the served model's name")
        spec = read_adapter(module.path, config.max_lora_rank)
        check_adapter_weights(module.path, spec.rank, spec.scale)
        modules.append(msgspec.structs.replace(module, path=str(Path(module.path).absolute())))
    return dataclasses.replace(config, lora_modules=tuple(modules))


def adapter_layers(weight_shapes: dict[str, tuple[int, ...]], spec: AdapterSpec, path: str | Path,
                   layer_shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[str, str]]:
    """Match an adapter's weights to the model's layers, checking every shape.

    Args:
        weight_shapes: the adapter file's tensor names (PEFT's `base_model.model.<layer>.lora_A.weight`) and shapes.
        layer_shapes: the model's adaptable layers, full name -> (out_features, in_features).
    Returns:
        adapted layer name -> (its lora_A tensor name, its lora_B tensor name).
    Raises:
        ModelDirError: a weight names no adaptable layer or a module target_modules does not list, one of A and B
            is missing, or a shape is not A [r, in] and B [out, r].
    """
    parts: dict[str, dict[str, str]] = {}
    for key in weight_shapes:
        layer, part = _split_key(key)
        if layer not in layer_shapes or part == "?":
            raise ModelDirError(f"LoRA adapter {path}: weight {key!r} names no adaptable layer of the served model")
        module = layer.rsplit(".", 1)[-1]
        if module not in spec.target_modules:  # PEFT would leave it out: served, it would change the output
            raise ModelDirError(f"LoRA adapter {path}: weight {key!r} adapts {module}, which its target_modules "
                                f"({', '.join(spec.target_modules)}) does not list")
        parts.setdefault(layer, {})[part] = key
    layers = {}
    for layer, found in parts.items():
        if set(found) != {"A", "B"}:
            raise ModelDirError(f"LoRA adapter {path}: {layer} has lora_A or lora_B without the other")
        a, b = weight_shapes[found["A"]], weight_shapes[found["B"]]
        out_features, in_features = layer_shapes[layer]
        if tuple(a) != (spec.rank, in_features) or tuple(b) != (out_features, spec.rank):
            raise ModelDirError(f"LoRA adapter {path}: {layer} has A {tuple(a)} and B {tuple(b)}, the layer needs "
                                f"A [{spec.rank}, {in_features}] and B [{out_features}, {spec.rank}]")
        layers[layer] = (found["A"], found["B"])
    return layers


def _split_key(key: str) -> tuple[str, str]:
    """('model.layers.0.self_attn.q_proj', 'A') from PEFT's 'base_model.model.model.layers.0.self_attn.q_proj.
    lora_A.weight' (also with the adapter's name, '.lora_A.default.weight', as PEFT keeps it in memory); part "?"
    for a tensor that is neither A nor B."""
    name = key.removeprefix("base_model.model.")
    for part in ("A", "B"):
        marker = f".lora_{part}."
        if marker in name:
            return name.split(marker)[0], part
    return name, "?"


def checkpoint_layer_shapes(weight_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, int]]:
    """The adaptable layers named by a checkpoint's tensors (`<layer>.weight`, 2-D, its last name in
    TARGET_MODULES), full name -> (out, in) features: what a PEFT adapter's keys name, read without the model."""
    shapes = {}
    for name, shape in weight_shapes.items():
        layer, _, kind = name.rpartition(".")
        if kind == "weight" and layer.rsplit(".", 1)[-1] in TARGET_MODULES and len(shape) == 2:
            shapes[layer] = (int(shape[0]), int(shape[1]))
    return shapes


def check_adapter_for(model_dir: str, path: str, max_lora_rank: int) -> AdapterSpec:
    """An adapter loaded at run time, checked as a launch checks --lora-modules: its config, its weights whole and
    finite (common/adapter_weights.py), and every weight's shape against the served model's layers read from the
    safetensors headers (no torch); a model stored another way is checked by the worker when it loads the adapter.

    Raises:
        ModelDirError: one line naming the adapter and what is wrong with it.
    """
    from shuttle.common.model_dir import safetensors_shapes

    model_shapes = safetensors_shapes(model_dir)
    shapes = None if model_shapes is None else checkpoint_layer_shapes(model_shapes)
    modules = None if shapes is None else frozenset(name.rsplit(".", 1)[-1] for name in shapes)
    spec = read_adapter(path, max_lora_rank, modules)
    check_adapter_weights(path, spec.rank, spec.scale)
    weights = safetensors_shapes(Path(path) / "adapter_model.safetensors")
    if shapes is not None and weights is not None:
        adapter_layers(weights, spec, path, shapes)
    return spec
