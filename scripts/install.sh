#!/usr/bin/env bash
# Creates .venv in the repository and installs shuttle with its test extras.
# torch goes first and pinned: 2.13.0 is the CPU build on this machine's disk; an unpinned torch pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e '.[test,tune]'
# Compile the CPU paged-attention kernel once now (numba caches it beside worker/decode_kernel.py), so no worker
# pays the compilation at start-up.
.venv/bin/python -c "from worker import decode_kernel; decode_kernel.warm_up(1)"
