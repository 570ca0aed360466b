#!/usr/bin/env bash
# Optional peer for scripts/dev/bench_llama_server.py: builds llama.cpp's own HTTP server (llama-server, continuous
# batching) with cmake from the llama.cpp source that llama-cpp-python's source distribution ships, CPU only, for
# this machine's instruction set (GGML_NATIVE), and installs the `gguf` package (from the same tree) that its model converter needs.
# About 10-15 minutes on 2 cores; never run by CI. Prints the binary's path.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || { echo "run scripts/install.sh first" >&2; exit 1; }
VERSION=0.3.36
SRC=.venv/llama-cpp-src
mkdir -p "$SRC"
[ -f "$SRC/llama_cpp_python-$VERSION.tar.gz" ] || \
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
[ -d "$SRC/llama_cpp_python-$VERSION" ] || tar -xzf "$SRC/llama_cpp_python-$VERSION.tar.gz" -C "$SRC"
LLAMA="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"
# no network on a build box is normal: the web UI is neither fetched nor built (the benchmark uses the API only)
cmake -S "$LLAMA" -B "$SRC/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF > "$SRC/cmake.log"
cmake --build "$SRC/build" --target llama-server -j "$(nproc)" > "$SRC/build.log"
# the converter must meet the gguf package of its own source tree
.venv/bin/python -m pip install -q "$LLAMA/gguf-py" sentencepiece
echo "$(realpath "$SRC/build/bin/llama-server")"
