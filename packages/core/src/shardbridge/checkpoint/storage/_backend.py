"""The storage seam: what a place checkpoints land in must do, and the view of one stored checkpoint.

[Note: storage backends]
~~~~~~~~~~~~~~~~~~~~~~~~
Everything above this module (DCP's ``StorageWriter`` / ``StorageReader`` in ``_writer.py`` /
``_reader.py``, integrity, the restricted metadata reader, export, inspect, ``latest``) reads and
writes through a :class:`Backend`, so a checkpoint keeps the same guarantees wherever it lands.
Two implementations::

    backend            paths                    temporary location     commit point
    local (_local.py)  /ckpt/step-00000100      .step-...tmp-<id>/      manifest written (fsync),
                                                (hidden, flocked)       then rename into place
    fsspec (_fsspec)   bucket/ckpt/step-...     <ckpt>/g-<id>/ (a new   the manifest object, written
                       (s3://, gs://, az://)    generation per save)    last, naming its generation

A backend offers four groups of operations: names (``join``, ``uri``), reads (``kind``,
``read_bytes``, ``read_into`` = a ranged read, ``stream`` = a range read in order as one
request, ``listing``, ``stat``, ``children``), writes
(``writing`` = a stream made durable when the block ends, ``write_bytes``, ``mkdirs``), and the
commit protocol run by rank 0 (``begin`` -> a :class:`Target` every rank writes into,
``commit``, ``abandon``; ``candidates`` and ``data_path`` for readers). Nothing here knows about
collectives or plans: which rank writes what, and in how many rounds, is the business of the
save protocol (``checkpoint/_protocol.py``), which drives DCP's storage API on top of this.

A committed checkpoint is read through a :class:`Stored`: the checkpoint's path (its manifest
lives there) and the path its files live under (``data``: the same directory on local disk,
the manifest's generation on an object store).
"""

from __future__ import annotations

import abc
import contextlib
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO, Literal

__all__ = ["SHARED_DIRECTORY_FIX", "Backend", "Entry", "Stored", "Target"]

Kind = Literal["missing", "file", "dir"]

SHARED_DIRECTORY_FIX = "use a directory every machine sees: a shared filesystem or an object store (s3://...)"
"""The fix a save names when its ranks do not see one directory ([Note: one directory for every rank])."""


@dataclass(frozen=True)
class Entry:
    """One file (or object) below a checkpoint."""

    size: int
    """Bytes."""
    regular: bool = True
    """A plain file or object (False: a symbolic link, a FIFO, ...: never read through)."""
    mtime: float = 0.0
    """Last modification (seconds since the epoch; 0 when unknown)."""


@dataclass(frozen=True)
class Target:
    """Where one save writes, from :meth:`Backend.begin` on rank 0 to every rank (picklable)."""

    final: str
    """The checkpoint path the save commits."""
    data: str
    """Where every rank writes its files: the temporary directory / the new generation."""
    ident: str
    """The save's id: the lock and temporary names (local), the generation (object stores)."""
    overwrite: bool = False
    """Whether the save may replace an existing checkpoint at ``final``."""
    expect: str | None = None
    """Object stores: the entity tag of the manifest this save replaces (None: there is none)."""
    replaces: str | None = None
    """Object stores: the generation of the checkpoint this save replaces (deleted after the commit)."""
    superseded: tuple[str, ...] = ()
    """Object stores: dead saves' generations of ``final`` kept because one may be committed (deleted after the commit)."""


class Backend(abc.ABC):
    """One kind of storage checkpoints land in. See [Note: storage backends]."""

    remote: bool = False
    """Reads cost a round trip (an object store): small reads are batched, ranged reads run
    on a few threads, and messages name objects by their full URI."""

    # -- names ---------------------------------------------------------------------------------

    def join(self, base: str, *names: str) -> str:
        """``base/name/...`` (POSIX separators on every backend)."""
        return posixpath.join(base, *names) if names else base

    @abc.abstractmethod
    def uri(self, path: str) -> str:
        """How ``path`` is shown to the user: a local path, or ``s3://bucket/key``."""

    # -- reads ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def kind(self, path: str) -> Kind:
        """"file", "dir" (a directory, or a prefix with objects below it) or "missing"."""

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """The whole file (FileNotFoundError if it is missing)."""

    @abc.abstractmethod
    def read_into(self, path: str, offset: int, out: memoryview) -> int:
        """Fill ``out`` from ``path`` at ``offset`` (one ranged read); bytes read (short at the end)."""

    @contextlib.contextmanager
    def stream(self, path: str, start: int, end: int) -> Iterator[Any]:
        """Bytes ``[start, end)`` of ``path``, read in order: a reader whose ``readinto`` fills what
        arrives (0 at the end). One request where the backend can stream (one GET on S3); here,
        ranged reads of ``STREAM_READ`` bytes. See [Note: reading records in one pass] in ``_read.py``."""
        yield _RangedReads(self, path, start, end)

    @abc.abstractmethod
    def listing(self, path: str) -> dict[str, Entry]:
        """Every file below ``path`` by relative POSIX name, links listed and not followed ({} if none)."""

    @abc.abstractmethod
    def stat(self, path: str) -> Entry | None:
        """The file at ``path`` (not following a link), or None if there is none."""

    @abc.abstractmethod
    def children(self, path: str) -> list[str]:
        """Names of the directories (prefixes) immediately below ``path``."""

    # -- writes (every rank) ---------------------------------------------------------------------

    @abc.abstractmethod
    @contextlib.contextmanager
    def writing(self, path: str) -> Iterator[BinaryIO]:
        """A binary stream to ``path``, durable once the block ends without an error."""

    def write_bytes(self, path: str, data: bytes) -> None:
        """Write a whole small file, durably."""
        with self.writing(path) as f:
            f.write(data)

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Delete the file at ``path`` (nothing if it is missing)."""

    def mkdirs(self, path: str) -> None:  # noqa: B027 (object stores have no directories)
        """Create the directory ``path`` below a target's data directory (no-op on object stores)."""

    def check_target(self, target: Target) -> None:  # noqa: B027
        """Raise FileNotFoundError when ``target`` is gone (rank 0 gave the save up)."""

    # -- the commit protocol (rank 0) ----------------------------------------------------------

    @abc.abstractmethod
    def begin(self, final: str, *, overwrite: bool) -> Target:
        """Recover after crashed saves, check ``final``, create the temporary location.

        Raises:
            ValueError: ``final`` exists without ``overwrite``, or is not a checkpoint that may
                be replaced.
        """

    @abc.abstractmethod
    def commit(self, target: Target, manifest: Any) -> None:
        """Make ``target`` the checkpoint at ``target.final``: the manifest is the commit point."""

    @abc.abstractmethod
    def abandon(self, target: Target) -> None:
        """After a failed save: delete what it wrote, unless it may be the only complete copy. Never raises."""

    # -- readers ------------------------------------------------------------------------------

    @abc.abstractmethod
    def candidates(self, root: str) -> list[str]:
        """Checkpoint paths under ``root`` holding a manifest (after restoring what a crash hid)."""

    def display_name(self, path: str) -> str:
        """The checkpoint name ``latest`` orders by (the last part of ``path``)."""
        return posixpath.basename(path.rstrip("/"))

    def data_path(self, path: str, generation: str | None) -> str:
        """Where the files of the checkpoint at ``path`` are (its manifest names the generation)."""
        return path if generation is None else self.join(path, generation)

    def is_leftover(self, name: str) -> bool:
        """Whether ``name`` (relative to a checkpoint's path) belongs to another save, not to the checkpoint."""
        return False

    @abc.abstractmethod
    def identity(self, path: str) -> Any:
        """Something that changes when a commit replaces the checkpoint at ``path`` (None if unknown)."""


STREAM_READ = 32 << 20
"""Bytes of one ranged read of a backend that cannot stream a range."""


class _RangedReads:
    """``Backend.stream`` by ranged reads: ``readinto`` reads at most ``STREAM_READ`` bytes at a time."""

    def __init__(self, backend: Backend, path: str, start: int, end: int) -> None:
        self._backend, self._path, self._pos, self._end = backend, path, start, end

    def readinto(self, out: Any) -> int:
        view = memoryview(out).cast("B")[: min(STREAM_READ, self._end - self._pos)]
        n = self._backend.read_into(self._path, self._pos, view) if len(view) else 0
        self._pos += n
        return n


@dataclass(frozen=True)
class Stored:
    """A committed checkpoint: where its manifest is (``path``) and where its files are (``data``)."""

    backend: Backend
    path: str
    """The checkpoint directory / prefix (the user's name for it)."""
    data: str
    """Where the files recorded in the manifest are."""

    def file(self, name: str) -> str:
        """Backend path of the recorded file ``name``."""
        return self.backend.join(self.data, name)

    @property
    def prefix(self) -> str:
        """``data`` relative to ``path`` plus "/" ("" when the files sit beside the manifest)."""
        return "" if self.data == self.path else posixpath.relpath(self.data, self.path) + "/"

    def where(self, name: str) -> str:
        """How a problem with ``name`` (relative to ``path``) names the file: the relative name on
        local disk, the full URI of the object on an object store."""
        return self.backend.uri(self.backend.join(self.path, name)) if self.backend.remote else name

    def show(self, name: str) -> str:
        """The full path / URI of the recorded file ``name`` (for messages)."""
        return self.backend.uri(self.file(name))

    def __str__(self) -> str:
        return self.backend.uri(self.path)
