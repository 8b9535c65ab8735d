"""Tier 4: `shardbridge demo` end to end, as a user runs it (a subprocess, its own gloo processes).

Each run trains, saves, reloads into another layout and into one process, and checks every
model and optimizer tensor bit-exact against the trained model and torch's dcp_to_torch_save;
the demo's exit code is 0 only if all of that held. These tests also check the summary text.
"""

import os
import re
import subprocess
import sys

import pytest

# Three runs (each ~10-30 s on 2 cores): the default, uneven sizes, and context parallel. README.md's
# other demo commands (HSDP x TP -> FSDP, TP only -> FSDP, uneven vocab 250) run as printed in the
# docs test, which checks their exit code (0 only if every bit-exact check passed). Every other
# layout pair is covered in-process by packages/core/tests/checkpoint (the same save/load code).
# CI runs context parallel; the default (its summary text) and the uneven case with
# SHARDBRIDGE_DEMO_ALL=1 (nox -s beyond_ci). In CI, README's first command (`bash tools/demo.sh`, the
# default layout, 30 steps) runs as printed in the docs test, exit code 0 only if every check passed;
# README's uneven demo and the in-process checkpoint tests of uneven fused layouts cover the uneven case.
ALL = os.environ.get("SHARDBRIDGE_DEMO_ALL") == "1"
LAYOUTS = {
    "dp_shard=2 x tp=2 -> dp_shard=4 (default)": [],
    "uneven vocab 250 and SwiGLU 200, dp_shard=2 x tp=2 -> dp_replicate=2 x tp=2": [
        "--vocab-size",
        "250",
        "--intermediate-size",
        "200",
        "--reload-dp-replicate",
        "2",
        "--reload-dp-shard",
        "1",
        "--reload-tp",
        "2",
    ],
    "context parallel dp_shard=2 x cp=2 -> cp=2 x tp=2": [
        "--cp", "2", "--dp-shard", "2", "--tp", "1", "--reload-cp", "2", "--reload-dp-shard", "1", "--reload-tp", "2",
    ],
}


def _demo(tmp_path, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "shardbridge.cli._main", "demo", "--out", str(tmp_path / "demo"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def _ci(name: str, args: list[str]) -> object:
    if (name.startswith("uneven") or not args) and not ALL:
        return pytest.param(args, id=name, marks=pytest.mark.skip(reason="CI slice: SHARDBRIDGE_DEMO_ALL=1 (nox -s beyond_ci)"))
    return pytest.param(args, id=name)


@pytest.mark.slow
@pytest.mark.parametrize("args", [_ci(name, args) for name, args in LAYOUTS.items()])
def test_demo_layouts_round_trip_bit_exact(tmp_path, args):
    steps = 4 if args else 12  # the default layout also shows the loss going down
    run = _demo(tmp_path, "--steps", str(steps), *args)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "all checks passed" in out
    assert len(re.findall(r"\[ok\]", out)) == 5 and "[FAIL]" not in out
    losses = [float(x) for line in re.findall(r"loss\[\s*\d+:\] (.*)", out) for x in line.split()]
    assert len(losses) == steps
    if steps == 12:
        assert losses[-1] < losses[0] - 0.1, losses
    for key in ("step time", "all-gathered per step", "checkpoint size", "save", "export safetensors"):
        assert key in out
    assert (tmp_path / "demo" / "hf" / "model.safetensors.index.json").is_file()


def test_demo_rejects_bad_flags_before_starting_processes(tmp_path):
    run = _demo(tmp_path, "--tp", "0")
    assert run.returncode == 2
    assert "--tp=0 must be >= 1" in run.stderr
    run = _demo(tmp_path, "--batch-size", "6", "--dp-shard", "4", "--tp", "1")
    assert run.returncode == 2
    assert "--batch-size=6 does not divide over dp_replicate*dp_shard=4" in run.stderr
    assert not (tmp_path / "demo").exists()
