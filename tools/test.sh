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
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
