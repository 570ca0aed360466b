#!/usr/bin/env bash
# ruff (lint and import order) on the whole tree, then mypy on the product packages as the installed `shuttle`.
# mypy reads module names from paths, and the repository keeps frontend/, scheduler/, ... at its root while the code
# imports them as shuttle.frontend, ...: so mypy checks a throw-away tree of links laid out as the wheel installs it.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-$REPO/.venv/bin/python}"
"$PY" -m ruff check --quiet .
TREE="$(mktemp -d)"
trap 'rm -rf "$TREE"' EXIT
mkdir "$TREE/shuttle"
ln -s "$REPO/shuttle/__init__.py" "$TREE/shuttle/__init__.py"
for package in common frontend scheduler worker launcher capacity batch_jobs offline; do
  ln -s "$REPO/$package" "$TREE/shuttle/$package"
done
cd "$TREE" && "$PY" -m mypy --config-file "$REPO/pyproject.toml" --cache-dir "$REPO/.mypy_cache" -p shuttle
