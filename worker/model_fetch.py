"""A worker rank on another machine (a Ray node) whose model directory is not there yet fetches it first.

The launcher resolved MODEL on its own machine; when that was a Hugging Face id, the directory is a snapshot in the
Hugging Face cache, named by the repository and the exact commit. The launcher hands a Ray rank both in
common/config.py's MODEL_SOURCE_ENV ("org/name@commit"), and the rank downloads that commit into its own node's
cache, which lands at the same path when the nodes share the cache's location ($HF_HOME, which the rank takes from
the launcher), so every rank loads the very files the launcher checked.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from shuttle.common.config import MODEL_SOURCE_ENV
from shuttle.common.errors import ModelDirError

log = logging.getLogger("shuttle.worker")


def fetch_missing_model(model_dir: str) -> None:
    """Download the launcher's snapshot (MODEL_SOURCE_ENV) when `model_dir` is not on this machine.

    Raises:
        ModelDirError: the directory is missing and cannot be fetched, or lands elsewhere than the launcher's (the
            nodes' $HF_HOME differ).
    """
    if Path(model_dir).is_dir():
        return
    source = os.environ.get(MODEL_SOURCE_ENV)
    if not source:
        raise ModelDirError(f"{model_dir} is not on this node: under --distributed-executor-backend ray, every node "
                            f"needs the model at the launcher's path (a shared volume), or MODEL as a Hugging Face id")
    from shuttle.common.model_source import MODEL_PATTERNS, resolve

    repo, commit = source.rsplit("@", 1)
    log.info("fetching %s at %s into this node's Hugging Face cache", repo, commit)
    fetched = resolve(repo, commit, None, MODEL_PATTERNS, local_first=False)
    if fetched.resolve() != Path(model_dir).resolve():
        raise ModelDirError(f"{repo} landed at {fetched} on this node, not at the launcher's {model_dir}: give every "
                            f"node the same $HF_HOME")
