"""Every file of a checkpoint, its size and checksum: recorded at save, verified before use.

[Note: checkpoint integrity]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP itself checks nothing about the bytes it reads back: a flipped bit in tensor data, a
``.distcp`` truncated by a full disk, or one copied in from another step of the same run
(same size, same offsets) load wrong values silently. So the manifest (format 3) records
every file of the directory except itself::

    "files": {".metadata":         {"size": 1834, "xxh3_128": "9f0c..."},
              "__0_0.distcp":      {"size": 63213344, "xxh3_128": "41d2..."},
              "rng/rank-00000.pt": {"size": 1497, "xxh3_128": "c3a8..."}, ...}

and carries its own checksum (``manifest_xxh3_128``, see ``_manifest.py``).

Save: after DCP and the RNG files are written (and fsynced), each rank hashes the files it
wrote (``__{rank}_*.distcp``, DCP's FileSystemWriter naming; its RNG file), the records are
all-gathered, and rank 0 adds whatever else it finds in the directory (``.metadata``; any
file DCP names differently in a later torch). Rank 0 never re-reads other ranks' data, and a
shared filesystem whose directory listing lags (NFS attribute caching) cannot drop a file
from the record. The manifest is written after that, so it is the commit point.

Checks, cheapest first:

- existence, size and "no extra file": one ``stat`` per file plus one directory walk.
  :func:`latest` runs only these (it runs often, on every candidate it considers, and must
  not read a multi-GB checkpoint to choose one), so it skips truncated, missing and extra
  files but not a same-size flipped byte or foreign file.
- checksums (xxh3_128 of every byte): :func:`load` and :func:`load_latest` by default
  (``verify=True``), split across the loading ranks (largest files first to the least loaded
  rank); :func:`load_latest` falls back to the next older checkpoint when one fails. The
  files are about to be read by DCP anyway, so the first read warms the page cache; the
  cost is in docs/checkpoints.md (Reliability).

Formats 1 and 2 record no files: they load unverified, logged once per process.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._manifest import (
    CHECKSUM_KEY,
    DCP_METADATA_NAME,
    FILES_SINCE_VERSION,
    MANIFEST_NAME,
    Manifest,
    read_manifest,
    rng_file,
)

__all__ = [
    "FileProblem",
    "VerifyReport",
    "check_files",
    "damage_message",
    "file_checksum",
    "merge_records",
    "ChecksumWriter",
    "local_problems",
    "merge_problems",
    "own_files",
    "record_files",
    "verify",
    "verify_on_all_ranks",
]

logger = logging.getLogger("shardbridge.checkpoint")

_CHUNK = 1 << 20  # 1 MiB: 17 GB/s with a warm cache here (8 MiB: 19.6), and export's peak stays near one tensor
_warned_unverified = False


def file_checksum(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size, xxh3_128 hex digest)`` of the file at ``path``, read in 1 MiB chunks."""
    digest = xxhash.xxh3_128()
    buffer = bytearray(_CHUNK)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
            size += n
    return size, digest.hexdigest()


def _record(path: Path) -> dict[str, Any]:
    size, checksum = file_checksum(path)
    return {"size": size, CHECKSUM_KEY: checksum}


def _walk(checkpoint_dir: Path) -> dict[str, Path]:
    """Every entry below ``checkpoint_dir`` that is not a directory (files, links, ...), by relative
    POSIX name, except the manifest. Symbolic links to directories are listed, not followed."""
    found: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(checkpoint_dir, followlinks=False):
        here = Path(dirpath)
        links = [d for d in dirnames if (here / d).is_symlink()]
        for name in (*filenames, *links):
            path = here / name
            rel = path.relative_to(checkpoint_dir).as_posix()
            if rel != MANIFEST_NAME:
                found[rel] = path
    return found


def own_files(
    checkpoint_dir: Path, rank: int, known: dict[str, dict[str, Any]] | None = None
) -> dict[str, dict[str, Any]]:
    """Records of the files this rank wrote: its DCP data files and its RNG file.

    ``known``: records already computed while writing (:class:`ChecksumWriter`), by name.
    """
    known = known or {}
    names = [p.name for p in checkpoint_dir.glob(f"__{rank}_*.distcp")]
    names.append(rng_file(rank))
    return {name: known[name] if name in known else _record(checkpoint_dir / name) for name in sorted(names)}


class ChecksumWriter:
    """A binary file being written whose record (size, checksum) is computed on the way.

    Saves reading every data file back to hash it ([Note: checkpoint integrity]): each
    ``write`` also feeds the checksum. ``tell`` is the number of bytes written.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self._digest = xxhash.xxh3_128()
        self._size = 0

    def write(self, data: Any) -> int:
        """Write ``data`` (bytes-like) whole; its length."""
        view = memoryview(data).cast("B")
        written = 0
        while written < len(view):  # a raw file may write less than asked
            written += self._f.write(view[written:]) or 0
        self._digest.update(view)
        self._size += len(view)
        return len(view)

    def tell(self) -> int:
        """Bytes written so far."""
        return self._size

    def flush(self) -> None:
        """Flush the underlying file."""
        self._f.flush()

    def record(self) -> dict[str, Any]:
        """The file's record, as :func:`own_files` would compute it by reading it."""
        return {"size": self._size, CHECKSUM_KEY: self._digest.hexdigest()}


def _all_gather(obj: Any) -> list[Any]:
    return _dist.all_gather(obj)


def _add_unrecorded(checkpoint_dir: Path, files: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    for name, path in sorted(_walk(checkpoint_dir).items()):
        if name not in files:
            files[name] = _record(path)
    return dict(sorted(files.items()))


def record_files(checkpoint_dir: Path) -> dict[str, dict[str, Any]] | None:
    """Call on every rank after every file is written: the ``files`` record, on rank 0 (None elsewhere).

    See [Note: checkpoint integrity]. An unreadable file raises on every rank.
    """
    parts = _dist.one_round(own_files, (checkpoint_dir, _dist.rank()), result="all")
    return _dist.on_all_ranks(merge_records, checkpoint_dir, parts, only_rank0=True)


def merge_records(checkpoint_dir: Path, parts: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Rank 0: every rank's :func:`own_files` records, plus records of any file none claimed."""
    files: dict[str, dict[str, Any]] = {}
    for part in parts:
        files.update(part)
    return _add_unrecorded(checkpoint_dir, files)


@dataclass(frozen=True)
class FileProblem:
    """One file of a checkpoint that does not match its manifest."""

    name: str
    """Relative name inside the checkpoint, e.g. ``__1_0.distcp``."""
    problem: str
    """What is wrong, e.g. ``size 1234 != 5678 recorded (truncated?)``."""

    def __str__(self) -> str:
        return f"{self.name}: {self.problem}"


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What :func:`verify` found. ``ok`` is True when every recorded file matches.

    ``str(report)`` is what ``shardbridge ckpt verify`` prints.
    """

    path: Path
    """The checkpoint directory."""
    format_version: int
    """Its manifest's format version (< 3: no files recorded, nothing verified)."""
    checksums: bool
    """Whether checksums were compared (False: existence, sizes and extra files only)."""
    num_files: int
    """Files recorded in the manifest."""
    num_bytes: int
    """Bytes recorded in the manifest."""
    seconds: float
    """Time the check took."""
    problems: tuple[FileProblem, ...]
    """Every mismatch, in file-name order: missing, wrong size, not a regular file, checksum,
    not recorded."""

    @property
    def ok(self) -> bool:
        """True when nothing is wrong (also for formats 1 and 2, which record nothing)."""
        return not self.problems

    @property
    def verified(self) -> bool:
        """True when the manifest records files (format >= 3), i.e. there was something to check."""
        return self.format_version >= FILES_SINCE_VERSION

    def __str__(self) -> str:
        if not self.verified:
            return (
                f"{self.path}: format {self.format_version} records no file sizes or checksums; nothing "
                "verified (re-save it with this shardbridge to get verification)"
            )
        what = "sizes and xxh3_128 checksums" if self.checksums else "sizes (checksums skipped)"
        head = f"{self.path}: {self.num_files} files, {self.num_bytes} bytes, {what}, {self.seconds:.2f} s: "
        if self.ok:
            return head + "ok"
        return head + f"{len(self.problems)} problem(s)\n" + "\n".join(f"  {p}" for p in self.problems)


def _size_problem(actual: int, recorded: int) -> str:
    hint = "truncated?" if actual < recorded else "overwritten or appended to?"
    return f"size {actual} != {recorded} recorded ({hint})"


def check_files(
    checkpoint_dir: Path,
    manifest: Manifest,
    *,
    checksums: bool | Iterable[str] = True,
    listing: bool = True,
) -> list[FileProblem]:
    """Compare the directory with ``manifest.files``; the problems found (empty: all good).

    Args:
        checksums: True hashes every recorded file, False none, or the names to hash.
        listing: also report files that are not recorded (one directory walk).
    """
    recorded = manifest.files
    to_hash = set(recorded) if checksums is True else set() if checksums is False else set(checksums)
    problems: list[FileProblem] = []
    for name in sorted(recorded):
        want = recorded[name]
        path = checkpoint_dir / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            problems.append(FileProblem(name, f"missing (recorded in the manifest with {want['size']} bytes)"))
            continue
        except OSError as exc:
            problems.append(FileProblem(name, f"cannot be read ({type(exc).__name__}: {exc})"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(FileProblem(name, "not a regular file (a link or directory where a file was saved)"))
        elif st.st_size != want["size"]:
            problems.append(FileProblem(name, _size_problem(st.st_size, want["size"])))
        elif name in to_hash:
            try:
                size, checksum = file_checksum(path)
            except OSError as exc:
                problems.append(FileProblem(name, f"cannot be read ({type(exc).__name__}: {exc})"))
                continue
            if size != want["size"]:
                problems.append(FileProblem(name, _size_problem(size, want["size"])))
            elif checksum != want[CHECKSUM_KEY]:
                problems.append(FileProblem(name, "checksum mismatch (corrupted or from another checkpoint)"))
    if listing:
        for name in sorted(set(_walk(checkpoint_dir)) - set(recorded)):
            problems.append(
                FileProblem(name, "not recorded in the manifest (an extra file: copied in from elsewhere?)")
            )
    return problems


def _log_unverified(path: Path, version: int) -> None:
    global _warned_unverified
    if not _warned_unverified:
        _warned_unverified = True
        logger.warning(
            "shardbridge.checkpoint: %s has format_version %d, which records no file sizes or checksums: it "
            "is used without verification (logged once per process; re-save to get verification)",
            path,
            version,
        )


def verify(path: str | os.PathLike[str], *, checksums: bool = True) -> VerifyReport:
    """Check every file of a checkpoint against its manifest; no process group or model needed.

    Reports files that are missing, have another size, are not regular files, fail their
    xxh3_128 checksum (``checksums=True``, the default: reads every byte once), or are not
    recorded. A checkpoint of format 1 or 2 records no files: the report says so and is ``ok``.

    Args:
        path: a checkpoint directory.
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
    path = Path(path)
    start = time.perf_counter()
    manifest_path = path / MANIFEST_NAME
    if path.is_dir() and manifest_path.is_file() and not (path / DCP_METADATA_NAME).exists():
        # read_manifest refuses it; here a missing .metadata is one more problem to report
        text = manifest_path.read_text(encoding="utf-8", errors="replace")
        manifest = Manifest.from_json(text, str(manifest_path))
    else:
        manifest = read_manifest(path)
    problems: list[FileProblem] = []
    if manifest.format_version >= FILES_SINCE_VERSION:
        problems = check_files(path, manifest, checksums=checksums)
    return VerifyReport(
        path=path,
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


def verify_on_all_ranks(
    path: Path, manifest: Manifest, *, checksums: bool, rank0: Callable[[], Any] | None = None
) -> list[FileProblem] | tuple[list[FileProblem], Any]:
    """Call on every rank: the problems of ``path`` (the same list on every rank).

    Rank 0 checks existence, sizes and extra files; checksums are split across the ranks.
    Formats 1 and 2 (no record) return [] after a one-time log line. ``rank0``: also run
    this on rank 0 after its checks and return ``(problems, its result or None if it
    raised)``, the result shared in the same round (picklable). One round; a caller with a
    round of its own puts :func:`local_problems` into it and merges with :func:`merge_problems`.
    """
    gathered = _all_gather(local_problems(path, manifest, checksums=checksums, rank0=rank0))
    result = merge_problems([part for part, _ in gathered])
    return result if rank0 is None else (result, gathered[0][1])


def local_problems(
    path: Path, manifest: Manifest, *, checksums: bool, rank0: Callable[[], Any] | None = None
) -> tuple[list[FileProblem], Any]:
    """This rank's share of :func:`verify_on_all_ranks`: (its problems, ``rank0()`` on rank 0 or None)."""
    rank, world_size = _dist.rank(), _dist.world_size()
    if manifest.format_version < FILES_SINCE_VERSION:
        if rank == 0:
            _log_unverified(path, manifest.format_version)
        problems: list[FileProblem] = []
    else:
        mine = _share(manifest.files, rank, world_size) if checksums else []
        if rank == 0:
            problems = check_files(path, manifest, checksums=mine, listing=True)
        else:
            # The other ranks stat and hash their share only: one rank walks the directory.
            problems = check_files(path, dataclasses.replace(manifest, files=_subset(manifest, mine)), listing=False)
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


def _subset(manifest: Manifest, names: list[str]) -> dict[str, dict[str, Any]]:
    return {n: manifest.files[n] for n in names}


def damage_message(path: Path, problems: list[FileProblem]) -> str:
    """One line for an error: the first problem, how many more, and what to do."""
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return (
        f"checkpoint {str(path)!r} is damaged: {problems[0]}{more}; not loading it. "
        "load_latest(root) falls back to the newest intact checkpoint; "
        f"`shardbridge ckpt verify {path}` lists every problem"
    )
