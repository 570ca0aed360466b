"""MODEL as the user typed it, a directory or a Hugging Face id, made a local directory once, in the launcher,
before any process starts: the children are handed the directory and never look anything up.

An id is looked up through huggingface_hub as transformers and vLLM do: the local cache first (HF_HOME, or
--download-dir), then, unless HF_HUB_OFFLINE is set, a download of the files shuttle reads (config, weights,
tokenizer, chat template; Python files only under --trust-remote-code). Every failure is one line (ModelDirError).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from shuttle.common.errors import ModelDirError
from shuttle.common.model_dir import WEIGHT_FILES, read_json_object

TOKENIZER_PATTERNS = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")
MODEL_PATTERNS = TOKENIZER_PATTERNS + ("*.safetensors",)
BIN_PATTERNS = ("pytorch_model*.bin", "pytorch_model.bin.index.json")  # only when a repository has no safetensors


@dataclass(frozen=True)
class ModelSource:
    """Where the served model's files are.

    Attributes:
        model_dir: the local directory of config.json and the weights.
        tokenizer_dir: the local directory of the tokenizer (model_dir unless --tokenizer names another).
        typed: MODEL as the user typed it (the served model id unless --served-model-name says otherwise).
    """

    model_dir: Path
    tokenizer_dir: Path
    typed: str


def locate(model: str, tokenizer: str | None = None, revision: str | None = None, download_dir: str | None = None,
           trust_remote_code: bool = False) -> ModelSource:
    """Resolve MODEL (and --tokenizer) to local directories. Raises ModelDirError."""
    patterns = MODEL_PATTERNS + (("*.py",) if trust_remote_code else ())
    model_dir = resolve(model, revision, download_dir, patterns)
    if _is_snapshot(model, model_dir) and not any((model_dir / name).exists() for name in WEIGHT_FILES):
        model_dir = resolve(model, revision, download_dir, BIN_PATTERNS, local_first=False)
    tokenizer_dir = model_dir if tokenizer is None or tokenizer == model else \
        resolve(tokenizer, None, download_dir, TOKENIZER_PATTERNS, what="--tokenizer")
    return ModelSource(model_dir, tokenizer_dir, model)


def resolve(name: str, revision: str | None, download_dir: str | None, patterns: tuple[str, ...],
            what: str = "model", local_first: bool = True) -> Path:
    """`name` as a local path if one exists (or it cannot be a Hugging Face id), else the snapshot directory of
    that id at `revision` in the Hugging Face cache, downloaded (only `patterns`) when it is not there and the hub
    is not offline. The returned path is not checked (common/model_dir.py does that)."""
    path = Path(name).expanduser()
    if path.exists() or not is_repo_id(name):
        return path
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    at = f" at revision {revision}" if revision else ""
    cache = download_dir or constants.HF_HUB_CACHE
    if local_first or constants.HF_HUB_OFFLINE:
        try:
            return Path(snapshot_download(name, revision=revision, cache_dir=download_dir, local_files_only=True))
        except LocalEntryNotFoundError:
            if constants.HF_HUB_OFFLINE:
                raise ModelDirError(f"{what} {name!r}{at} is neither a directory nor in the Hugging Face cache "
                                    f"{cache}, and HF_HUB_OFFLINE is set (download it once online, or unset it)") \
                    from None
    try:
        return Path(snapshot_download(name, revision=revision, cache_dir=download_dir,
                                      allow_patterns=list(patterns)))
    except GatedRepoError:
        raise ModelDirError(f"{what} {name!r} is gated on the Hugging Face hub: accept its terms there and log in "
                            f"(`hf auth login` or $HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise ModelDirError(f"{what} {name!r} is neither a directory nor a model on the Hugging Face hub (a private "
                            f"one needs `hf auth login` or $HF_TOKEN)") from None
    except RevisionNotFoundError:
        raise ModelDirError(f"{what} {name!r} has no revision {revision!r} on the Hugging Face hub") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as exc:
        raise ModelDirError(f"cannot download {what} {name!r}{at} into {cache}: {_first_line(exc)}") from None


def is_repo_id(name: str) -> bool:
    """Whether `name` can be a Hugging Face repository id ('org/name' or 'name'); paths ('./x', '/x', 'a/b/c',
    '~/x') cannot."""
    if name.startswith((".", "/", "~")) or os.sep != "/" and os.sep in name:
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _is_snapshot(name: str, resolved: Path) -> bool:
    return resolved != Path(name).expanduser()


def remote_code_refusal(model_dir: Path, hf_config: dict, trust_remote_code: bool) -> str | None:
    """Why this model cannot load without --trust-remote-code (None when it can): its config.json maps transformers'
    auto classes to Python files of its own (auto_map) and transformers has no implementation of its model_type."""
    auto_map = hf_config.get("auto_map")
    if trust_remote_code or not isinstance(auto_map, dict) or not auto_map:
        return None
    from transformers import CONFIG_MAPPING  # only for the few models that ship code
    if hf_config.get("model_type") in CONFIG_MAPPING:
        return None  # transformers' own implementation serves it, as it would without the flag
    return (f"{model_dir / 'config.json'} needs the model's own Python code ({', '.join(sorted(auto_map))} in "
            f"auto_map, model_type {hf_config.get('model_type')!r} unknown to transformers); pass "
            f"--trust-remote-code to run it")


def sentencepiece_tokenizer(tokenizer_dir: Path, out_dir: Path, trust_remote_code: bool = False) -> Path:
    """A directory with a tokenizer.json for a tokenizer directory that has only a SentencePiece tokenizer.model:
    transformers' AutoTokenizer loads it (it needs the sentencepiece package) and its fast form is saved, with the
    tokenizer's config and chat template, into `out_dir`.

    Raises:
        ModelDirError: transformers cannot load it here, or it has no fast (tokenizers) form.
    """
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # its fallback warnings would make the refusal many lines
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), trust_remote_code=trust_remote_code)
    except Exception as exc:  # ImportError (no sentencepiece), OSError, ValueError: whatever transformers raises
        raise ModelDirError(f"{tokenizer_dir} has a SentencePiece tokenizer.model but no tokenizer.json, and "
                            f"transformers cannot load it here ({_first_line(exc)}; it needs the sentencepiece "
                            f"package)") from None
    finally:
        transformers_logging.set_verbosity(verbosity)
    if not getattr(tokenizer, "is_fast", False):
        raise ModelDirError(f"{tokenizer_dir}: transformers loads its tokenizer.model only as a slow tokenizer "
                            f"({type(tokenizer).__name__}); shuttle needs a tokenizer.json")
    tokenizer.save_pretrained(str(out_dir))
    read_json_object(out_dir / "tokenizer.json")
    return out_dir


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
