#!/usr/bin/env bash
# Set up .venv (with the hf and plot extras) and run the main job: `shardbridge demo` (4 gloo processes, train, checkpoint,
# reshard, export). Extra arguments go to `shardbridge demo` (see `shardbridge demo --help`).
# The demo writes ./shardbridge-demo in the directory it is started from.
set -euo pipefail
ROOT="$(cd -P "$(dirname "$0")/.." && pwd)"
bash "$ROOT/tools/setup.sh" hf,plot   # the extras README's commands after the demo need (from_pretrained, --png)
VENV="${VENV:-.venv}"
case "$VENV" in /*) ;; *) VENV="$ROOT/$VENV" ;; esac
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
unset PYTHONDONTWRITEBYTECODE  # setup.sh installs without byte-compiling: the first run writes the cache
exec "$VENV/bin/shardbridge" demo "$@"
