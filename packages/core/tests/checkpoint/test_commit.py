"""Atomic commit and ``latest`` ([Note: atomic commit]): a half-written checkpoint is never taken."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from ckpt_helpers import LAYOUTS, Mlp, build, save_losing_a_file_of_rank_1
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage import _local as _commit
from shardbridge.checkpoint.storage._manifest import MANIFEST_NAME
from shardbridge.testing import run_distributed


def test_step_dir_names_and_validates():
    assert ck.step_dir("/r", 7).name == "step-00000007"
    with pytest.raises(ValueError, match="step=-1 must be an int >= 0"):
        ck.step_dir("/r", -1)


def test_latest_is_none_for_missing_or_empty_root(tmp_path):
    assert ck.latest(tmp_path / "missing") is None
    assert ck.latest(tmp_path) is None


def test_latest_picks_highest_step_and_skips_incomplete(tmp_path, caplog):
    for step in (2, 10, 9):
        ck.save(ck.step_dir(tmp_path, step), model=Mlp(), step=step)
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 10)

    # A crashed save leaves only a hidden temporary directory: never considered.
    shutil.copytree(ck.step_dir(tmp_path, 10), tmp_path / ".step-00000011.tmp-0123456789ab")
    # A truncated manifest (and one that is not JSON at all): skipped with a warning.
    shutil.copytree(ck.step_dir(tmp_path, 10), tmp_path / "step-00000012")
    manifest = tmp_path / "step-00000012" / MANIFEST_NAME
    manifest.write_text(manifest.read_text()[:40])
    # A directory without a manifest (someone else's): ignored.
    (tmp_path / "step-00000013").mkdir()
    with caplog.at_level("WARNING", logger="shardbridge.checkpoint"):
        assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 10)
    assert "step-00000012" in caplog.text and "not valid JSON" in caplog.text

    with pytest.raises(ValueError, match="is not valid JSON.*did not finish.*latest"):
        ck.load(tmp_path / "step-00000012", model=Mlp())


def nest(manifest, depth: int = 100_000) -> None:
    """Issue 42: a manifest of JSON arrays nested ``depth`` deep (Python's json raises RecursionError)."""
    manifest.write_text("[" * depth + "]" * depth)


def test_latest_skips_a_manifest_that_cannot_be_read_but_raises_what_the_store_raises(tmp_path, caplog, monkeypatch):
    """[Note: one damaged checkpoint]: before, the nested manifest's RecursionError ended latest()
    (and load_latest, ckpt verify / export ROOT) for the whole root."""
    for step in (1, 2):
        ck.save(ck.step_dir(tmp_path, step), model=Mlp(), step=step)
    nest(ck.step_dir(tmp_path, 2) / MANIFEST_NAME)
    with caplog.at_level("WARNING", logger="shardbridge.checkpoint"):
        assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 1)
    assert "skipping" in caplog.text and "step-00000002" in caplog.text
    # An error of the store (here: reading a manifest is refused) is not a damaged checkpoint:
    # skipping it would silently resume from an older step, or from scratch.
    real = _commit.LocalBackend.read_bytes

    def refused(self, path):
        if path.endswith(MANIFEST_NAME):
            raise PermissionError(13, "Permission denied", path)
        return real(self, path)

    monkeypatch.setattr(_commit.LocalBackend, "read_bytes", refused)
    with pytest.raises(PermissionError, match="Permission denied"):
        ck.latest(tmp_path)


@pytest.mark.parametrize(
    ("error", "store"),
    [
        (PermissionError(13, "Forbidden"), True),
        (OSError(5, "EndpointConnectionError: Could not connect"), True),
        (TimeoutError("read timeout"), True),
        (type("NoCredentialsError", (Exception,), {})("Unable to locate credentials"), True),  # a client's own
        (ImportError("no s3fs"), True),
        (FileNotFoundError(2, "gone meanwhile"), False),
        (RecursionError("maximum recursion depth exceeded while decoding a JSON array"), False),
        (ValueError("not valid JSON"), False),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), False),
        (KeyError("format"), False),
        (TypeError("list indices must be integers"), False),
        (MemoryError(), False),
    ],
)
def test_which_errors_concern_the_store_and_which_one_checkpoint(error, store):
    from shardbridge.checkpoint.storage._catalog import about_the_store

    assert about_the_store(error) is store


def test_a_manifest_nested_100000_deep_costs_one_checkpoint_not_the_root(tmp_path, caplog):
    # [Note: bounded structure] (issue 42): before, RecursionError for the whole root.
    ck.save(ck.step_dir(tmp_path, 1), model=Mlp(), step=1)
    shutil.copytree(ck.step_dir(tmp_path, 1), tmp_path / "step-00000002")
    manifest = tmp_path / "step-00000002" / MANIFEST_NAME
    manifest.write_text(manifest.read_text().replace('"extra": {}', '"extra": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}"))
    with caplog.at_level("WARNING", logger="shardbridge.checkpoint"):
        assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 1)
    assert "nests arrays and objects 100002 deep, more than the 64" in caplog.text
    assert ck.load_latest(tmp_path, model=Mlp()).step == 1
    for read in (ck.inspect, ck.verify):
        with pytest.raises(ValueError, match=r"shardbridge\.json nests arrays and objects 100002 deep"):
            read(tmp_path / "step-00000002")


def test_the_commit_makes_every_directory_of_the_checkpoint_durable_before_the_manifest(tmp_path, monkeypatch):
    """A file's fsync does not make its NAME durable: its directory's fsync does. The RNG files sit in
    rng/, whose names must be durable before the manifest says the checkpoint is complete."""
    order = []
    from shardbridge.checkpoint.storage import _manifest

    for module in (_commit, _manifest):  # the commit's own, and the manifest's write
        monkeypatch.setattr(module, "fsync_dir", lambda path: order.append(os.path.relpath(path, tmp_path)))
    real = _commit.commit

    def commit(tmp, final, manifest, *, overwrite):
        order.append("commit")
        return real(tmp, final, manifest, overwrite=overwrite)

    monkeypatch.setattr(_commit, "commit", commit)
    ck.save(tmp_path / "c", model=Mlp())
    tmp = next(p for p in order if p.startswith(".c.tmp-") and "/" not in p)  # the manifest's directory
    subdirs = sorted(e.name for e in os.scandir(tmp_path / "c") if e.is_dir())
    assert subdirs == ["rng"], subdirs
    # every subdirectory's names fsynced after the last file landed (commit runs then), before the manifest
    assert order[order.index("commit") + 1 :] == [f"{tmp}/rng", tmp, "."], order  # rng/, the manifest's rename, <root>


def test_existing_checkpoint_needs_overwrite(tmp_path):
    path = ck.step_dir(tmp_path, 1)
    ck.save(path, model=Mlp(), step=1)
    with pytest.raises(ValueError, match="already exists; pass overwrite=True"):
        ck.save(path, model=Mlp(), step=1)
    ck.save(path, model=Mlp(), step=2, overwrite=True)
    assert ck.inspect(path).step == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no .tmp / .old left behind


def test_overwrite_refuses_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="refusing to overwrite.*not a shardbridge checkpoint"):
        ck.save(tmp_path / "data", model=Mlp(), overwrite=True)
    assert (tmp_path / "data" / "keep.txt").exists()


def test_stale_temporary_directories_are_deleted_by_the_next_save(tmp_path):
    stale = tmp_path / ".step-00000005.tmp-0123456789ab"
    fresh = tmp_path / ".step-00000006.tmp-ba9876543210"
    stale.mkdir()
    fresh.mkdir()
    old = _commit._RUN_START - 3600
    os.utime(stale, (old, old))
    ck.save(ck.step_dir(tmp_path, 7), model=Mlp())
    assert not stale.exists()
    assert fresh.exists()  # newer than this run: may belong to a save in progress


def _interrupted(root: str):
    """Save step 1, then crash step 2 between writing and renaming (commit raises)."""
    model, opt = build(LAYOUTS["fsdp2_tp2"])
    ck.save(ck.step_dir(root, 1), model=model, optimizer=opt, step=1)
    real = _commit.commit

    def crash(*args, **kwargs):
        raise OSError("simulated crash before rename")

    _commit.commit = crash
    try:
        ck.save(ck.step_dir(root, 2), model=model, optimizer=opt, step=2)
        outcome = "saved"
    except Exception as exc:  # noqa: BLE001
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        _commit.commit = real
    dist.barrier()
    return outcome, str(ck.latest(root)), sorted(os.listdir(root))


def test_interrupted_save_leaves_latest_at_previous_checkpoint(tmp_path):
    results = run_distributed(_interrupted, str(tmp_path), world_size=4)
    for outcome, latest, listing in results:
        assert "simulated crash before rename" in outcome  # every rank raises: no hang
        assert latest == str(ck.step_dir(tmp_path, 1))
        assert listing == ["step-00000001"]  # the temporary directory was removed


_DIE_BEFORE_RENAME = """
import os, sys, torch
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.storage import _local
_local.commit = lambda *args, **kwargs: os._exit(3)  # the process dies before the rename
ck.save(ck.step_dir(sys.argv[1], 2), model=torch.nn.Linear(3, 3), step=2)
"""


def test_process_death_before_rename_is_never_taken(tmp_path):
    ck.save(ck.step_dir(tmp_path, 1), model=torch.nn.Linear(3, 3), step=1)
    proc = subprocess.run([sys.executable, "-c", _DIE_BEFORE_RENAME, str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.startswith(".step-00000002.tmp-")]
    assert len(leftovers) == 1  # DCP files written, never renamed
    assert (tmp_path / leftovers[0] / ".metadata").exists()
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 1)


# -- [Note: one directory for every rank] -----------------------------------------------------------


@pytest.mark.parametrize("protocol, how", [("derived", "missing"), ("dcp", "short")])
def test_a_file_rank_0_does_not_see_is_refused_by_name_and_nothing_is_committed(tmp_path, protocol, how):
    results = run_distributed(save_losing_a_file_of_rank_1, {}, str(tmp_path), protocol, how, world_size=2)
    host = results[0][1]
    seen = "is missing" if how == "missing" else r"has \d+ bytes, not the \d+ written"
    for outcome, _, latest, listing in results:  # every rank raises the same error: no hang, no commit
        assert re.search(
            rf"^ValueError: save of checkpoint '{re.escape(str(tmp_path))}/step-00000001' refused: '__1_0.distcp', written by "
            rf"rank 1 \(host '{re.escape(host)}'\) into '.*\.step-00000001\.tmp-[0-9a-f]{{12}}', {seen} where rank 0 "
            rf"\(host '{re.escape(host)}'\) looks: the ranks do not see the same directory .* Nothing was committed; "
            r"use a directory every machine sees: a shared filesystem or an object store \(s3://\.\.\.\)",
            outcome,
        ), outcome
        assert latest is None and listing == []  # no manifest, no temporary directory, no lock left


def test_a_rank_that_does_not_see_the_temporary_directory_is_refused_by_name(tmp_path, monkeypatch):
    """A machine that does not see rank 0's directory at all (node-local disk, another working
    directory): ValueError; one that sees the parent but not the directory: FileNotFoundError
    naming both causes. The writer adds its rank."""
    from shardbridge.checkpoint.storage._backend import Target
    from shardbridge.checkpoint.storage._local import LOCAL
    from shardbridge.checkpoint.storage._writer import Writer
    from torch.distributed.checkpoint.planner import SavePlan

    monkeypatch.chdir(tmp_path)
    target = Target(final="ckpt/step-00000001", data="ckpt/.step-00000001.tmp-0123456789ab", ident="0123456789ab")
    writer = Writer(LOCAL, target, checkpoint_id="ckpt/step-00000001")
    writer.set_up_storage_writer(False, rank=3)
    with pytest.raises(ValueError) as not_shared:
        writer.write_data(SavePlan([]), None)
    assert str(not_shared.value) == (
        "save of checkpoint 'ckpt/step-00000001' failed on rank 3: rank 0 created the save's temporary directory "
        f"'ckpt/.step-00000001.tmp-0123456789ab', but 'ckpt' does not exist on host {socket.gethostname()!r} (it is "
        f"{str(tmp_path / 'ckpt')!r} here): the machines do not see the same directory (a node-local disk, or a "
        "relative path under different working directories?). Nothing was committed; use a directory every machine "
        "sees: a shared filesystem or an object store (s3://...)"
    )
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(FileNotFoundError, match=r"failed on rank 3: the save's temporary directory .* does not exist "
                       r"on host .*: rank 0 gave the save up \(see its error\), or this machine does not see the "
                       r"directory rank 0 created it in \(a node-local disk\?\); if so, use a directory every machine "
                       r"sees"):  # fmt: skip
        writer.write_data(SavePlan([]), None)
    assert sorted(os.listdir(tmp_path / "ckpt")) == []  # a rank never creates rank 0's directory
