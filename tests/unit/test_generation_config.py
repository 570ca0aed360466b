"""generation_config.json sampling defaults (--generation-config, common/generation_config.py): the model's values
become the defaults of the request fields a request leaves unset, as vLLM applies them; `vllm` ignores the file; a
folder path reads that folder's. Pure units: ModelConfig.from_dir and frontend/request/params.py sampling_params."""

from __future__ import annotations

import json
import shutil

import pytest

from shuttle.common.errors import ModelDirError
from shuttle.common.model_config import ModelConfig
from shuttle.common.sampling import SamplingParams
from shuttle.frontend.request.decoding import convert_body
from shuttle.frontend.request.params import sampling_params
from shuttle.frontend.request.protocol import CompletionRequest
from shuttle.launcher.cli import build_parser
from tests.server import MODEL_DIR

NEUTRAL = SamplingParams()


@pytest.fixture
def model_dir(tmp_path):
    """stories260K with a generation_config.json that sets temperature 0.5 and top_k 7."""
    folder = tmp_path / "model"
    shutil.copytree(MODEL_DIR, folder)
    generation = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**generation, "temperature": 0.5, "top_k": 7}))
    return folder


def _params(model: ModelConfig, **body) -> SamplingParams:
    request = convert_body({"prompt": [1, 2], **body}, CompletionRequest)
    return sampling_params(request, 2, model.max_model_len, 512, request.max_tokens, None,
                           defaults=model.sampling_defaults)


def test_the_files_values_are_the_defaults_of_fields_a_request_leaves_unset(model_dir):
    model = ModelConfig.from_dir(model_dir)
    assert model.sampling_defaults.named() == {"temperature": 0.5, "top_k": 7}
    assert model.sampling_defaults.source == str((model_dir / "generation_config.json").resolve())
    params = _params(model)
    assert (params.temperature, params.top_k) == (0.5, 7)
    assert (params.top_p, params.min_p, params.repetition_penalty) == (NEUTRAL.top_p, NEUTRAL.min_p,
                                                                      NEUTRAL.repetition_penalty)
    assert params.max_tokens == model.max_model_len - 2  # the file names no max_new_tokens: the room left


def test_a_request_that_sets_a_field_keeps_its_value_even_the_neutral_one(model_dir):
    model = ModelConfig.from_dir(model_dir)
    params = _params(model, temperature=1.0, top_k=0)
    assert (params.temperature, params.top_k) == (1.0, 0)
    params = _params(model, top_k=-1, temperature=0.0)  # vLLM's -1 (off) is shuttle's 0
    assert (params.temperature, params.top_k) == (0.0, 0)
    params = _params(model, temperature=None)  # null means unset, as everywhere
    assert params.temperature == 0.5


def test_vllm_ignores_the_file(model_dir):
    model = ModelConfig.from_dir(model_dir, generation_config="vllm")
    assert model.sampling_defaults.named() == {} and model.sampling_defaults.source == ""
    params = _params(model)
    assert (params.temperature, params.top_k) == (NEUTRAL.temperature, NEUTRAL.top_k)


def test_a_folder_path_is_read_instead_of_the_models(model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
                                                              "max_new_tokens": 9}))
    model = ModelConfig.from_dir(model_dir, generation_config=str(other))
    assert model.sampling_defaults.named() == {"top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
                                               "max_tokens": 9}
    params = _params(model)
    assert (params.temperature, params.top_k, params.top_p, params.min_p, params.repetition_penalty,
            params.max_tokens) == (NEUTRAL.temperature, NEUTRAL.top_k, 0.9, 0.05, 1.1, 9)
    assert _params(model, max_tokens=20).max_tokens == 20  # max_new_tokens is only the default
    with pytest.raises(ModelDirError, match="neither auto, vllm nor a folder"):
        ModelConfig.from_dir(model_dir, generation_config=str(tmp_path / "missing"))


def test_the_default_model_names_no_sampling_default():
    defaults = ModelConfig.from_dir(MODEL_DIR).sampling_defaults
    assert defaults.named() == {} and defaults.source == ""


@pytest.mark.parametrize("values, message", [
    ({"temperature": "hot"}, "temperature must be a number"),
    ({"top_k": 2.5}, "top_k must be an integer"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be at least 1"),
])
def test_a_value_no_request_could_set_is_refused_at_start_up(model_dir, values, message):
    (model_dir / "generation_config.json").write_text(json.dumps(values))
    with pytest.raises(ModelDirError, match=message):
        ModelConfig.from_dir(model_dir)


def test_the_flag_reaches_the_model_config(model_dir):
    from shuttle.common.config import _model_config
    args = build_parser().parse_args(["serve", str(model_dir), "--generation-config", "vllm"])
    assert args.generation_config == "vllm"
    assert _model_config(args).sampling_defaults.named() == {}
    args = build_parser().parse_args(["serve", str(model_dir)])
    assert args.generation_config == "auto"
    assert _model_config(args).sampling_defaults.named() == {"temperature": 0.5, "top_k": 7}
