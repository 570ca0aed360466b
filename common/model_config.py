"""What shuttle serves, read once from the model's directory by the launcher: `ModelConfig`, whose fields every
process gets in the ShuttleConfig JSON (common/config.py), and the model's context limit from its config.json."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shuttle.common.errors import ModelDirError
from shuttle.common.generation_config import AUTO, SamplingDefaults, generation_config_path, read_sampling_defaults
from shuttle.common.model_dir import read_json_object


@dataclass(frozen=True)
class ModelConfig:
    """What the frontend, scheduler and worker need to know about the served model.

    Attributes:
        model_dir: Hugging Face model directory (config.json, weights, tokenizer files).
        served_model_name: the name clients give in the ``model`` field.
        max_model_len: longest context in tokens (prompt + output).
        eos_token_ids: ids that end a sequence, from generation_config.json (else config.json).
        dtype: torch dtype name of weights and KV cache ("float32", "bfloat16", "float16"; "auto" until the
            launcher resolves it for the device, common/devices.py).
        tokenizer_dir: the tokenizer's directory ("": model_dir).
        served_model_aliases: further names clients may give (--served-model-name's second and later).
        seed: seeds the worker's generator, which samples the requests that set no seed.
        max_logprobs: most logprobs alternatives a request may ask for per token.
        trust_remote_code: let transformers run the model's own Python code (config.json auto_map).
        sampling_defaults: request fields' defaults from generation_config.json (--generation-config;
            common/generation_config.py).
        model_as_given: MODEL as the command line gave it (a hub id or a path; "": model_dir), what /v1/models
            reports as `root`, as vLLM does.
        hf_overrides: --hf-overrides, merged into config.json wherever a process reads it (apply_hf_overrides).
    """

    model_dir: str
    served_model_name: str
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: str = "float32"
    tokenizer_dir: str = ""
    served_model_aliases: tuple[str, ...] = ()
    seed: int = 0
    max_logprobs: int = 20
    trust_remote_code: bool = False
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    model_as_given: str = ""
    hf_overrides: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.served_model_name, *self.served_model_aliases)

    def hf_config(self) -> dict:
        """The model's config.json with --hf-overrides merged in. Raises ModelDirError when it is missing, unreadable
        or not an object."""
        return apply_hf_overrides(_read_json(Path(self.model_dir) / "config.json"), self.hf_overrides)

    @staticmethod
    def from_dir(model_dir: str | os.PathLike, max_model_len: int | None = None,
                 served_model_name: str | None = None, dtype: str = "float32", generation_config: str = AUTO,
                 hf_overrides: dict[str, Any] | None = None, **options) -> "ModelConfig":
        """Read config.json (and generation_config.json if present) from `model_dir`; `options`: the fields
        after dtype. `generation_config`: where the sampling defaults come from (auto, vllm or a folder).
        `hf_overrides`: merged into config.json first (apply_hf_overrides), so that they set the context limit and
        the end-of-sequence ids config.json gives.

        Raises:
            ModelDirError: the directory or config.json is missing or malformed, or max_model_len exceeds
                the model's position limit.
        """
        path = Path(model_dir)
        if not path.is_dir():
            raise ModelDirError(f"model directory {str(path)!r} does not exist")
        hf_config = apply_hf_overrides(_read_json(path / "config.json"), hf_overrides or {})
        if hf_overrides:
            check_config_class(hf_config)
        generation = _read_json(path / "generation_config.json") if (path / "generation_config.json").exists() else {}
        limit = context_limit(hf_config)
        if max_model_len is None:
            if limit is None:
                raise ModelDirError(f"{path / 'config.json'} names no context limit ({', '.join(CONTEXT_LIMIT_KEYS)}); "
                                    f"pass --max-model-len")
            max_model_len = limit
        elif limit is not None and not 0 < max_model_len <= limit:
            raise ModelDirError(f"--max-model-len {max_model_len} is outside 1..{limit} for this model")
        eos = generation.get("eos_token_id", hf_config.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if isinstance(eos, int) else ())
        return ModelConfig(
            model_dir=str(path.resolve()),
            served_model_name=served_model_name or path.name,
            max_model_len=max_model_len,
            eos_token_ids=eos_ids,
            dtype=dtype,
            sampling_defaults=read_sampling_defaults(generation_config_path(path, generation_config)),
            hf_overrides=dict(hf_overrides or {}),
            **options,
        )


# Names architectures give their position limit, in the order vLLM's and transformers' configs are read.
CONTEXT_LIMIT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "max_seq_len",
                      "n_ctx", "max_seq_length")


def context_limit(hf_config: dict) -> int | None:
    """The model's position limit in tokens from its config.json (or its text_config), None if it names none."""
    for config in (hf_config, hf_config.get("text_config") or {}):
        for key in CONTEXT_LIMIT_KEYS:
            value = config.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def apply_hf_overrides(hf_config: dict, overrides: dict[str, Any]) -> dict:
    """`hf_config` (a config.json, parsed) with `overrides` merged in as vLLM merges --hf-overrides into the model's
    configuration: a key whose value is a nested configuration (an object with its own model_type, as text_config)
    takes the override's keys into it, recursively; any other key, an object-valued one too (rope_scaling), is
    replaced whole. Returns a new dict; `hf_config` is left as it was.

    Raises:
        ModelDirError: an override whose JSON type differs from the value config.json gives that key (an integer
            stands for a number; a key config.json leaves out or sets to null takes any type), naming the key (a
            nested one as text_config.KEY): the worker would otherwise fail building the model, with a traceback.
    """
    merged = dict(hf_config)
    for key, value in overrides.items():
        current = merged.get(key)
        _check_type(key, current, value)
        if isinstance(current, dict) and "model_type" in current and isinstance(value, dict):
            merged[key] = _merge_nested(current, value, key)
        else:
            merged[key] = value
    return merged


def check_config_class(hf_config: dict) -> None:
    """Build the model's transformers configuration class from `hf_config` (config.json with --hf-overrides
    merged in), so that what the class refuses (a rope_scaling without its factor, heads that do not divide the
    hidden size) is refused at start rather than in every worker. A model_type transformers does not know (a model
    that ships its code) is not checked here.

    Raises:
        ModelDirError: the class refuses it, with its reason on one line.
    """
    from transformers import CONFIG_MAPPING, AutoConfig  # only with --hf-overrides: seconds of imports

    model_type = hf_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        return
    try:
        AutoConfig.for_model(**hf_config)
    except Exception as exc:  # transformers raises ValueError, KeyError or its own validation errors
        why = " ".join(str(exc).split()) or type(exc).__name__
        raise ModelDirError(f"--hf-overrides: transformers' {model_type} configuration refuses the overridden "
                            f"config.json: {why[:400]}") from None


def _merge_nested(config: dict, overrides: dict, where: str) -> dict:
    """A nested configuration (at key path `where`) with `overrides` merged in, objects into objects at every
    depth, each value type-checked as apply_hf_overrides checks them."""
    merged = dict(config)
    for key, value in overrides.items():
        current = merged.get(key)
        _check_type(f"{where}.{key}", current, value)
        if isinstance(current, dict) and isinstance(value, dict):
            merged[key] = _merge_nested(current, value, f"{where}.{key}")
        else:
            merged[key] = value
    return merged


def _json_type(value: Any) -> str:
    """The JSON type of a parsed config value, as a message names it."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else "null"


def _check_type(key: str, current: Any, value: Any) -> None:
    """Raises ModelDirError: override `value` for `key` is not of the type of config.json's `current` value."""
    if current is None:
        return
    given, expected = _json_type(value), _json_type(current)
    if given != expected and (given, expected) != ("an integer", "a number"):
        raise ModelDirError(f"--hf-overrides: {key} must be {expected} as in config.json ({json.dumps(current)}), "
                            f"got {given} ({json.dumps(value)})")
    if _is_size(key.rsplit(".", 1)[-1]) and given == "an integer" and current >= 1 > value:
        raise ModelDirError(f"--hf-overrides: {key} is a count or size, at least 1 (config.json: {current}), got "
                            f"{value}")


def _is_size(key: str) -> bool:
    """Whether a config.json key names a count or size (num_hidden_layers, hidden_size, head_dim, ...): a model built
    with 0 or fewer of them fails deep in transformers, or runs with nothing in it."""
    return key.startswith("num_") or key.endswith(("_size", "_dim", "_layers", "_heads")) \
        or key == "max_position_embeddings"


def _read_json(path: Path) -> dict:
    return read_json_object(path)  # common/model_dir.py: ModelDirError when missing, unreadable or not an object
