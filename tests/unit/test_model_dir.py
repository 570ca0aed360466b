"""The launcher's model-directory check (common/model_dir.py): every kind of bad directory is one line naming the
path at fault, found without torch; stories260K passes."""

import json
import shutil
import struct
import subprocess
import sys

import pytest

from shuttle.common.errors import ModelDirError
from shuttle.common.model_dir import check_model_dir
from tests.server import MODEL_DIR, REPO

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def f32(name: str, start: int, count: int) -> dict:
    return {name: {"dtype": "F32", "shape": [count], "data_offsets": [start, start + 4 * count]}}


def truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def write_index(directory, shards: list[str]) -> None:
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {f"t{i}": shard for i, shard in enumerate(shards)}}))


# (what is wrong, how to make it from a good copy, what the message says)
BROKEN = [
    ("config.json missing", lambda d: (d / "config.json").unlink(), "has no config.json"),
    ("config.json not JSON", lambda d: (d / "config.json").write_text("{ not json"), "config.json is not valid JSON"),
    ("config.json not an object", lambda d: (d / "config.json").write_text("[1]"), "does not hold a JSON object"),
    ("config.json unreadable", lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()),
     "cannot read"),
    ("no weights", lambda d: (d / "model.safetensors").unlink(), "has no weights (none of model.safetensors, "),
    ("no tokenizer", lambda d: (d / "tokenizer.json").unlink(), "has no tokenizer.json"),
    ("tokenizer corrupt", lambda d: (d / "tokenizer.json").write_text('{"model": 3}'), "cannot load"),
    ("weights cut short", lambda d: truncate(d / "model.safetensors", 1_000_000),
     "its tensors hold 1040128 bytes but 995136 follow the header"),
    ("weights shorter than a header", lambda d: truncate(d / "model.safetensors", 5), "shorter than the 8-byte"),
    ("header longer than the file", lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 10**6) + b"{}"),
     "its header claims 1000000 bytes of a 10-byte file"),
    ("header not JSON", lambda d: (d / "model.safetensors").write_bytes(struct.pack("<Q", 4) + b"\xff{]x"),
     "its header is not JSON"),
    ("tensor size and dtype disagree", lambda d: (d / "model.safetensors").write_bytes(safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))), "tensor 'a' (F32 [3]) has 8 bytes"),
    ("a hole between tensors", lambda d: (d / "model.safetensors").write_bytes(safetensors_bytes(
        {**f32("a", 0, 1), **f32("b", 8, 1)}, bytes(12))), "tensor 'b' starts at byte 8 of the data, not 4"),
    ("tensor without offsets", lambda d: (d / "model.safetensors").write_bytes(safetensors_bytes(
        {"a": {"dtype": "F32", "shape": [1]}}, bytes(4))), "tensor 'a' has no valid shape and data_offsets"),
    ("weights unreadable", lambda d: ((d / "model.safetensors").unlink(), (d / "model.safetensors").mkdir()),
     "cannot read"),
    ("index names a missing shard", lambda d: ((d / "model.safetensors").unlink(),
                                               write_index(d, ["model-00001-of-00002.safetensors"])),
     "names model-00001-of-00002.safetensors, which is missing"),
    ("a corrupt shard", lambda d: ((d / "model.safetensors").rename(d / "model-1.safetensors"),
                                   truncate(d / "model-1.safetensors", 100), write_index(d, ["model-1.safetensors"])),
     "model-1.safetensors is not a valid safetensors file"),
    ("pytorch_model.bin not a checkpoint", lambda d: ((d / "model.safetensors").unlink(),
                                                      (d / "pytorch_model.bin").write_text("hello")),
     "pytorch_model.bin is not a PyTorch checkpoint"),
]


@pytest.fixture
def model_copy(tmp_path):
    directory = tmp_path / "model"
    directory.mkdir()
    for name in FILES:
        shutil.copyfile(MODEL_DIR / name, directory / name)
    return directory


@pytest.mark.parametrize("what, breaks, message", BROKEN, ids=[case[0] for case in BROKEN])
def test_a_bad_model_directory_is_one_line_naming_it(model_copy, what, breaks, message):
    breaks(model_copy)
    with pytest.raises(ModelDirError) as exc:
        check_model_dir(model_copy)
    assert message in str(exc.value) and str(model_copy) in str(exc.value) and "\n" not in str(exc.value)


def test_a_file_inside_the_model_directory_names_the_directory():
    with pytest.raises(ModelDirError, match=f"config.json is a file; pass its directory {MODEL_DIR}$"):
        check_model_dir(MODEL_DIR / "config.json")


def test_a_missing_path_does_not_exist(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        check_model_dir(tmp_path / "nope")


def test_good_directories_pass(model_copy):
    assert check_model_dir(MODEL_DIR)["architectures"] == ["LlamaForCausalLM"]
    (model_copy / "model.safetensors").rename(model_copy / "model-1.safetensors")
    write_index(model_copy, ["model-1.safetensors", "model-1.safetensors"])
    check_model_dir(model_copy)  # sharded: every shard the index names is present and sound
    (model_copy / "model.safetensors.index.json").unlink()
    (model_copy / "pytorch_model.bin").write_bytes(b"PK\x03\x04")  # torch.save's zip format
    check_model_dir(model_copy)


def test_the_check_imports_no_torch():
    """It runs in the launcher, before any process starts: no second of torch import for a one-line refusal."""
    code = ("import sys; import launcher.commands; from common.model_dir import check_model_dir; "
            f"check_model_dir({str(MODEL_DIR)!r}); print(sorted({{'torch', 'numpy'}} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_an_engine_needs_no_tokenizer(model_copy):
    """`shuttle engine` serves a frontend on another host, which tokenizes."""
    (model_copy / "tokenizer.json").unlink()
    check_model_dir(model_copy, tokenizer=False)
