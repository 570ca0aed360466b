"""Issue 46: a Ray rank on a node without the model directory fetches the launcher's exact Hugging Face snapshot
(worker/model_fetch.py), named by launcher/ray_backend.model_source."""

from __future__ import annotations

import pytest

from shuttle.common.config import MODEL_SOURCE_ENV
from shuttle.common.errors import ModelDirError
from shuttle.launcher.ray_backend import model_source
from shuttle.worker.model_fetch import fetch_missing_model
from tests.hf_cache import COMMIT, REPO_ID, cache_with


def test_a_snapshot_is_named_by_its_repository_and_commit(tmp_path):
    snapshot = cache_with(tmp_path / "hub")
    assert model_source(str(snapshot), REPO_ID) == f"{REPO_ID}@{COMMIT}"
    assert model_source(str(snapshot), "org/other-model") is None  # typed as another id: not this snapshot
    assert model_source(str(tmp_path), REPO_ID) is None  # a directory given as such


def test_a_present_directory_is_used_as_it_is(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_SOURCE_ENV, raising=False)
    fetch_missing_model(str(tmp_path))


def test_a_missing_directory_without_a_source_is_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv(MODEL_SOURCE_ENV, raising=False)
    with pytest.raises(ModelDirError, match="is not on this node: .*a shared volume"):
        fetch_missing_model(str(tmp_path / "gone"))


def test_a_snapshot_landing_elsewhere_than_the_launchers_is_refused(tmp_path, monkeypatch):
    """The node's cache (its own $HF_HOME) holds the commit at another path than the launcher's: refused by name, never
    loaded from a path the launcher did not check."""
    node_home = tmp_path / "node-hf"
    cache_with(node_home / "hub")
    monkeypatch.setenv("HF_HOME", str(node_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as constants
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(node_home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv(MODEL_SOURCE_ENV, f"{REPO_ID}@{COMMIT}")
    launchers = tmp_path / "launcher-hf" / "hub" / "models--org--tiny-model" / "snapshots" / COMMIT
    with pytest.raises(ModelDirError, match="give every node the same \\$HF_HOME"):
        fetch_missing_model(str(launchers))
