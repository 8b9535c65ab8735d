"""``shardbridge demo``: [Note: demo output] (nothing it did not create is deleted) and flag checks
that run before any process starts. In-process; integration_tests/test_demo.py runs the demo."""

from __future__ import annotations

import pytest
import shardbridge.testing
from shardbridge.cli import _demo
from shardbridge.cli._errors import describe
from shardbridge.cli._main import main


@pytest.fixture(autouse=True)
def no_processes(monkeypatch):
    """Every case here must be refused before a worker process starts."""

    def refuse(*args, **kwargs):
        raise AssertionError("a demo process was started")

    monkeypatch.setattr(shardbridge.testing, "WorkerPool", refuse)


def _error(capsys, *argv):
    assert main(["demo", *argv]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_out_dot_in_a_project_is_refused_and_nothing_is_deleted(capsys, tmp_path, monkeypatch):
    (tmp_path / "train.py").write_text("my work")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.bin").write_bytes(b"1")
    monkeypatch.chdir(tmp_path)
    line = _error(capsys, "--out", ".")
    assert f"--out {str(tmp_path)!r} is not empty and is not a previous shardbridge demo output" in line
    assert "nothing was deleted" in line
    assert (tmp_path / "train.py").read_text() == "my work" and (tmp_path / "data" / "x.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "train.py"]
    # --keep does not change that: the directory is still not the demo's.
    _error(capsys, "--out", ".", "--keep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "train.py"]


def test_a_previous_demo_output_loses_only_the_demo_files(tmp_path):
    out = tmp_path / "demo"
    _demo.prepare_out(out, keep=False)  # new: created and marked
    assert (out / _demo._MARKER).is_file()
    (out / "checkpoints" / "step-00000001").mkdir(parents=True)
    (out / "hf").mkdir()
    (out / "reference.pt").write_bytes(b"r")
    (out / "notes.txt").write_text("the user's")
    _demo.prepare_out(out, keep=True)
    assert (out / "checkpoints" / "step-00000001").exists() and (out / "reference.pt").exists()
    _demo.prepare_out(out, keep=False)
    assert sorted(p.name for p in out.iterdir()) == [_demo._MARKER, "notes.txt"]


def test_an_empty_directory_is_used(tmp_path):
    _demo.prepare_out(tmp_path, keep=False)
    assert [p.name for p in tmp_path.iterdir()] == [_demo._MARKER]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tp", "3", "--dp-shard", "1"], "--tp=3 does not divide the tiny model's num_kv_heads(4)"),
        (["--reload-tp", "3"], "--reload-tp=3 does not divide the tiny model's num_kv_heads(4)"),
        (["--intermediate-size", "100", "--tp", "8", "--dp-shard", "1"], "--tp=8 does not divide"),
        (["--reload-tp", "0"], "--reload-tp=0 must be >= 1"),
        (["--steps", "0"], "--steps=0 must be >= 1"),
        (["--batch-size", "-2"], "--batch-size=-2 must be >= 1"),
        (["--seq-len", "100"], "--seq-len=100 exceeds the tiny model's max_seq_len(64)"),
        (["--vocab-size", "0"], "--vocab-size=0 must be >= 1"),
        (["--intermediate-size", "-4"], "--intermediate-size=-4 must be >= 1"),
        (["--lr", "0"], "--lr=0.0 must be a finite number > 0"),
        (["--lr", "nan"], "--lr=nan must be a finite number > 0"),
        (["--collective-timeout", "0"], "--collective-timeout=0.0 must be a number of seconds > 0"),
        (["--batch-size", "6", "--dp-shard", "4", "--tp", "1"], "--batch-size=6 does not divide over"),
    ],
)
def test_bad_flags_are_refused_before_any_process_starts(capsys, tmp_path, argv, message):
    line = _error(capsys, "--out", str(tmp_path / "demo"), *argv)
    assert line.startswith("shardbridge demo: error: ") and message in line, line
    assert not (tmp_path / "demo").exists()


def test_png_is_checked_before_any_process_starts(capsys, tmp_path, monkeypatch):
    line = _error(capsys, "--out", str(tmp_path / "demo"), "--png", str(tmp_path / "no" / "x.png"))
    assert "--png" in line and "does not exist" in line, line
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # as if the plot extra were absent
    line = _error(capsys, "--out", str(tmp_path / "demo"), "--png", str(tmp_path / "x.png"))
    assert "--png needs matplotlib" in line and 'pip install -e ".[plot]"' in line, line
    assert not (tmp_path / "demo").exists()


def test_unwritable_out(capsys, tmp_path):
    (tmp_path / "file").write_text("mine")
    assert "is not writable (Not a directory)" in _error(capsys, "--out", str(tmp_path / "file" / "demo"))
    assert "is a file, not a folder; nothing was written" in _error(capsys, "--out", str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "mine"


def test_a_failed_worker_is_one_line():
    from shardbridge.testing import DistributedTestFailure

    text = (
        "_train_phase failed on 1 of 4 ranks; ranks [0, 1, 3] were still running 3 s after the first failure\n"
        '--- rank 2 ---\nTraceback (most recent call last):\n  File "x.py", line 1, in f\n    g()\n'
        "OSError: [Errno 28] No space left on device\n--- rank 3 ---\nValueError: other"
    )
    line = describe(DistributedTestFailure(text))
    assert line.startswith("_train_phase failed on 1 of 4 ranks")
    assert "rank 2: OSError: [Errno 28] No space left on device" in line and "other" not in line
