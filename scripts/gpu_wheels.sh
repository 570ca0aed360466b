#!/usr/bin/env bash
# Fill .gpu_carry/ with what scripts/gpu_check.sh needs on a GPU machine that has no network: the wheels of the
# packages shuttle imports and that machine lacks (pyzmq, msgspec, openai and their dependencies, for Python 3.12
# on manylinux x86_64), the test model stories260K and the Llama 2 tokenizer (the 1B-shape bench model is built
# there, randomly initialised, with that tokenizer). The folder is ignored by git; the device tool carries it
# (`carry: [".gpu_carry"]`).
#
#     bash scripts/gpu_wheels.sh            # on a machine that reaches PyPI
#     bash scripts/gpu_wheels.sh --check    # only list what is in the folder
#
# The GPU machine already has (docs/gpu.md): Python 3.12, torch 2.11 (CUDA 13), triton 3.6, transformers 5.17,
# accelerate, safetensors, tokenizers, numpy, numba, scipy, tqdm, aiohttp, uvloop, prometheus-client, pytest. The
# whole dependency closure is downloaded; gpu_check.sh installs only the wheels whose distribution is missing there.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CARRY="${SHUTTLE_GPU_CARRY:-$REPO/.gpu_carry}"
WHEELS="$CARRY/wheels"
PYTHON="${PYTHON:-$REPO/.venv/bin/python}"
[ -x "$PYTHON" ] || PYTHON=python3
# Packages shuttle (or the check) imports that the GPU machine lacks. Their versions follow this checkout's venv
# where it has them, so the GPU machine runs what the tests here ran.
PACKAGES=(pyzmq msgspec openai)
# The test model and tokenizer, by the tests' rule (tests/server.py: $SHUTTLE_TEST_MODEL, else ../shared).
MODEL_DIR="${SHUTTLE_TEST_MODEL:-$REPO/../shared/models/stories260K}"
TOKENIZER_DIR="${SHUTTLE_TOKENIZER:-$REPO/../shared/tokenizers/llama2}"

list() {
    echo "$CARRY:"
    (cd "$CARRY" && find . -type f | sort | sed 's/^/  /')
    du -sh "$CARRY" | cut -f1 | sed 's/^/  total /'
}

if [ "${1:-}" = "--check" ]; then
    list
    exit 0
fi

pinned=()
for name in "${PACKAGES[@]}"; do
    version="$("$PYTHON" - "$name" <<'PY' 2>/dev/null || true
import importlib.metadata, sys
print(importlib.metadata.version(sys.argv[1]))
PY
)"
    pinned+=("$name${version:+==$version}")
done

rm -rf "$WHEELS"
mkdir -p "$WHEELS" "$CARRY/models" "$CARRY/tokenizers"
echo "downloading ${pinned[*]} and their dependencies (cp312, manylinux x86_64) into $WHEELS"
"$PYTHON" -m pip download --quiet --disable-pip-version-check --only-binary :all: --dest "$WHEELS" \
    --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    "${pinned[@]}"

for wanted in pyzmq msgspec openai; do
    compgen -G "$WHEELS/${wanted}-*.whl" >/dev/null || { echo "gpu_wheels: no wheel for $wanted" >&2; exit 1; }
done

rm -rf "$CARRY/models/stories260K" "$CARRY/tokenizers/llama2"
cp -r "$MODEL_DIR" "$CARRY/models/stories260K"
mkdir -p "$CARRY/tokenizers/llama2"
for f in tokenizer.json tokenizer_config.json special_tokens_map.json; do
    [ -f "$TOKENIZER_DIR/$f" ] && cp "$TOKENIZER_DIR/$f" "$CARRY/tokenizers/llama2/"
done
if [ ! -f "$CARRY/tokenizers/llama2/tokenizer.json" ]; then
    echo "gpu_wheels: no tokenizer.json in $TOKENIZER_DIR" >&2
    exit 1
fi
list
