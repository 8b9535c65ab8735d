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
    if verb == "export" and message.startswith("no DCP .metadata"):
        message = ".metadata: missing (recorded in the manifest"  # export verifies the files first
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
    assert str(tmp_path / "file") in line and "is a file, not a folder; nothing was written" in line
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


def test_export_applies_what_the_saver_recorded(capsys, tmp_path):
    # [Note: export recorded in a checkpoint]: a name map and JSON files from the manifest's extra.
    import json

    recorded = {"name_map": {"weight": "lin.weight"}, "files": {"config.json": {"model_type": "toy", "n": 8}}}
    ck.save(tmp_path / "c", model=nn.Linear(8, 8), step=1, extra={"export": recorded})
    assert main(["ckpt", "export", str(tmp_path / "c"), str(tmp_path / "hf"), "--no-progress"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == ["bias", "lin.weight"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == {"model_type": "toy", "n": 8}


@pytest.mark.parametrize("name", ["../escape.json", "/tmp/abs.json", "sub/config.json", "config.py", ".hidden.json"])
def test_export_refuses_recorded_files_outside_the_folder(capsys, tmp_path, name):
    ck.save(tmp_path / "c", model=nn.Linear(8, 8), step=1, extra={"export": {"files": {name: {}}}})
    line = _error_line(capsys, ["ckpt", "export", str(tmp_path / "c"), str(tmp_path / "hf"), "--no-progress"])
    assert "extra['export'] is malformed" in line
    assert not (tmp_path / "hf").exists() and not (tmp_path / "escape.json").exists()


def _flip_byte(path):
    data = bytearray((path / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "__0_0.distcp").write_bytes(bytes(data))


def test_export_verifies_the_checkpoint(capsys, saved, tmp_path):
    """Before: another checkpoint's data file exported with exit 0. ``--no-verify`` skips the checksums only."""
    other = ck.save(tmp_path / "other", model=nn.Linear(8, 8), step=1)
    path = _damaged(saved, tmp_path, lambda p: shutil.copy(other / "__0_0.distcp", p / "__0_0.distcp"))
    assert (path / "__0_0.distcp").stat().st_size == (saved / "__0_0.distcp").stat().st_size
    line = _error_line(capsys, ["ckpt", "export", str(path), str(tmp_path / "hf"), "--no-progress"])
    assert "__0_0.distcp: checksum mismatch" in line and f"shardbridge ckpt verify {path}" in line
    assert not (tmp_path / "hf").exists()
    assert main(["ckpt", "export", str(path), str(tmp_path / "hf"), "--no-progress", "--no-verify"]) == 0


def test_export_names_a_damaged_metadata_file_as_load_does(capsys, saved, tmp_path):
    """A flipped byte in .metadata: the checksum names it (before, the unpickler's complaint did)."""

    def flip(p):
        data = bytearray((p / ".metadata").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (p / ".metadata").write_bytes(bytes(data))

    path = _damaged(saved, tmp_path, flip)
    line = _error_line(capsys, ["ckpt", "export", str(path), str(tmp_path / "hf"), "--no-progress"])
    assert ".metadata: checksum mismatch" in line and "not exporting it" in line, line


def test_export_of_a_root_takes_the_newest_checkpoint_that_verifies(capsys, tmp_path):
    import json

    model = nn.Linear(8, 8)
    ck.save(ck.step_dir(tmp_path / "root", 1), model=model, step=1)
    _flip_byte(ck.save(ck.step_dir(tmp_path / "root", 2), model=model, step=2))
    assert main(["ckpt", "export", str(tmp_path / "root"), str(tmp_path / "hf"), "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "skipping" in captured.err and "step-00000002" in captured.err and "checksum mismatch" in captured.err
    assert json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    _flip_byte(tmp_path / "root" / "step-00000001")
    assert main(["ckpt", "export", str(tmp_path / "root"), str(tmp_path / "hf2"), "--no-progress"]) == 2
    *skipped, line = capsys.readouterr().err.strip().splitlines()
    assert len(skipped) == 2 and all(s.startswith("shardbridge ckpt export: skipping ") for s in skipped)
    assert line.startswith("shardbridge ckpt export: error: every checkpoint under") and "step-00000002" in line
    assert "shardbridge ckpt verify" in line
    assert not (tmp_path / "hf2").exists()


def test_verbs_on_a_root_pass_over_a_manifest_nested_100000_deep(capsys, tmp_path):
    """Issue 42: the newest checkpoint's manifest nests JSON arrays 100,000 deep; every verb on the
    root raised RecursionError for the whole root. Now: inspect and export take the previous
    checkpoint, verify names the damaged one (exit 2) and still checks the others."""
    import json

    root = tmp_path / "root"
    model = nn.Linear(8, 8)
    ck.save(ck.step_dir(root, 1), model=model, step=1)
    ck.save(ck.step_dir(root, 2), model=model, step=2)
    newest = ck.step_dir(root, 2) / "shardbridge.json"
    newest.write_text("[" * 100_000 + "]" * 100_000)
    assert main(["ckpt", "inspect", str(root)]) == 0
    assert "step-00000001" in capsys.readouterr().out
    assert main(["ckpt", "export", str(root), str(tmp_path / "hf"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    capsys.readouterr()
    assert main(["ckpt", "verify", str(root)]) == 2
    captured = capsys.readouterr()
    assert f"{ck.step_dir(root, 1)}: 3 files, " in captured.out and ": ok" in captured.out
    assert f"{ck.step_dir(root, 2)}: shardbridge.json cannot be read" in captured.out
    (line,) = captured.err.strip().splitlines()
    assert line.startswith(f"shardbridge ckpt verify: error: checkpoint '{ck.step_dir(root, 2)}' is damaged"), line


def test_export_refuses_a_non_empty_out_dir_unless_overwrite(capsys, saved, tmp_path):
    """Before: a user's config.json, index and shards were replaced silently (old shards left)."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("mine")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"old")
    line = _error_line(capsys, ["ckpt", "export", str(saved), str(out), "--no-progress"])
    assert "is not empty" in line and "--overwrite" in line
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model-00001-of-00002.safetensors"]
    assert main(["ckpt", "export", str(saved), str(out), "--no-progress", "--overwrite"]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert (out / "config.json").read_text() == "mine"  # not the export's: untouched


def test_export_refuses_an_empty_out_dir_argument(capsys, saved, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = _error_line(capsys, ["ckpt", "export", str(saved), "", "--no-progress"])
    assert "is empty" in line
    assert list(tmp_path.iterdir()) == []


def test_output_into_a_closed_pipe_is_not_an_error(tmp_path):
    """``shardbridge ckpt inspect DIR | head -1``: no "Broken pipe" error once the reader stops."""
    import subprocess
    import sys

    path = ck.save(tmp_path / "c", model=nn.Sequential(*[nn.Linear(8, 8) for _ in range(2000)]))
    run = subprocess.run(
        f"{sys.executable} -m shardbridge.cli._main ckpt inspect {path} | head -1",
        shell=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.stdout.startswith("checkpoint ") and run.stderr == "", run.stderr


def test_version_is_one_line_with_the_package_and_torch_versions(capsys):
    import importlib.metadata

    import shardbridge
    import torch

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    assert out.startswith(f"shardbridge {shardbridge.__version__} (") and f"torch {torch.__version__}" in out, out
    # one source: the installed metadata says what shardbridge._version says
    assert importlib.metadata.version("shardbridge") == shardbridge.__version__
