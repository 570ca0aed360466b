#!/usr/bin/env bash
# Creates .venv in the repository and installs shuttle with its test extras, and the tracing and Ray extras, which the
# tests exercise.
# `bash scripts/install.sh --serve` installs what serving needs and no test tools: tracing's and Ray's extras, no
# browser (the container images in deploy/ run this).
# torch goes first and pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a CUDA build.
# (pyproject.toml accepts torch 2.11 to 2.13, so the GPU machine's 2.11 satisfies it too.)
set -euo pipefail
cd "$(dirname "$0")/.."
serve=false extras='test,tune,docs,lint,otel,ray'
if [ "${1:-}" = --serve ]; then
  serve=true extras='otel,ray'
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[$extras]"
# The dashboard's browser test drives Debian's chromium through playwright (no browser download); without it the test
# is skipped. Installed system-wide once, where this runs as root with apt (CI, the project's machines).
if ! $serve && ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver; } >/dev/null \
    || echo "install.sh: could not install chromium; tests/e2e/test_dashboard_browser.py will be skipped" >&2
fi
# Compile the CPU paged-attention kernel once now for both cache dtypes (numba caches it beside
# worker/decode_kernel.py; bfloat16 is `--dtype auto` on a CPU with bf16 units), so no worker pays the compilation
# (5-7 s each on two cores) at start-up.
.venv/bin/python -c "import torch; from shuttle.worker import decode_kernel; decode_kernel.warm_up(1, (torch.float32, torch.bfloat16))"
