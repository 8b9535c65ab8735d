#!/usr/bin/env bash
# Create (or reuse) a virtual environment and install shardbridge into it, saying what it installs.
#
#   tools/setup.sh [EXTRAS]        e.g. tools/setup.sh test   ->  pip install -e ".[test]"
#
# torch is installed FIRST and pinned (SHARDBRIDGE_TORCH, default 2.13.0): any package whose
# requirement admits a newer torch would otherwise pull a multi-GB CUDA build. VENV (default .venv,
# relative to the repository root) names the environment. pip's own output is filtered to one line
# per package it collects, downloads or installs; on a failure its last 40 lines are shown.
# --no-compile: pip would byte-compile every module of every package (16k files, half of a 130 s
# install, measured); Python compiles what is imported on first use instead and caches it in
# __pycache__ (tools/test.sh unsets PYTHONDONTWRITEBYTECODE so that the cache is written).
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
  "$VENV/bin/python" -m pip --disable-pip-version-check install --no-compile "$@" 2>&1 | tee "$log" |
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

# An environment this script already set up with these extras (or more), for this pyproject.toml and
# torch, is left as it is: pip's own "already satisfied" pass rebuilds the editable wheel (20-60 s).
STAMP="$VENV/.shardbridge-setup"
KEY="$(cat pyproject.toml | sha256sum | cut -c1-16) $TORCH_SPEC"
if [ -x "$VENV/bin/shardbridge" ] && [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$KEY" ]; then
  have=",$(sed -n 2p "$STAMP"),"
  missing=""
  for extra in ${EXTRAS//,/ }; do
    case "$have" in *",$extra,"*) ;; *) missing="$missing $extra" ;; esac
  done
  if [ -z "$missing" ] && "$VENV/bin/python" -c "import shardbridge" 2>/dev/null; then
    say "$VENV is set up already (pyproject.toml and $TORCH_SPEC unchanged, extras [$(sed -n 2p "$STAMP")]); delete $STAMP to reinstall"
    exit 0
  fi
fi
if [ ! -x "$VENV/bin/python" ]; then
  say "creating the virtual environment $VENV"
  python3 -m venv "$VENV"
fi
say "installing $TORCH_SPEC into $VENV (first, so nothing pulls a CUDA build)"
pip_install "$TORCH_SPEC"
say "installing shardbridge (editable) ${EXTRAS:+with extras [$EXTRAS] }into $VENV"
pip_install "$TORCH_SPEC" -e ".${EXTRAS:+[$EXTRAS]}"
previous=""
if [ -f "$STAMP" ] && [ "$(head -n 1 "$STAMP")" = "$KEY" ]; then previous="$(sed -n 2p "$STAMP")"; fi
# the extras installed, with what "all" (or any extra naming shardbridge[...]) brings along
expanded="$("$VENV/bin/python" - "$previous,$EXTRAS" <<'PY'
import re, sys, tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
todo, seen = [e for e in sys.argv[1].split(",") if e], set()
while todo:
    name = todo.pop()
    if name not in seen:
        seen.add(name)
        for req in extras.get(name, []):
            m = re.match(r"shardbridge\[([^\]]+)\]", req.replace(" ", ""))
            todo += m.group(1).split(",") if m else []
print(",".join(sorted(seen)))
PY
)"
printf '%s\n%s\n' "$KEY" "$expanded" > "$STAMP"
say "done in $((SECONDS - t0)) s: $("$VENV/bin/shardbridge" --version)"
