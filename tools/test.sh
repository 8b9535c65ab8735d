#!/usr/bin/env bash
# Set up .venv with the test extra and run the whole test suite (tiers 1-4, CPU only).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh test
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${VENV:-.venv}/bin/python" -m pytest "$@"
