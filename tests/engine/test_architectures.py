"""Issue 8: models shuttle serves are exact (tokens and logprobs against transformers' eager generate), and what it
cannot serve exactly is refused at start-up with a one-line reason and exit status 2.

The full table over every architecture is scripts/dev/check_architectures.py; CI runs the handful the issue names.
"""

import shutil
import subprocess
import sys

import pytest

from scripts.dev.check_architectures import VARIANTS, build_model_dir, check
from tests.server import MODEL_DIR, REPO

CI_ARCHITECTURES = ["llama-gqa", "qwen3", "mistral-window8", "gemma2-softcap1", "gpt2", "gpt_oss"]


@pytest.mark.parametrize("name", CI_ARCHITECTURES)
def test_architecture_is_exact(name):
    model_type, extra = VARIANTS.get(name, (name, {}))
    result = check(name, model_type, extra)
    assert result.status == "exact", result


@pytest.mark.parametrize("model_type, reason", [
    ("bloom", "does not route through transformers' attention interface"),
    ("stablelm", "fails on shuttle's paged attention path"),
])
def test_unservable_architecture_is_refused(model_type, reason):
    result = check(model_type, model_type)
    assert result.status == "refused" and reason in result.detail, result


def test_serve_refuses_with_exit_status_2_and_one_line(tmp_path):
    build_model_dir("bloom", tmp_path)
    shutil.copy(MODEL_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    proc = subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", "serve", str(tmp_path), "--port", "0",
                           "--max-model-len", "128"], cwd=REPO,  # BLOOM names no context limit of its own
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2
    refusals = [line for line in proc.stderr.splitlines() if "cannot serve this model" in line]
    assert len(refusals) == 1 and "BloomForCausalLM" in refusals[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_transformers_cache_goes_under_the_keyword_the_forward_takes():
    """By transformers 5.25 forward's past_key_values is named cache; 5.17 (the GPU machine's) has the old name and
    takes the new one into **kwargs without a word, so the start-up check's cached decode ran cacheless there and
    refused every model. Both spellings, and the real model's."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from shuttle.worker.model_loader import cache_kwargs

    class Renamed(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs):
            return cache

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return past_key_values

    marker = object()
    assert cache_kwargs(Renamed(), marker) == {"cache": marker}
    assert cache_kwargs(Older(), marker) == {"past_key_values": marker}
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    renamed = tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (5, 25)
    assert list(cache_kwargs(model, marker)) == ["cache" if renamed else "past_key_values"]
