#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install shardbridge into it.
#
#   tools/setup.sh [EXTRAS]        e.g. tools/setup.sh test   ->  pip install -e ".[test]"
#
# torch is installed FIRST and pinned (SHARDBRIDGE_TORCH, default 2.13.0): any package whose
# requirement admits a newer torch would otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${VENV:-.venv}"
TORCH_SPEC="torch==${SHARDBRIDGE_TORCH:-2.13.0}"
EXTRAS="${1:-}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
"${PIP[@]}" install "$TORCH_SPEC"
if [ -n "$EXTRAS" ]; then
  "${PIP[@]}" install "$TORCH_SPEC" -e ".[${EXTRAS}]"
else
  "${PIP[@]}" install "$TORCH_SPEC" -e .
fi
