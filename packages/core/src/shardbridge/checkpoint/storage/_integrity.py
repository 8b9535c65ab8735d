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

Save: every file is hashed while it is written (``ChecksumWriter``: each rank's ``.distcp``
file(s) and RNG file, rank 0's ``.metadata``); the records travel to rank 0 with DCP's write
results ([Note: the storage writer] in ``_writer.py``). On local disk rank 0 adds whatever else
it finds in the directory (read and hashed; nothing shardbridge writes), so a shared filesystem
whose directory listing lags (NFS attribute caching) cannot drop a file from the record. On an
object store rank 0 lists the save's generation instead and refuses to commit unless every
recorded object is there with its size and nothing else is ([Note: object-store commit] in
``_fsspec.py``). The manifest is written after that, so it is the commit point.

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

import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from shardbridge.checkpoint.storage._backend import Backend, Entry, Stored
from shardbridge.checkpoint.storage._manifest import (
    CHECKSUM_KEY,
    FILES_SINCE_VERSION,
    MANIFEST_NAME,
    Manifest,
)
from shardbridge.checkpoint.storage._store import ObjectStoreError

__all__ = [
    "ChecksumWriter",
    "FileProblem",
    "VerifyReport",
    "check_files",
    "checksum",
    "damage_message",
    "file_checksum",
    "log_unverified",
    "merge_records",
]

logger = logging.getLogger("shardbridge.checkpoint")

_CHUNK = 1 << 20  # 1 MiB: 17 GB/s with a warm cache here (8 MiB: 19.6), and export's peak stays near one tensor
_REMOTE_CHUNK = 16 << 20  # one ranged GET per 16 MiB of an object
_warned_unverified = False


def file_checksum(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size, xxh3_128 hex digest)`` of the local file at ``path``, read in 1 MiB chunks."""
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


def checksum(backend: Backend, path: str, size: int | None = None) -> tuple[int, str]:
    """``(size, xxh3_128 hex digest)`` of the file or object at ``path`` (ranged reads on object stores).

    ``size``: the object's size if known (a listing), else one HEAD finds it.
    """
    if not backend.remote:
        return file_checksum(path)
    if size is None:
        entry = backend.stat(path)
        if entry is None:
            raise FileNotFoundError(path)
        size = entry.size
    total, size = size, 0
    digest = xxhash.xxh3_128()
    view = memoryview(bytearray(min(_REMOTE_CHUNK, total)))
    while size < total:
        n = backend.read_into(path, size, view[: min(len(view), total - size)])
        if not n:
            break
        digest.update(view[:n])
        size += n
    return size, digest.hexdigest()


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
        """The file's record, as :func:`checksum` would compute it by reading it."""
        return {"size": self._size, CHECKSUM_KEY: self._digest.hexdigest()}


def merge_records(
    backend: Backend,
    data: str,
    records: dict[str, dict[str, Any]],
    *,
    listing: dict[str, Entry] | None = None,
) -> dict[str, dict[str, Any]]:
    """Rank 0 at the commit: the manifest's file records, from ``records`` (every rank's, of the files it wrote).

    On local disk, plus records of any file in ``data`` none claimed (read and hashed), found in
    ``listing`` (a listing of ``data`` taken after every rank wrote; None: listed here). On an
    object store the listing must match the records exactly: the commit checks it
    ([Note: object-store commit] in ``_fsspec.py``).
    """
    files = dict(records)
    if not backend.remote:
        for name in sorted(backend.listing(data) if listing is None else listing):
            if name not in files and name != MANIFEST_NAME:
                size, digest = checksum(backend, backend.join(data, name))
                files[name] = {"size": size, CHECKSUM_KEY: digest}
    return dict(sorted(files.items()))


@dataclass(frozen=True)
class FileProblem:
    """One file of a checkpoint that does not match its manifest."""

    name: str
    """Name relative to the checkpoint, e.g. ``__1_0.distcp`` (on an object store with the save's
    generation first: ``g-0123456789abcdef/__1_0.distcp``)."""
    problem: str
    """What is wrong, e.g. ``size 1234 != 5678 recorded (truncated?)``."""

    def __str__(self) -> str:
        return f"{self.name}: {self.problem}"


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """What :func:`verify` found. ``ok`` is True when every recorded file matches.

    ``str(report)`` is what ``shardbridge ckpt verify`` prints.
    """

    path: Path | str
    """The checkpoint directory (a ``str`` URI for a checkpoint given as one)."""
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

    def describe(self, problem: FileProblem) -> str:
        """``name: problem``; on an object store the name is the object's full URI."""
        if isinstance(self.path, str) and "://" in self.path and not self.path.startswith("file://"):
            return f"{self.path.rstrip('/')}/{problem.name}: {problem.problem}"
        return str(problem)

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
        return head + f"{len(self.problems)} problem(s)\n" + "\n".join(f"  {self.describe(p)}" for p in self.problems)


def _size_problem(actual: int, recorded: int) -> str:
    hint = "truncated?" if actual < recorded else "overwritten or appended to?"
    return f"size {actual} != {recorded} recorded ({hint})"


def files_below(stored: Stored) -> dict[str, Entry]:
    """Every file of a checkpoint but its manifest, by name relative to the checkpoint.

    On an object store the whole checkpoint prefix is listed (one LIST): objects of other
    generations and their lock objects are the leftovers of other saves ([Note: object-store
    commit]), not part of this checkpoint; anything else is.
    """
    backend = stored.backend
    found = backend.listing(stored.path)
    found.pop(MANIFEST_NAME, None)
    if stored.prefix:
        found = {n: e for n, e in found.items() if n.startswith(stored.prefix) or not backend.is_leftover(n)}
    return found


def check_files(
    stored: Stored,
    manifest: Manifest,
    *,
    checksums: bool | Iterable[str] = True,
    listing: bool = True,
) -> list[FileProblem]:
    """Compare the checkpoint with ``manifest.files``; the problems found (empty: all good).

    Args:
        checksums: True hashes every recorded file, False none, or the (recorded) names to hash.
        listing: also report files that are not recorded (one directory walk / LIST); False
            looks at the recorded files one by one.
    """
    backend, prefix = stored.backend, stored.prefix
    recorded = manifest.files
    to_hash = set(recorded) if checksums is True else set() if checksums is False else set(checksums)
    problems: list[FileProblem] = []
    try:
        entries = files_below(stored) if listing else None
    except ObjectStoreError:  # the store failed, not the checkpoint: never reported as damage
        raise
    except OSError as exc:
        return [FileProblem(prefix or ".", f"cannot be listed ({type(exc).__name__}: {exc})")]
    for name in sorted(recorded):
        want = recorded[name]
        shown = prefix + name
        try:
            entry = entries.get(shown) if entries is not None else None
            if entry is None:  # no listing, or not listed as a file (a directory where a file was saved)
                entry = backend.stat(stored.file(name))
        except ObjectStoreError:
            raise
        except OSError as exc:
            problems.append(FileProblem(shown, f"cannot be read ({type(exc).__name__}: {exc})"))
            continue
        if entry is None:
            problems.append(FileProblem(shown, f"missing (recorded in the manifest with {want['size']} bytes)"))
        elif not entry.regular:
            problems.append(FileProblem(shown, "not a regular file (a link or directory where a file was saved)"))
        elif entry.size != want["size"]:
            problems.append(FileProblem(shown, _size_problem(entry.size, want["size"])))
        elif name in to_hash:
            try:
                size, digest = checksum(backend, stored.file(name), entry.size)
            except ObjectStoreError:
                raise
            except OSError as exc:
                problems.append(FileProblem(shown, f"cannot be read ({type(exc).__name__}: {exc})"))
                continue
            if size != want["size"]:
                problems.append(FileProblem(shown, _size_problem(size, want["size"])))
            elif digest != want[CHECKSUM_KEY]:
                problems.append(FileProblem(shown, "checksum mismatch (corrupted or from another checkpoint)"))
    if entries is not None:
        for name in sorted(set(entries) - {prefix + n for n in recorded}):
            problems.append(
                FileProblem(name, "not recorded in the manifest (an extra file: copied in from elsewhere?)")
            )
    return problems


def log_unverified(path: Any, version: int) -> None:
    global _warned_unverified
    if not _warned_unverified:
        _warned_unverified = True
        logger.warning(
            "shardbridge.checkpoint: %s has format_version %d, which records no file sizes or checksums: it "
            "is used without verification (logged once per process; re-save to get verification)",
            path,
            version,
        )


def describe_problem(stored: Stored, problem: FileProblem) -> str:
    """``name: problem``, the name as :meth:`Stored.where` shows it (the object's URI on an object store)."""
    return f"{stored.where(problem.name)}: {problem.problem}"


def damage_message(stored: Stored, problems: list[FileProblem], *, doing: str = "loading") -> str:
    """One line for an error: the first problem, how many more, and what to do."""
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    hint = "load_latest(root) falls back to the newest intact checkpoint; " if doing == "loading" else ""
    return (
        f"checkpoint {str(stored)!r} is damaged: {describe_problem(stored, problems[0])}{more}; not {doing} it. "
        f"{hint}`shardbridge ckpt verify {stored}` lists every problem"
    )
