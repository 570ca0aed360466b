"""Is this a model directory shuttle can serve? One check, run by the launcher before any process starts, so that a
wrong path or a broken download is one line naming the file at fault instead of a worker's traceback after the
model has half loaded.

Light on purpose (no torch, no numpy): a safetensors file's header is read and checked here by the format's own
rules (github.com/huggingface/safetensors, "Format"), which also finds a file cut short by a partial download.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from shuttle.common.errors import ModelDirError

# The weight files transformers' from_pretrained looks for, in the order it prefers them.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library refuses longer headers
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def check_model_dir(model_dir: str | os.PathLike, tokenizer: bool = True,
                    tokenizer_dir: str | os.PathLike | None = None) -> dict:
    """Check that `model_dir` holds a readable config.json, weights transformers can find (each safetensors file
    with a sound header, each shard an index names present) and, unless `tokenizer` is False (`shuttle engine`:
    the tokenizer is the frontend's), a loadable tokenizer.json (in `tokenizer_dir` when given: --tokenizer).

    Returns:
        config.json, parsed.
    Raises:
        ModelDirError: a one-line message naming the path at fault and what is wrong with it.
    """
    path = Path(model_dir)
    if path.is_file():
        raise ModelDirError(f"{path} is a file; pass its directory {path.absolute().parent}")
    if not path.is_dir():
        raise ModelDirError(f"model directory {str(path)!r} does not exist")
    try:
        names = set(os.listdir(path))
    except OSError as exc:
        raise ModelDirError(f"cannot read model directory {path}: {exc.strerror or exc}") from None
    if "config.json" not in names:
        raise ModelDirError(f"{path} has no config.json: not a Hugging Face model directory (config.json, weights, "
                            f"tokenizer.json)")
    hf_config = read_json_object(path / "config.json")
    weights = next((name for name in WEIGHT_FILES if name in names), None)
    if weights is None:
        raise ModelDirError(f"{path} has no weights (none of {', '.join(WEIGHT_FILES)})")
    for shard in _shards(path / weights):
        if shard.suffix == ".safetensors":
            check_safetensors(shard)
        else:
            _check_readable(shard)
    if tokenizer:
        check_tokenizer_dir(Path(tokenizer_dir) if tokenizer_dir is not None else path)
    return hf_config


def check_tokenizer_dir(path: Path) -> None:
    """Check that `path` holds a tokenizer.json the frontend's `tokenizers` loader reads. Raises ModelDirError."""
    if not path.is_dir():
        raise ModelDirError(f"tokenizer directory {str(path)!r} does not exist")
    if not (path / "tokenizer.json").is_file():
        raise ModelDirError(f"{path} has no tokenizer.json" + (
            " (only a SentencePiece tokenizer.model)" if (path / "tokenizer.model").is_file() else ""))
    from tokenizers import Tokenizer  # the frontend's own loader; light (no torch)
    try:
        Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ModelDirError(f"cannot load {path / 'tokenizer.json'}: {_first_line(exc)}") from None


def read_json_object(path: Path) -> dict:
    """The JSON object in `path`. Raises ModelDirError: missing, unreadable, not JSON, or not an object."""
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise ModelDirError(f"{path} is missing") from None
    except OSError as exc:
        raise ModelDirError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ModelDirError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ModelDirError(f"{path} does not hold a JSON object")
    return data


def check_safetensors(path: Path) -> None:
    """Check a safetensors file's header: its length fits the file, it is a JSON object of tensors whose byte
    ranges tile the data that follows it exactly, each as long as its dtype and shape say.

    Raises:
        ModelDirError: naming the file and the first fault found.
    """
    def corrupt(why: str) -> ModelDirError:
        return ModelDirError(f"{path} is not a valid safetensors file: {why} (an interrupted download?)")

    header, length, size = safetensors_header(path, corrupt)
    ranges = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        shape = info.get("shape") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_index(o) for o in offsets)
                and offsets[0] <= offsets[1] and isinstance(shape, list) and all(_index(d) for d in shape)):
            raise corrupt(f"tensor {name!r} has no valid shape and data_offsets")
        width = DTYPE_BYTES.get(info.get("dtype"))
        if width is not None:  # sub-byte and newer dtypes: the loader checks those itself
            elements = 1
            for dim in shape:
                elements *= dim
            if offsets[1] - offsets[0] != elements * width:
                raise corrupt(f"tensor {name!r} ({info['dtype']} {shape}) has {offsets[1] - offsets[0]} bytes")
        ranges.append((offsets[0], offsets[1], name))
    end = 0
    for start, stop, name in sorted(ranges):
        if start != end:
            raise corrupt(f"tensor {name!r} starts at byte {start} of the data, not {end}")
        end = stop
    if end != size - 8 - length:
        raise corrupt(f"its tensors hold {end} bytes but {size - 8 - length} follow the header")


def safetensors_header(path: Path, corrupt) -> tuple[dict, int, int]:
    """A safetensors file's header (a JSON object), its length and the file's size, in bytes; the tensors' data
    starts at byte 8 + length. `corrupt(why)` makes the exception raised for a malformed one.

    Raises:
        ModelDirError: the file cannot be read; what `corrupt` makes: the header is malformed.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
            (length,) = struct.unpack("<Q", head)
            if length > min(size - 8, MAX_HEADER_BYTES):
                raise corrupt(f"its header claims {length} bytes of a {size}-byte file")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise ModelDirError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise corrupt(f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    return header, length, size


def safetensors_shapes(directory: str | os.PathLike) -> dict[str, tuple[int, ...]] | None:
    """Every tensor's shape in a directory's safetensors weights (model.safetensors or an indexed set of shards,
    read from the headers alone: no tensor data, no torch), or in one safetensors file, by name; None when the
    weights are not safetensors.

    Raises:
        ModelDirError: a header that cannot be read.
    """
    path = Path(directory)
    if path.is_file():
        weights: Path | None = path
    else:
        weights = next((path / name for name in WEIGHT_FILES if (path / name).is_file()), None)
    if weights is None or "safetensors" not in weights.name:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for shard in _shards(weights):
        header, _, _ = safetensors_header(shard, lambda why, shard=shard: ModelDirError(f"{shard}: {why}"))
        shapes.update({name: tuple(info["shape"]) for name, info in header.items()
                       if name != "__metadata__" and isinstance(info, dict) and isinstance(info.get("shape"), list)})
    return shapes


def _shards(weights: Path) -> list[Path]:
    """The weight files to check: `weights` itself, or the files its index's weight_map names (all present)."""
    if not weights.name.endswith(".index.json"):
        return [weights]
    weight_map = read_json_object(weights).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise ModelDirError(f"{weights} has no weight_map of tensor names to files")
    shards = [weights.parent / name for name in sorted(set(weight_map.values()))]
    for shard in shards:
        if not shard.is_file():
            raise ModelDirError(f"{weights} names {shard.name}, which is missing")
    return shards


def _check_readable(path: Path) -> None:
    """A PyTorch checkpoint (.bin), readable: a zip archive (torch.save's format) or a legacy (pre-zip) torch.save
    file."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as exc:
        raise ModelDirError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):
        raise ModelDirError(f"{path} is not a PyTorch checkpoint (neither a zip archive nor a legacy torch.save file)")


def _index(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _first_line(exc: Exception) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
