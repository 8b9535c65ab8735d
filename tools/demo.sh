#!/usr/bin/env bash
# Set up .venv and run the main job: `shardbridge demo` (4 gloo processes, train, checkpoint,
# reshard, export). Extra arguments go to `shardbridge demo` (see `shardbridge demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "${VENV:-.venv}/bin/shardbridge" demo "$@"
