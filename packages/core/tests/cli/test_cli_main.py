"""[Note: CLI errors]: every bad input, damaged checkpoint or unwritable output is one line and exit 2.

In-process calls of ``main([...])`` (milliseconds each); integration_tests/test_cli.py runs
one real subprocess per verb.
"""

from __future__ import annotations

import errno
import os
import shutil
import traceback

import pytest
from shardbridge import checkpoint as ck
from shardbridge.cli import _main
from shardbridge.cli._main import main
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException


def _error_line(capsys, argv, code=2):
    assert main(argv) == code
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    ck.save(root / "c", model=nn.Linear(8, 8), step=1)
    return root / "c"


def _damaged(saved, tmp_path, damage):
    path = tmp_path / "c"
    shutil.copytree(saved, path)
    damage(path)
    return path


LAYOUT = ["layout", "--shape", "9,16", "--mesh", "dp_shard=4,tp=2", "--placements", "SS(0,2),S(0)"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (LAYOUT[:-1] + ["S(9),S(0)"], "shards dim 9 of a 2-d tensor"),
        (LAYOUT[:3] + ["--mesh", "dp_shard=0,tp=2"] + LAYOUT[5:], "bad mesh token 'dp_shard=0'"),
        (LAYOUT + ["--dim", "5"], "dim=5 is not a dim of (9, 16)"),
        (LAYOUT[:-1] + ["SS(0,0)"], "split factor must be >= 1"),
        (["layout", "--shape", "", "--mesh", "dp_shard=4", "--placements", "S(0)"], "is not a list of non-negative"),
    ],
    ids=["placement-dim", "mesh-size", "draw-dim", "split-factor", "empty-shape"],
)
def test_layout_bad_input(capsys, argv, message):
    line = _error_line(capsys, argv)
    assert line.startswith("shardbridge layout: error: ") and message in line


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / ".metadata").write_bytes(b"garbage"), ".metadata"),
        (lambda p: (p / ".metadata").unlink(), "no DCP .metadata; the checkpoint is damaged"),
        (lambda p: (p / "shardbridge.json").write_text("{garbage"), "shardbridge.json is not valid JSON"),
        (lambda p: (p / "shardbridge.json").write_text('{"format": 3}'), "is not a shardbridge checkpoint manifest"),
        (lambda p: os.truncate(p / "__0_0.distcp", 100), "__0_0.distcp"),
        (lambda p: shutil.rmtree(p), "neither a shardbridge checkpoint nor a folder"),
    ],
    ids=["garbage-metadata", "missing-metadata", "garbage-manifest", "foreign-manifest", "truncated-data", "no-dir"],
)
@pytest.mark.parametrize("verb", ["inspect", "export"])
def test_damaged_checkpoint_is_one_line(capsys, saved, tmp_path, damage, message, verb):
    path = _damaged(saved, tmp_path, damage)
    argv = ["ckpt", verb, str(path)] + ([str(tmp_path / "hf"), "--no-progress"] if verb == "export" else [])
    if verb == "inspect" and "distcp" in message:
        assert main(argv) == 0  # inspect reads the metadata only: the data file's damage shows on export/verify
        return
    line = _error_line(capsys, argv)
    assert line.startswith(f"shardbridge ckpt {verb}: error: ") and message in line


def test_damaged_data_suggests_verify(capsys, saved, tmp_path):
    path = _damaged(saved, tmp_path, lambda p: os.truncate(p / "__0_0.distcp", 100))
    line = _error_line(capsys, ["ckpt", "export", str(path), str(tmp_path / "hf"), "--no-progress"])
    assert "shardbridge ckpt verify" in line


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dtype", "int8"], "dtype=torch.int8 is not a floating dtype"),
        (["--dtype", "nonsense"], "--dtype 'nonsense' is not a torch dtype"),
        (["--max-shard-size", "lots"], "max_shard_size='lots' is not a size"),
    ],
)
def test_export_bad_flags(capsys, saved, tmp_path, extra, message):
    line = _error_line(capsys, ["ckpt", "export", str(saved), str(tmp_path / "hf"), "--no-progress", *extra])
    assert message in line
    assert not (tmp_path / "hf").exists()


def test_export_to_an_unwritable_place(capsys, saved, tmp_path):
    (tmp_path / "file").write_text("mine")
    line = _error_line(capsys, ["ckpt", "export", str(saved), str(tmp_path / "file" / "hf"), "--no-progress"])
    assert "a path component is a file, not a directory" in line
    line = _error_line(capsys, ["ckpt", "export", str(saved), str(tmp_path / "file"), "--no-progress"])
    assert "already exists" in line
    assert (tmp_path / "file").read_text() == "mine"


def test_permission_denied(capsys, saved, monkeypatch):
    # Root reads every file, so the refusal is simulated where the reader opens the checkpoint.
    def refuse(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(saved / "shardbridge.json"))

    monkeypatch.setattr(ck, "inspect", refuse)
    line = _error_line(capsys, ["ckpt", "inspect", str(saved)])
    assert "permission denied: " in line and "shardbridge.json" in line


def test_no_space_left(capsys, saved, tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "hf" / "model.safetensors"))

    monkeypatch.setattr(ck, "export_safetensors", full)
    line = _error_line(capsys, ["ckpt", "export", str(saved), str(tmp_path / "hf")])
    assert "no space left writing" in line and "model.safetensors" in line


def test_checkpoint_exception_is_one_line(capsys, saved, monkeypatch):
    def dcp_failure(path):
        cause = RuntimeError("PytorchStreamReader failed reading zip archive\nmore lines")
        raise CheckpointException("ranks:[0]", {0: (cause, traceback.extract_stack())})

    monkeypatch.setattr(ck, "inspect", dcp_failure)
    line = _error_line(capsys, ["ckpt", "inspect", str(saved)])
    assert "failed on rank 0" in line and "shardbridge ckpt verify" in line


def test_unexpected_error_is_one_line_and_debug_shows_the_traceback(capsys, monkeypatch):
    def boom(args):
        raise RuntimeError("something odd\nsecond line")

    monkeypatch.setattr(_main, "_run_layout", boom)
    line = _error_line(capsys, LAYOUT)
    assert line == (
        "shardbridge layout: error: RuntimeError: something odd (unexpected; rerun with --debug for the traceback "
        "and report it)"
    )
    for argv in (["--debug", *LAYOUT], [*LAYOUT, "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and err.strip().splitlines()[-1] == line


def test_launch_without_the_hf_adapter_or_with_a_bad_file(capsys, tmp_path):
    pytest.importorskip("accelerate")
    (tmp_path / "empty.yaml").write_text("")
    line = _error_line(capsys, ["launch", "--config_file", str(tmp_path / "empty.yaml"), "train.py"])
    assert "is empty or not a mapping" in line


def test_one_line_caps_long_messages():
    from shardbridge.cli._errors import one_line

    assert one_line("a\n\n  b  \nc") == "a b c"
    assert len(one_line("x" * 5000)) == 600
