"""Atomic checkpoint directories: write to a hidden temporary name, then rename.

[Note: atomic commit]
~~~~~~~~~~~~~~~~~~~~~
::

    <root>/.step-00000100.tmp-<id>/    1. rank 0 creates it; every rank writes DCP files and
                                          its RNG file into it (DCP fsyncs each file)
                                       2. barrier
                                       3. rank 0 writes shardbridge.json (tmp file, fsync,
                                          rename), fsyncs the directory, renames it to
    <root>/step-00000100/                 the final name (atomic on POSIX), fsyncs <root>
                                       4. rank 0 tells every rank the outcome

A process that dies before step 3 leaves only a hidden ``.tmp-`` directory, which
:func:`latest` never considers; a manifest is only ever seen complete (written via rename),
and :func:`latest` also skips a directory whose manifest does not parse. With
``overwrite=True`` an existing final directory is first renamed to ``.<name>.old-<id>`` and
deleted after the commit; a crash between the two renames leaves no final directory, so
``latest`` falls back to the previous step.

Stale temporary directories (``.<name>.tmp-*`` / ``.<name>.old-*`` in the same parent, last
modified before this process imported shardbridge.checkpoint) are left by runs that crashed;
rank 0 deletes them at the start of each save. One training job per checkpoint root: a second
job saving into the same root concurrently may have its temporary directory deleted.

Multi-node: every rank writes into the same directory and rank 0 renames it, so the path
must be on a filesystem all nodes share (NFS, Lustre, GPFS ...), with POSIX rename semantics.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from shardbridge.checkpoint._manifest import MANIFEST_NAME, Manifest, fsync_dir, read_manifest

__all__ = ["commit", "latest", "new_tmp_dir", "step_dir"]

logger = logging.getLogger("shardbridge.checkpoint")

_RUN_START = time.time()
"""Temporary directories last modified before this are stale (see [Note: atomic commit])."""
_STALE = re.compile(r"^\..+\.(tmp|old)-[0-9a-f]{12}$")
_STEP_DIR = "step-{step:08d}"


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The conventional checkpoint directory for ``step``: ``<root>/step-00000100``.

    Example:
        >>> str(step_dir("/ckpt", 100))
        '/ckpt/step-00000100'
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be an int >= 0")
    return Path(root) / _STEP_DIR.format(step=step)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def new_tmp_dir(final: Path, *, overwrite: bool) -> Path:
    """Rank 0: check ``final``, delete stale temporaries, create and return the temporary dir.

    Raises:
        ValueError: ``final`` exists and ``overwrite`` is False, or it is not a checkpoint
            directory that may be replaced.
    """
    if final.exists():
        if not overwrite and not _is_empty_dir(final):
            raise ValueError(
                f"checkpoint directory {str(final)!r} already exists; pass overwrite=True to replace it, "
                "or save to a new path (e.g. step_dir(root, step))"
            )
        if not final.is_dir():
            raise ValueError(f"{str(final)!r} exists and is a file; pass a directory path")
        if not _is_empty_dir(final) and not (final / MANIFEST_NAME).exists():
            raise ValueError(
                f"refusing to overwrite {str(final)!r}: it is not a shardbridge checkpoint (no {MANIFEST_NAME}); "
                "delete it yourself or choose another path"
            )
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    _delete_stale(parent)
    tmp = parent / f".{final.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def _delete_stale(parent: Path) -> None:
    for child in parent.iterdir():
        if not _STALE.match(child.name) or not child.is_dir():
            continue
        try:
            if child.stat().st_mtime < _RUN_START:
                logger.warning("shardbridge.checkpoint: deleting %s, left by an interrupted save", child)
                shutil.rmtree(child, ignore_errors=True)
        except OSError:
            pass  # another process removed it


def commit(tmp: Path, final: Path, manifest: Manifest, *, overwrite: bool) -> None:
    """Rank 0: write the manifest, then rename ``tmp`` to ``final`` durably.

    See [Note: atomic commit]. Every rank must have finished writing into ``tmp``.
    """
    from shardbridge.checkpoint._manifest import write_manifest

    write_manifest(tmp, manifest)
    fsync_dir(tmp)
    old = None
    if final.exists():
        if _is_empty_dir(final):
            final.rmdir()
        else:
            assert overwrite, "new_tmp_dir checked overwrite"
            old = final.parent / f".{final.name}.old-{tmp.name[-12:]}"
            os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint directory under ``root``, or None.

    Considers the immediate subdirectories of ``root`` whose name does not start with "."
    and whose ``shardbridge.json`` is complete and valid; picks the highest recorded step
    (directories saved with ``step=None`` count as -1), then the greatest name. Damaged
    directories are skipped with a warning. See [Note: atomic commit].

    Example:
        >>> latest("/no/such/root") is None
        True
    """
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[int, str] | None = None
    best_path: Path | None = None
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        if not (child / MANIFEST_NAME).exists():
            continue
        try:
            manifest = read_manifest(child)
        except ValueError as exc:
            logger.warning("shardbridge.checkpoint: skipping %s: %s", child, exc)
            continue
        key = (manifest.step if manifest.step is not None else -1, child.name)
        if best is None or key > best:
            best, best_path = key, child
    return best_path
