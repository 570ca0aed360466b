"""Sampling defaults from a model's generation_config.json, as vLLM applies them (`--generation-config`).

The file's `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty` and `max_new_tokens` (as max_tokens)
become the default of each request field a request does not set; a request that sets one keeps its value. A field
the file does not name keeps SamplingParams' own default (common/sampling.py), the one place each neutral default is
declared. `--generation-config vllm` ignores the file; a folder path reads that folder's generation_config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shuttle.common.errors import InvalidRequestError, ModelDirError
from shuttle.common.model_dir import read_json_object
from shuttle.common.sampling import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
AUTO, VLLM = "auto", "vllm"  # --generation-config's words: the model's folder, or no file at all


@dataclass(frozen=True)
class SamplingDefaults:
    """The default of each request field that a generation_config.json names (None: it names none, and
    SamplingParams' own default applies). max_tokens caps the default of a request that sets none, which is otherwise
    what is left of the context. `source`: the file they come from ("": none)."""

    source: str = ""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def named(self) -> dict[str, Any]:  # by field name: each value has its own field's type
        """The defaults the file names, by field."""
        return {name: getattr(self, name) for name in FILE_KEYS if getattr(self, name) is not None}


# generation_config.json's key of each default (Hugging Face's max_new_tokens is vLLM's max_tokens)
FILE_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repetition_penalty", "max_tokens": "max_new_tokens"}


_INTEGRAL = ("top_k", "max_tokens")


def generation_config_path(model_dir: str | Path, generation_config: str) -> Path | None:
    """The generation_config.json `--generation-config` names for `model_dir` (None: vllm, or auto and the model has
    none).

    Raises:
        ModelDirError: a folder path that does not hold a generation_config.json.
    """
    if generation_config == VLLM:
        return None
    if generation_config == AUTO:
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        return path if path.is_file() else None
    path = Path(generation_config) / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ModelDirError(f"--generation-config {generation_config!r} is neither auto, vllm nor a folder holding a "
                            f"{GENERATION_CONFIG_FILE}")
    return path


def read_sampling_defaults(path: Path | None) -> SamplingDefaults:
    """The sampling defaults `path` (a generation_config.json, or None: none) names, checked as a request's.

    Raises:
        ModelDirError: the file is not a JSON object, or names a value a request could not set.
    """
    if path is None:
        return SamplingDefaults()
    data = read_json_object(path)
    values: dict[str, Any] = {}  # by field name: top_k and max_tokens int, the others float
    for name, key in FILE_KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        integral = name in _INTEGRAL
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integral and value != int(value)):
            raise ModelDirError(f"{path}: {key} must be {'an integer' if integral else 'a number'}, got {value!r}")
        values[name] = int(value) if integral else float(value)
    defaults = SamplingDefaults(source=str(path.resolve()) if values else "", **values)
    try:
        SamplingParams(**defaults.named()).validate(vocab_size=2**31)
    except InvalidRequestError as exc:
        named = FILE_KEYS.get(exc.param or "") or exc.param  # the file's key of the field at fault
        raise ModelDirError(f"{path}: {named} {str(exc).split(' ', 1)[1]}") from None
    return defaults
