"""``verify``, and a load's verification split across its ranks ([Note: checkpoint integrity] in ``storage/_integrity.py``)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._integrity import FileProblem, VerifyReport, check_files, log_unverified
from shardbridge.checkpoint.storage._location import locate, open_checkpoint
from shardbridge.checkpoint.storage._manifest import DCP_METADATA_NAME, FILES_SINCE_VERSION, Manifest

__all__ = ["local_problems", "merge_problems", "verify"]


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> VerifyReport:
    """Check every file of a checkpoint against its manifest; no process group or model needed.

    Reports files that are missing, have another size, are not regular files, fail their
    xxh3_128 checksum (``checksums=True``, the default: reads every byte once), or are not
    recorded. A checkpoint of format 1 or 2 records no files: the report says so and is ``ok``.

    Args:
        path: a checkpoint directory, or its URI (``s3://bucket/ckpt/step-00000100``).
        checksums: compare checksums too (False: existence, sizes and extra files only).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is True when nothing is wrong.

    Raises:
        ValueError: ``path`` is not a shardbridge checkpoint or its manifest is damaged.

    Example:
        >>> report = verify(latest("/shared/ckpt"))  # doctest: +SKIP
        >>> report.ok, [str(p) for p in report.problems]  # doctest: +SKIP
        (False, ['__1_0.distcp: checksum mismatch (corrupted or from another checkpoint)'])
    """
    where = locate(path)
    start = time.perf_counter()
    # A missing .metadata is one more problem to report here (readers refuse it outright).
    stored, manifest = open_checkpoint(where, need_metadata=False)
    problems: list[FileProblem] = []
    if manifest.format_version >= FILES_SINCE_VERSION:
        problems = check_files(stored, manifest, checksums=checksums)
    elif stored.backend.kind(stored.file(DCP_METADATA_NAME)) != "file":
        problems = [FileProblem(DCP_METADATA_NAME, "missing (DCP's metadata; the checkpoint is damaged)")]
    return VerifyReport(
        path=where.user,
        format_version=manifest.format_version,
        checksums=checksums,
        num_files=len(manifest.files),
        num_bytes=sum(r["size"] for r in manifest.files.values()),
        seconds=time.perf_counter() - start,
        problems=tuple(problems),
    )


def _share(files: dict[str, dict[str, Any]], rank: int, world_size: int) -> list[str]:
    """The files ``rank`` hashes: largest first, each to the least loaded rank (same on every rank)."""
    load = [0] * world_size
    mine = []
    for name in sorted(files, key=lambda n: (-files[n]["size"], n)):
        target = min(range(world_size), key=lambda r: (load[r], r))
        load[target] += files[name]["size"]
        if target == rank:
            mine.append(name)
    return mine


def local_problems(
    stored: Stored, manifest: Manifest, *, checksums: bool, rank0: Callable[[], Any] | None = None
) -> tuple[list[FileProblem], Any]:
    """This rank's share of a load's verification: (its problems, ``rank0()`` on rank 0 or None).

    Rank 0 checks existence, sizes and extra files; checksums are split across the ranks.
    Formats 1 and 2 (no record) give [] after a one-time log line."""
    rank, world_size = _dist.rank(), _dist.world_size()
    if manifest.format_version < FILES_SINCE_VERSION:
        if rank == 0:
            log_unverified(stored, manifest.format_version)
        problems: list[FileProblem] = []
    else:
        mine = _share(manifest.files, rank, world_size) if checksums else []
        if rank == 0:
            problems = check_files(stored, manifest, checksums=mine, listing=True)
        else:
            # The other ranks stat and hash their share only: one rank walks the directory.
            subset = {n: manifest.files[n] for n in mine}
            problems = check_files(stored, dataclasses.replace(manifest, files=subset), listing=False)
    extra = None
    if rank0 is not None and rank == 0 and not problems:
        try:
            extra = rank0()
        except Exception:  # noqa: BLE001 (the caller redoes it where the error is raised on every rank)
            extra = None
    return problems, extra


def merge_problems(parts: list[list[FileProblem]]) -> list[FileProblem]:
    """Every rank's :func:`local_problems`, merged: the same sorted list on every rank."""
    merged: dict[tuple[str, str], FileProblem] = {}
    for part in parts:
        for problem in part:
            merged.setdefault((problem.name, problem.problem), problem)
    return sorted(merged.values(), key=lambda p: p.name)
