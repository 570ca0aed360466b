"""A Hugging Face cache laid out on disk as huggingface_hub documents it, from the test model's files: what the
tests that serve MODEL by id (offline) resolve against."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.server import MODEL_DIR

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO_ID = "org/tiny-model"


def cache_with(hub: Path, repo_id: str = REPO_ID, files=None, commit: str = COMMIT) -> Path:
    """Lay out `repo_id` at `commit` (refs/main) in the cache directory `hub` (HF_HOME/hub): models--org--name/blobs,
    snapshots/<commit>/<file> symlinked to its blob, refs/main, from the test model's files named in `files` (all by
    default). Returns the snapshot directory."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    for name in files if files is not None else os.listdir(MODEL_DIR):
        blob = repo / "blobs" / f"blob-{name}"
        shutil.copyfile(MODEL_DIR / name, blob)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot
