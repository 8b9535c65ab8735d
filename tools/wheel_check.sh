#!/usr/bin/env bash
# What a user installs, checked: build the sdist and the wheel (the wheel from the sdist, as
# `pip install git+...` and `pip install .` do), install the WHEEL (not editable) into new virtual
# environments with torch pinned first, and from outside the source tree run the core tests that
# the install decides, a CLI smoke (`shardbridge --version`, `shardbridge layout`, a 1-step demo),
# then each adapter's import with its extra; and README's git URL route (with --no-deps). CI step 3 of .ci/run;
# docs/testing.md.
#
#   tools/wheel_check.sh            (uses .venv's python to build; WORK=DIR keeps the files there)
#   WORK=DIR tools/wheel_check.sh prepare     then     WORK=DIR tools/wheel_check.sh check
#       the same in two halves: "prepare" builds and installs (mostly waiting on pip and the disk:
#       .ci/run runs it in the background while the test suite runs), "check" runs the checks.
set -euo pipefail
PHASE="${1:-all}"
case "$PHASE" in all|prepare|check) ;; *) echo "usage: tools/wheel_check.sh [prepare|check]" >&2; exit 2 ;; esac
ROOT="$(cd -P "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
TORCH_SPEC="torch==${SHARDBRIDGE_TORCH:-2.13.0}"
if [ "$PHASE" = check ] && [ -z "${WORK:-}" ]; then
  echo "wheel_check.sh check: set WORK to the directory 'prepare' filled" >&2
  exit 2
fi
WORK="${WORK:-$(mktemp -d -t shardbridge-wheel.XXXXXX)}"
BUILD_PY="${BUILD_PY:-$ROOT/.venv/bin/python}"
t0=$SECONDS
step() { echo "== wheel_check: $1 ($((SECONDS - t0)) s so far)"; }
quiet_pip() { "$@" 2>&1 | grep -vE "^(WARNING: Location|Requirement already satisfied)" || true; }

if [ "$PHASE" != check ]; then
  step "build sdist + wheel (python -m build) into $WORK/dist"
  "$BUILD_PY" -m pip --disable-pip-version-check -q install "build>=1.2" 2>&1 | grep -v "^WARNING: Location" || true
  "$BUILD_PY" -m build --outdir "$WORK/dist" . > "$WORK/build.log" 2>&1 || { tail -n 40 "$WORK/build.log"; exit 1; }
  WHEEL=$(ls "$WORK"/dist/shardbridge-*.whl)
  SDIST=$(ls "$WORK"/dist/shardbridge-*.tar.gz)
  echo "  $(basename "$SDIST"), $(basename "$WHEEL")"

  step "the wheel holds every package of the source tree"
  "$BUILD_PY" - "$WHEEL" <<'PYEOF'
import pathlib, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
in_wheel = {str(pathlib.PurePosixPath(n).parent) for n in wheel.namelist() if n.endswith("/__init__.py")}
# packages/<folder>/src/<package path>/__init__.py -> <package path>
in_tree = {"/".join(p.parts[3:-1]) for p in pathlib.Path("packages").glob("*/src/**/__init__.py")}
missing = sorted(in_tree - in_wheel)
assert not missing, f"packages missing from the wheel: {missing}"
print(f"  {len(in_wheel)} packages, none missing")
PYEOF

  step "two clean venvs, $TORCH_SPEC first, then the wheel: venv (the test extra only), venv-all (hf,megatron,plot,test)"
  for v in venv venv-all; do python3 -m venv "$WORK/$v"; done
  quiet_pip "$WORK/venv/bin/python" -m pip --disable-pip-version-check -q install "$TORCH_SPEC"
  quiet_pip "$WORK/venv/bin/python" -m pip --disable-pip-version-check -q install "$TORCH_SPEC" "$WHEEL[test]"
  quiet_pip "$WORK/venv-all/bin/python" -m pip --disable-pip-version-check -q install "$TORCH_SPEC"
  quiet_pip "$WORK/venv-all/bin/python" -m pip --disable-pip-version-check -q install "$TORCH_SPEC" "$WHEEL[hf,megatron,plot,test]"
  # README, Install: the git URL route, in a venv whose pip is upgraded as README says (the pip
  # Python 3.11's venv bundles, 23.2.1, refuses "name @ git+file:///..."); --no-deps: the route, not
  # the dependencies (the venvs above install those). A checkout that is not a git repository skips it.
  if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then
    step "the git URL route of README (pip upgraded first): pip install \"shardbridge @ git+file://$ROOT\""
    python3 -m venv "$WORK/venv-git"
    quiet_pip "$WORK/venv-git/bin/python" -m pip -q install -U pip
    "$WORK/venv-git/bin/python" -m pip --disable-pip-version-check -q install --no-deps "shardbridge @ git+file://$ROOT" \
      2>&1 | grep -v "^WARNING: Location" || true
    "$WORK/venv-git/bin/python" -m pip show shardbridge > "$WORK/git-route.txt" 2>&1 || true
    grep -q "^Version: " "$WORK/git-route.txt" || { echo "the git URL route did not install"; exit 1; }
  fi
  touch "$WORK/prepared"
  if [ "$PHASE" = prepare ]; then
    step "prepared"
    exit 0
  fi
fi
if [ ! -f "$WORK/prepared" ]; then
  echo "wheel_check.sh check: $WORK was not prepared (run: WORK=$WORK tools/wheel_check.sh prepare)" >&2
  exit 1
fi

PY="$WORK/venv/bin/python"
cd "$WORK"  # outside the source tree from here on: nothing can import packages/*/src
step "core tests against the installed wheel (from $WORK)"
cat > "$WORK/run_core_tests.py" <<'PYEOF'
import os, sys


def main():
    import shardbridge
    here = os.path.dirname(shardbridge.__file__)
    assert here.startswith(sys.prefix) and "site-packages" in here, f"shardbridge imported from {here}, not the wheel"
    print(f"  shardbridge {shardbridge.__version__} from {here}")
    import pytest
    root = sys.argv[1]
    # What the install decides (what imports, extras, versions, entry points); the pure logic runs in the main suite.
    tests = [f"{root}/packages/core/tests/{t}" for t in (
        "test_import_isolation.py", "test_extras.py", "test_versions.py", "cli/test_cli_plugins.py",
    )]
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "--rootdir", root, *tests]))


# A file, not stdin: the gloo worker pool's processes re-import the main module by its path.
if __name__ == "__main__":
    main()
PYEOF
OMP_NUM_THREADS=1 "$PY" "$WORK/run_core_tests.py" "$ROOT"

step "CLI smoke: --version, layout, a 1-step demo"
"$WORK/venv/bin/shardbridge" --version | tee "$WORK/version.txt"
grep -q "site-packages" "$WORK/version.txt"
code=0
"$WORK/venv/bin/shardbridge" layout --shape 9,16 --mesh dp_shard=4,tp=2 --placements 'SS(0,2),S(0)' > "$WORK/layout.txt" || code=$?
[ "$code" -eq 1 ] || { cat "$WORK/layout.txt"; echo "layout: exit code $code, expected 1 (the DCP bug case)"; exit 1; }
tail -n 1 "$WORK/layout.txt"
OMP_NUM_THREADS=1 "$WORK/venv/bin/shardbridge" demo --steps 1 --out "$WORK/demo" > "$WORK/demo.txt" 2>&1 || { tail -n 40 "$WORK/demo.txt"; exit 1; }
grep "all checks passed" "$WORK/demo.txt"

step "each adapter with its extra: hf, megatron, plot (te needs CUDA: its import hint is checked)"
PY="$WORK/venv-all/bin/python"
"$PY" - <<'PYEOF'
import shardbridge_hf, shardbridge_megatron_fsdp, shardbridge_te
from shardbridge_hf import ShardbridgeAccelerator  # imports accelerate and transformers
from shardbridge_megatron_fsdp._compat import require_megatron_fsdp
require_megatron_fsdp()
try:
    shardbridge_te.te_version()
except ImportError as e:  # no TransformerEngine here: the hint must name a command that works
    assert '"transformer_engine[pytorch]' in str(e) and 'pip install -e ".[te]"' in str(e), e
print("  shardbridge_hf, shardbridge_megatron_fsdp, shardbridge_te import; te's hint names the packages")
PYEOF
"$WORK/venv-all/bin/shardbridge" launch --help | head -n 1
"$WORK/venv-all/bin/shardbridge" layout --shape 9,16 --mesh dp_shard=4,tp=2 --placements 'SS(0,2),S(0)' --png "$WORK/layout.png" > /dev/null || true
"$PY" -c "import matplotlib.image as m, sys; m.imread(sys.argv[1]); print('  layout --png wrote a PNG')" "$WORK/layout.png"

step "done"
