"""`shuttle serve MODEL` / `shuttle engine MODEL`: MODEL (a directory or a Hugging Face id) and --tokenizer made
local directories once, before any process starts (common/model_source.py), and checked (common/model_dir.py), so
that every child is handed directories and a bad model is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from shuttle.common.config import DEFAULT_MODEL_DIR
from shuttle.common.errors import ModelDirError
from shuttle.common.model_dir import check_model_dir
from shuttle.common.model_source import locate, remote_code_refusal, sentencepiece_tokenizer

SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")  # what --load-format safetensors loads


def resolve_model_args(args: argparse.Namespace) -> None:
    """Set args.model (MODEL as typed), args.model_dir and args.tokenizer_dir (local directories).

    Raises:
        ModelDirError: a one-line reason: no MODEL, both MODEL and --model, an id
            that cannot be resolved, a bad model or tokenizer directory, --load-format safetensors for a model
            without safetensors weights.
    """
    option = getattr(args, "model_option", None)
    if args.model_dir == str(DEFAULT_MODEL_DIR) and (option or getattr(args, "config_model", None)):
        args.model_dir = None  # the positional's default, not a MODEL typed beside --model
    if option and args.model_dir and option != args.model_dir:
        raise ModelDirError(f"MODEL {args.model_dir!r} and --model {option!r} disagree; give one")
    option = option or (None if args.model_dir else getattr(args, "config_model", None))  # the file's yields
    typed = option or args.model_dir
    if typed is None:
        raise ModelDirError("no MODEL given and the default ../shared/models/stories260K is missing")
    trust = getattr(args, "trust_remote_code", False)
    source = locate(typed, getattr(args, "tokenizer", None), getattr(args, "revision", None),
                    getattr(args, "download_dir", None), trust)
    frontend_tokenizes = args.command == "serve"
    tokenizer_dir = source.tokenizer_dir
    if frontend_tokenizes and not (tokenizer_dir / "tokenizer.json").is_file() \
            and (tokenizer_dir / "tokenizer.model").is_file():
        # a SentencePiece-only tokenizer: its tokenizer.json form, made once and kept while the launcher runs
        tokenizer_dir = sentencepiece_tokenizer(tokenizer_dir, Path(tempfile.mkdtemp(prefix="shuttle-tokenizer-")),
                                                trust)
    hf_config = check_model_dir(source.model_dir, tokenizer=frontend_tokenizes, tokenizer_dir=tokenizer_dir)
    if getattr(args, "load_format", "auto") == "safetensors" and not any(
            (Path(source.model_dir) / name).is_file() for name in SAFETENSORS_WEIGHTS):
        raise ModelDirError(f"--load-format safetensors: {source.model_dir} has no {' or '.join(SAFETENSORS_WEIGHTS)} "
                            f"(--load-format auto loads its pytorch_model.bin)")
    refusal = remote_code_refusal(source.model_dir, hf_config, trust)
    if refusal:
        raise ModelDirError(refusal)
    # The served id is MODEL as typed, as in vLLM; with no MODEL typed, the default model's name, not a path that
    # depends on where the checkout lies.
    served = DEFAULT_MODEL_DIR.name if typed == str(DEFAULT_MODEL_DIR) else typed
    args.model, args.model_dir, args.tokenizer_dir = served, str(source.model_dir), str(tokenizer_dir)
