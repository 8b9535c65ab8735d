"""``verify``, and a load's verification split across its ranks ([Note: checkpoint integrity] in ``storage/_integrity.py``)."""

from __future__ import annotations

import heapq
import os
import re
import time
from collections.abc import Callable
from typing import Any

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._integrity import FileProblem, VerifyReport, check_files, log_unverified
from shardbridge.checkpoint.storage._location import locate, open_checkpoint
from shardbridge.checkpoint.storage._manifest import DCP_METADATA_NAME, FILES_SINCE_VERSION, Manifest

_DATA_FILE = re.compile(r"__(\d+)_\d+\.distcp")

__all__ = ["hash_share", "local_problems", "merge_problems", "verify"]


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


def hash_share(files: dict[str, dict[str, Any]], rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """The files ``rank`` hashes while a load reads them ([Note: verifying while reading] in
    ``storage/_reader.py``): a data file ``__<w>_<n>.distcp`` rank ``w % world_size`` (in the
    same layout it reads all of it anyway); every other file the least loaded rank, largest
    first, ties to the lowest. The same on every rank.

    Every rank computes the whole assignment, so it must not grow with files x world (16,384
    ranks x 32,768 files: 44 s per rank by a pass over every rank per file): a heap holds the
    ranks loaded so far, and the ranks with no load are taken in rank order. O(files log files),
    whatever the world size."""
    load: dict[int, int] = {}
    owner: dict[str, int] = {}
    for name, record in files.items():
        match = _DATA_FILE.fullmatch(name)
        if match is not None:
            owner[name] = int(match.group(1)) % world_size
            load[owner[name]] = load.get(owner[name], 0) + record["size"]
    loaded = [(size, r) for r, size in load.items()]  # (load, rank) of every rank loaded so far
    heapq.heapify(loaded)
    fresh = 0  # the lowest rank with no load yet
    for name in sorted((n for n in files if n not in owner), key=lambda n: (-files[n]["size"], n)):
        while fresh in load:
            fresh += 1
        if fresh < world_size and (not loaded or (0, fresh) < loaded[0]):
            size, target = 0, fresh
            load[fresh] = 0
        else:
            size, target = heapq.heappop(loaded)
        heapq.heappush(loaded, (size + files[name]["size"], target))
        owner[name] = target
    return {name: files[name] for name in sorted(files) if owner[name] == rank}


def local_problems(
    stored: Stored, manifest: Manifest, rank0: Callable[[], Any] | None = None
) -> tuple[list[FileProblem], Any]:
    """A load's checks before it reads: (this rank's problems, ``rank0()`` on rank 0 or None).

    Rank 0 checks existence, sizes and extra files (one directory walk / LIST); checksums are
    compared while the files are read ([Note: verifying while reading] in ``storage/_reader.py``).
    Formats 1 and 2 (no record) give [] after a one-time log line."""
    problems: list[FileProblem] = []
    if _dist.rank() == 0:
        if manifest.format_version < FILES_SINCE_VERSION:
            log_unverified(stored, manifest.format_version)
        else:
            problems = check_files(stored, manifest, checksums=False, listing=True)
    extra = None
    if rank0 is not None and _dist.rank() == 0 and not problems:
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
