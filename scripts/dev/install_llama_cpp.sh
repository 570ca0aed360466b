#!/usr/bin/env bash
# Optional peer for scripts/dev/bench_compare.py --peers llama.cpp: installs llama-cpp-python (built from its source
# distribution, CPU only; about 10 minutes on 2 cores) and the `gguf` package its converter needs, into .venv.
# Never run by CI. The GGUF conversion uses convert_hf_to_gguf.py from the same source distribution (bench_compare
# unpacks it from pip's cache of the sdist when it converts a model).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || { echo "run scripts/install.sh first" >&2; exit 1; }
mkdir -p .venv/llama-cpp-src
.venv/bin/python -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d .venv/llama-cpp-src
CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" \
  .venv/bin/python -m pip install -q --no-deps .venv/llama-cpp-src/llama_cpp_python-0.3.36.tar.gz
.venv/bin/python -m pip install -q diskcache jinja2 gguf sentencepiece
tar -xzf .venv/llama-cpp-src/llama_cpp_python-0.3.36.tar.gz -C .venv/llama-cpp-src
echo "llama-cpp-python installed; converter: $(ls .venv/llama-cpp-src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py)"
