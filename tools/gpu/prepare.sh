#!/usr/bin/env bash
# GPU tier, CPU machine: download the pinned files of tools/gpu/pins.json for CPython 3.12 /
# manylinux x86_64 into tools/gpu/cache/ (git-ignored), check every sha256, split the 276 MB TE
# core wheel into parts < 60 MiB and lay out one folder per `run` call: tools/gpu/cache/callN/.
# Idempotent: files already downloaded with the pinned sha256 are not fetched again.
#
#   tools/gpu/prepare.sh           download + verify + split (needs network, ~290 MB)
#   tools/gpu/prepare.sh --check   validate pins.json and the call plan only (no network; CI)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
if [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ]; then PY=.venv/bin/python; fi
if [ "${1:-}" = "--check" ]; then
  exec "$PY" tools/gpu/run_stages.py plan --dry-run
fi
df -h "$(pwd)" | tail -1
exec "$PY" tools/gpu/run_stages.py prepare
