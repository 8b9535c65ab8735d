#!/usr/bin/env bash
# Set up .venv with every CPU-installable extra (megatron, hf, fp8, plot, test = "all", plus
# te-structural: what TE's Python code imports) and run the whole test suite (tiers 1-4, CPU only).
# The TE adapter's structural tier fetches TE's pure-Python wheel into a cache outside the repo on
# first use (see docs/te.md).
# Extra arguments go to pytest.
set -euo pipefail
cd -P "$(dirname "$0")/.."
bash tools/setup.sh all,te-structural
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# The suite starts hundreds of Python processes (gloo ranks, launches, the docs' commands): each
# compiles whatever it imports that has no bytecode cache. Images that set PYTHONDONTWRITEBYTECODE
# (many CI and container images do) make every process recompile shardbridge's own sources; the
# suite writes the cache (__pycache__/, ignored by git) instead.
unset PYTHONDONTWRITEBYTECODE
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
