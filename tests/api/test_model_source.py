"""MODEL as a Hugging Face id (common/model_source.py, launcher/model_args.py), vLLM's flag spellings, and GET
/version: offline, against a Hugging Face cache in a temporary directory that huggingface_hub itself resolves; no
server is launched (the refusals run `shuttle serve`, which exits before any process starts; those that load
transformers' tokenizer code run it in this process)."""

import argparse
import os
import shutil
import subprocess
import sys

import pytest
from aiohttp.test_utils import TestClient, TestServer
from huggingface_hub import snapshot_download, try_to_load_from_cache

from shuttle.common.arg_types import token_count
from shuttle.common.config import IpcConfig, ShuttleConfig
from shuttle.common.model_source import is_repo_id, locate, resolve
from shuttle.common.version import shuttle_version
from shuttle.launcher import cli as launcher_cli
from shuttle.launcher.cli import build_parser
from shuttle.launcher.model_args import resolve_model_args
from tests.hf_cache import COMMIT, REPO_ID, cache_with
from tests.server import MODEL_DIR, REPO
from tests.unit.test_startup_refusals import assert_refused


@pytest.fixture
def hub(tmp_path):
    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    return hub


def test_huggingface_hub_itself_resolves_the_laid_out_cache(hub):
    snapshot = cache_with(hub)
    assert try_to_load_from_cache(REPO_ID, "config.json", cache_dir=hub) == str(snapshot / "config.json")
    assert snapshot_download(REPO_ID, cache_dir=hub, local_files_only=True) == str(snapshot)


def test_an_id_resolves_to_its_cached_snapshot_and_a_directory_to_itself(hub):
    snapshot = cache_with(hub)
    source = locate(REPO_ID, download_dir=str(hub))
    assert source.model_dir == source.tokenizer_dir == snapshot and source.typed == REPO_ID
    assert resolve(REPO_ID, COMMIT, str(hub), ()) == snapshot  # a commit as --revision
    assert locate(str(MODEL_DIR), download_dir=str(hub)).model_dir == MODEL_DIR


def test_tokenizer_from_another_id(hub):
    cache_with(hub)
    other = cache_with(hub, "org/tokenizer-only", ["tokenizer.json", "tokenizer_config.json"])
    assert locate(REPO_ID, "org/tokenizer-only", download_dir=str(hub)).tokenizer_dir == other


@pytest.mark.parametrize("name,is_id", [("org/tiny-model", True), ("gpt2", True), ("./models/x", False),
                                        ("/abs/path", False), ("a/b/c", False), ("~/x", False)])
def test_what_can_be_an_id(name, is_id):
    assert is_repo_id(name) is is_id


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def test_the_served_id_is_what_the_user_typed_and_served_names_are_several(hub):
    snapshot = cache_with(hub)
    args = serve_args(REPO_ID, "--download-dir", str(hub))
    resolve_model_args(args)
    model = ShuttleConfig.from_args(args, IpcConfig.in_directory("/x")).model
    assert (model.model_dir, model.served_model_name) == (str(snapshot.resolve()), REPO_ID)
    args = serve_args(REPO_ID, "--download-dir", str(hub), "--served-model-name", "a", "b")
    resolve_model_args(args)
    assert ShuttleConfig.from_args(args, IpcConfig.in_directory("/x")).model.served_model_names == ("a", "b")


def test_an_id_needs_no_network_once_cached_and_the_tokenizer_loads_by_it(hub):
    from transformers import AutoTokenizer
    cache_with(hub)
    # A client's lookup by the served id, offline. (HF_HUB_OFFLINE set now would not count: huggingface_hub reads
    # it at import, and an online lookup without a network waits out its retries.)
    tokenizer = AutoTokenizer.from_pretrained(REPO_ID, cache_dir=str(hub), local_files_only=True)
    assert tokenizer("Once upon a time").input_ids


@pytest.mark.parametrize("text,value", [("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("2048", 2048),
                                        ("1m", 10**6), ("1M", 2**20)])
def test_token_count_suffixes_as_vllm(text, value):
    assert token_count(text) == value


@pytest.mark.parametrize("text", ["1.5K", "0", "12x", "k"])
def test_bad_token_counts(text):
    with pytest.raises(argparse.ArgumentTypeError):
        token_count(text)


def test_vllm_aliases():
    args = serve_args("-tp", "2", "-dp", "3", "--dtype", "half", "--max-model-len", "1K", "--seed", "7",
                      "--disable-log-requests", "--max-logprobs", "5", "--trust-remote-code")
    assert (args.tensor_parallel_size, args.data_parallel_size, args.dtype, args.max_model_len, args.seed) == \
        (2, 3, "float16", 1024, 7)
    assert (args.enable_log_requests, args.max_logprobs, args.trust_remote_code) == (False, 5, True)
    assert serve_args("--dtype", "float").dtype == "float32"
    assert serve_args().enable_log_requests is False  # vLLM's default: no request log
    assert serve_args("--enable-log-requests").enable_log_requests is True
    assert serve_args("--enable-log-requests", "--disable-log-stats").disable_log_stats is True


def shuttle(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shuttle.launcher.cli", *args], cwd=REPO, capture_output=True,
                          text=True,
                          timeout=60, env={**os.environ, **(env or {})})


def cli_refusal(capsys, *argv: str) -> str:
    """`shuttle *argv` in this process (with the no_launch fixture): its one line on stderr, after exit status 2.
    In process because these refusals load transformers' tokenizer code, seconds of imports in a new interpreter."""
    status = launcher_cli.main(list(argv))
    captured = capsys.readouterr()
    assert status == 2 and captured.err.count("\n") == 1 and captured.out == "", captured.err[-2000:]
    return captured.err


def test_version_flag():
    result = shuttle("--version")
    assert result.returncode == 0 and result.stdout.strip() == shuttle_version() != "unknown"


def test_an_id_missing_from_the_cache_offline_is_one_line(hub):
    env = {"HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    assert_refused(shuttle("serve", "org/absent", "--port", "0", env=env),
                   "model 'org/absent' is neither a directory nor in the Hugging Face cache")


@pytest.mark.parametrize("files,message", [
    (["config.json", "tokenizer.json"], "has no weights"),
    (["config.json", "model.safetensors"], "has no tokenizer.json"),
    (["model.safetensors", "tokenizer.json"], "has no config.json"),
])
def test_a_bad_cached_model_is_one_line_before_any_process(hub, files, message):
    cache_with(hub, files=files)
    env = {"HF_HOME": str(hub.parent), "HF_HUB_OFFLINE": "1"}
    assert_refused(shuttle("serve", REPO_ID, "--port", "0", env=env), message)


def test_a_sentencepiece_only_tokenizer_that_transformers_cannot_load_is_one_line(tmp_path, no_launch, capsys):
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        shutil.copyfile(MODEL_DIR / name, tmp_path / name)
    (tmp_path / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    assert "has a SentencePiece tokenizer.model" in cli_refusal(capsys, "serve", str(tmp_path), "--port", "0")


def test_a_model_that_needs_remote_code_is_refused_without_the_flag(tmp_path, no_launch, capsys):
    import json
    for name in ("model.safetensors", "tokenizer.json"):
        shutil.copyfile(MODEL_DIR / name, tmp_path / name)
    config = json.loads((MODEL_DIR / "config.json").read_text())
    config.update(model_type="my_own_llama", auto_map={"AutoModelForCausalLM": "modeling_mine.MyLlama"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert "pass --trust-remote-code to run it" in cli_refusal(capsys, "serve", str(tmp_path), "--port", "0")


def test_an_unknown_vllm_flag_is_still_refused():
    result = shuttle("serve", str(MODEL_DIR), "--kv-transfer-config", "{}")
    assert result.returncode == 2 and "unrecognized arguments: --kv-transfer-config" in result.stderr


async def test_get_version_and_every_served_name():
    import dataclasses

    from shuttle.frontend.state import STATE
    from tests.api.test_api_details import STORY
    from tests.fake_engine import FakeEngine, frontend_app
    app = frontend_app(FakeEngine(script=list(STORY)))
    state = app[STATE]
    state.config = dataclasses.replace(state.config, model=dataclasses.replace(
        state.config.model, served_model_name="first", served_model_aliases=("second",)))
    async with TestClient(TestServer(app)) as client:
        response = await client.get("/version")
        assert response.status == 200 and await response.json() == {"version": shuttle_version()}
        listed = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in listed["data"]] == ["first", "second"]
        assert (await client.get("/v1/models/second")).status == 200
        assert (await client.get("/v1/models/third")).status == 404
        body = {"model": "second", "prompt": "Once", "max_tokens": 2}
        response = await client.post("/v1/completions", json=body)
        assert response.status == 200 and (await response.json())["model"] == "first"
        wrong = {"model": "third", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
        completion, message = (await client.post("/v1/chat/completions", json=wrong),
                               await client.post("/v1/messages", json=wrong))
        assert (completion.status, message.status) == (404, 404)
        expected = "The model `third` does not exist; this server serves `first` or `second`"
        assert (await completion.json())["error"]["message"] == expected
        assert await message.json() == {"type": "error", "error": {"type": "not_found_error", "message": expected}}


@pytest.mark.parametrize("dtype", ["float16", "half"])
def test_float16_on_the_cpu_is_one_line_naming_what_serves(no_launch, capsys, dtype):
    """It crashed the worker at start-up (KeyError: torch.float16 in the CPU paged kernel)."""
    refusal = cli_refusal(capsys, "serve", str(MODEL_DIR), "--port", "0", "--device", "cpu", "--dtype", dtype)
    assert "on the CPU" in refusal and "--dtype bfloat16" in refusal
