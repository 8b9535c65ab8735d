#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install shardbridge into it, saying what it installs.
#
#   tools/setup.sh [EXTRAS]        e.g. tools/setup.sh test   ->  pip install -e ".[test]"
#
# torch is installed FIRST and pinned (SHARDBRIDGE_TORCH, default 2.13.0): any package whose
# requirement admits a newer torch would otherwise pull a multi-GB CUDA build. VENV (default .venv,
# relative to the repository root) names the environment. pip's own output is filtered to one line
# per package it collects, downloads or installs; on a failure its last 40 lines are shown.
set -euo pipefail
cd -P "$(dirname "$0")/.."   # the repository root, also when called through a symlink
VENV="${VENV:-.venv}"
TORCH_SPEC="torch==${SHARDBRIDGE_TORCH:-2.13.0}"
EXTRAS="${1:-}"
t0=$SECONDS
say() { echo "tools/setup.sh: $*"; }

pip_install() {
  local log status
  log=$(mktemp)
  set +e
  "$VENV/bin/python" -m pip --disable-pip-version-check install "$@" 2>&1 | tee "$log" |
    awk '/^(Collecting|Downloading|Installing collected|Successfully installed|Building|Obtaining)/ { print "  " $0; fflush() }'
  status=${PIPESTATUS[0]}
  set -e
  if [ "$status" -ne 0 ]; then
    say "pip failed (exit code $status); its last lines:"
    tail -n 40 "$log"
  fi
  rm -f "$log"
  return "$status"
}

if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
say "installing $TORCH_SPEC into $VENV (first, so nothing pulls a CUDA build)"
pip_install "$TORCH_SPEC"
say "installing shardbridge (editable) ${EXTRAS:+with extras [$EXTRAS] }into $VENV"
pip_install "$TORCH_SPEC" -e ".${EXTRAS:+[$EXTRAS]}"
say "done in $((SECONDS - t0)) s: $("$VENV/bin/shardbridge" --version)"
