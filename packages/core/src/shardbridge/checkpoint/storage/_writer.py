"""DCP's ``StorageWriter`` on a backend: data files, the RNG file, ``.metadata``, records, the commit.

[Note: the storage writer]
~~~~~~~~~~~~~~~~~~~~~~~~~~
:class:`Writer` is what DCP's save protocol drives (``dcp.save``, or the derived protocol:
[Note: save protocols] in ``checkpoint/_protocol.py``): ``prepare_global_plan`` names each rank's
files as DCP's ``FileSystemWriter`` does (``__<rank>_<n>.distcp``), ``write_data`` writes this
rank's files into the save's target (the temporary directory, or the generation on an object
store) and ``finish`` (rank 0, after every rank wrote) writes ``.metadata`` and commits. What it
adds to DCP's writer:

- every file's record (size, xxh3-128) is computed while it is written (no read-back), and
  travels to rank 0 inside DCP's own write results (one extra ``WriteResult`` per rank under
  ``RECORDS_KEY``, a :class:`RankFiles` naming the rank and its host, which ``finish`` takes out
  before ``.metadata`` is built): no round of its own;
- on a filesystem, ``finish`` first checks that rank 0 sees every file every rank wrote, with
  the size written ([Note: one directory for every rank]);
- each rank also writes its RNG file (the bytes it is given) into the target;
- ``finish`` commits through the backend ([Note: atomic commit], [Note: object-store commit])
  right after ``.metadata``: the manifest is written last, after every rank's files are durable;
- the data file writer ([Note: the data file writer]).

[Note: the data file writer]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each rank's ``__<rank>_<n>.distcp`` is what DCP's ``FileSystemWriter`` writes: the plan's items
(bytes items first, then tensors, each in the order the plan hands them: the derived protocol
hands the entries held by more ranks first, [Note: derived file layout]), each tensor one ``torch.save`` record (a
zip archive: the tensor's pickle and its raw bytes), each bytes item its bytes; every offset and
length goes into ``.metadata``. With ``threads`` > 1 the items are split into that many files by
size, written concurrently (DCP's ``thread_count``): on an object store, that many uploads in
flight per rank. Two things differ from DCP's writer, both measured (docs/benchmarks.md):

- the records' zip CRC32 fields are left at 0 (``torch_save_without_crc``): the manifest's
  xxh3-128 of every file covers every byte already, and torch.load (DCP's reader,
  ``dcp_to_torch_save``) does not check the CRC32;
- every byte written also feeds the file's checksum (``ChecksumWriter``), instead of a second
  pass reading the file back.

DCP's writer copies a CUDA tensor to the host ahead of writing it on a side stream; this writer
copies it when it writes it. An asynchronous save stages to host memory first, so it is
unaffected; a synchronous save from GPU memory waits for each copy.

[Note: one directory for every rank]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every rank writes into the save's temporary directory and rank 0 commits it, so on a filesystem
the checkpoint path must name ONE directory that every machine sees: a node-local disk (``/tmp``,
``/scratch`` on many clusters), or a relative path under working directories that differ per
machine, gives each machine its own. Committing then would publish a checkpoint missing the
other machines' files. Two checks refuse it, by name, with nothing committed:

- at the start of each rank's write (``Backend.check_target``): the temporary directory rank 0
  created is not there. When its parent is missing too, this machine does not see rank 0's
  directory at all (rank 0 created the parent and never deletes it): a ValueError. Otherwise it
  is that, or rank 0 gave the save up (a timeout): a FileNotFoundError saying both;
- in ``finish`` on rank 0, before ``.metadata`` and the manifest: every file of every rank's
  :class:`RankFiles` must be in rank 0's listing of the directory with the size written (one
  listing, which the commit reuses for the files no rank claimed; a file missing from it is
  looked up by name before it counts as missing, since a cached directory listing, as on NFS,
  may lag another machine's writes). The first that is not is a ValueError naming it, its rank
  and host, the directory, and the fix.

Both run inside rounds the save runs anyway (the write round's gather of write results, whose
failure every rank raises: [Note: save protocols] in ``checkpoint/_protocol.py``): no
collective of their own, and the same for both protocols. An object store is one namespace for
every machine; its commit lists the generation and refuses a missing or short object anyway
([Note: object-store commit] in ``_fsspec.py``), so ``finish`` does not list it again.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from shardbridge._compat import DCPStorageInfo, DCPStoragePrefix, torch_save_without_crc
from shardbridge.checkpoint.storage._backend import SHARED_DIRECTORY_FIX, Backend, Entry, Target
from shardbridge.checkpoint.storage._files import _SUFFIX, split_items
from shardbridge.checkpoint.storage._integrity import ChecksumWriter
from shardbridge.checkpoint.storage._manifest import DCP_METADATA_NAME
from shardbridge.checkpoint.storage._metadata_stream import StorageGroup, write_metadata

__all__ = ["RECORDS_KEY", "DCP_VERSION", "RankFiles", "Writer"]

RECORDS_KEY = "__shardbridge_file_records__"
"""``fqn`` of the one extra ``WriteResult`` per rank that carries its files' records to ``finish``."""
DCP_VERSION = "1.0.0"
"""``Metadata.version`` as DCP's ``FileSystemWriter`` writes it (``filesystem.CURRENT_DCP_VERSION``, 2.11-2.14)."""


@dataclass(frozen=True)
class RankFiles:
    """What one rank wrote in a save: its files' records, and who wrote them (for messages)."""

    rank: int
    host: str
    """The writing process's host name."""
    files: dict[str, dict[str, Any]]
    """File name (relative to the target) -> its record (``size``, checksum)."""


class Writer(StorageWriter):
    """DCP's storage writer for one save into ``target``. See [Note: the storage writer].

    Args:
        backend: where the files land.
        target: the save's target (from ``backend.begin`` on rank 0).
        checkpoint_id: the checkpoint the save commits (recorded in ``.metadata``).
        files: small files this rank writes beside its data, name -> bytes (its RNG file).
        commit: rank 0, called by ``finish`` with every file's record once ``.metadata`` is written.
        threads: at most this many data files per rank, written concurrently (DCP's ``thread_count``),
            one per ``min_file_bytes`` of this rank's tensors (a small rank writes one file).
        min_file_bytes: the least bytes of tensors that get a data file of their own.
        save_failure: turns an error of this rank's writes into the error to raise (naming the file).
    """

    def __init__(
        self,
        backend: Backend,
        target: Target,
        *,
        checkpoint_id: str,
        files: dict[str, bytes] | None = None,
        commit: Callable[[dict[str, dict[str, Any]], dict[str, Any] | None], None] | None = None,
        threads: int = 1,
        min_file_bytes: int = 0,
        save_failure: Callable[[BaseException, str], BaseException] | None = None,
    ) -> None:
        super().__init__()
        self.backend, self.target = backend, target
        self.checkpoint_id = checkpoint_id
        self._files = dict(files or {})
        self._commit = commit
        self._threads = max(1, int(threads))
        self._min_file_bytes = max(1, int(min_file_bytes))
        self._failure = save_failure or (lambda exc, _path: exc)
        self.rank = 0
        self.landed: dict[str, Entry] | None = None
        """Rank 0, on a filesystem: the target's listing ``finish`` checked (before ``.metadata``)."""

    # -- DCP's StorageWriter protocol --------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        """Nothing to reset: one writer per save."""

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Remember this rank (DCP passes ``rank=``)."""
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", self.rank) or 0

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """Unchanged (the target exists already: rank 0 created it, no rank creates directories)."""
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Each rank's file-name prefix, ``__<rank>_``, as DCP's ``FileSystemWriter`` names them."""
        return [dataclasses.replace(plan, storage_data=DCPStoragePrefix(f"__{i}_")) for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """This rank's data file(s) and small files, each fsynced / uploaded; results + records."""
        try:
            self.backend.check_target(self.target)
        except (ValueError, FileNotFoundError) as exc:  # See [Note: one directory for every rank]
            raise type(exc)(f"save of checkpoint {self.checkpoint_id!r} failed on rank {self.rank}: {exc}") from None
        prefix = plan.storage_data.prefix
        buckets = split_items(plan.items, self._threads, self._min_file_bytes)  # [Note: derived file layout]
        results: list[list[WriteResult]] = [[] for _ in buckets]
        records: dict[str, dict[str, Any]] = {}
        errors: list[BaseException] = []

        def write(n: int) -> None:
            name = f"{prefix}{n}{_SUFFIX}"
            path = self.backend.join(self.target.data, name)
            try:
                results[n], records[name] = _write_items(self.backend, path, name, buckets[n], planner)
            except BaseException as exc:  # noqa: BLE001 (raised below, on this thread)
                errors.append(self._failure(exc, path))

        threads = [
            threading.Thread(target=write, args=(n,), name=f"shardbridge-write-{n}")
            for n in range(1, len(buckets))
            if buckets[n]  # an empty later file is not written ([Note: derived file layout])
        ]
        for thread in threads:
            thread.start()
        write(0)
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        for name, data in sorted(self._files.items()):
            path = self.backend.join(self.target.data, name)
            try:
                if "/" in name:
                    self.backend.mkdirs(self.backend.join(self.target.data, name.rsplit("/", 1)[0]))
                records[name] = _write_bytes(self.backend, path, data)
            except BaseException as exc:  # noqa: BLE001 (one clear error naming the file)
                raise self._failure(exc, path) from exc
        out = [r for part in results for r in part]
        mine = RankFiles(self.rank, socket.gethostname(), records)
        out.append(WriteResult(index=MetadataIndex(RECORDS_KEY), size_in_bytes=0, storage_data=mine))
        done: Future[list[WriteResult]] = Future()
        done.set_result(out)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0: every rank's files seen, ``.metadata`` from their results, then the commit with every record."""
        written: list[RankFiles] = []
        storage: dict[MetadataIndex, Any] = {}
        for part in results:
            for result in part:
                if result.index.fqn == RECORDS_KEY:
                    written.append(result.storage_data)
                else:
                    storage[result.index] = result.storage_data
        metadata.storage_data = storage
        self._seal(metadata, written, pickle.dumps)

    def finish_stream(
        self,
        head: Metadata,
        names: list[str],
        groups: list[StorageGroup],
        written: list[RankFiles],
        *,
        derived: dict[str, Any] | None = None,
    ) -> None:
        """Rank 0, the derived protocol: as :meth:`finish`, ``.metadata`` streamed from records derived by rule.

        ``head``: ``.metadata`` without storage records; ``names`` / ``groups``: the records
        ([Note: streamed .metadata] in ``_metadata_stream.py``); ``written``: every rank's files;
        ``derived``: how to derive every record again, for the manifest (``layout.derived``).
        """
        self._seal(head, written, lambda h: lambda write: write_metadata(h, names, groups, write), derived)

    def _seal(
        self,
        metadata: Metadata,
        written: list[RankFiles],
        encode: Callable[[Metadata], Any],
        derived: dict[str, Any] | None = None,
    ) -> None:
        """Every rank's files seen, ``.metadata`` written (``encode``: its bytes, or a writer), the commit."""
        if not self.backend.remote:
            self.landed = self.backend.listing(self.target.data)
            self.check_seen(written, self.landed)
        records: dict[str, dict[str, Any]] = {}
        for part in written:
            records.update(part.files)
        metadata.version = DCP_VERSION
        metadata.storage_meta = self.storage_meta()
        path = self.backend.join(self.target.data, DCP_METADATA_NAME)
        try:
            records[DCP_METADATA_NAME] = _write_bytes(self.backend, path, encode(metadata))
        except BaseException as exc:  # noqa: BLE001 (one clear error naming the file)
            raise self._failure(exc, path) from exc
        if self._commit is not None:
            self._commit(records, derived)

    @property
    def threads(self) -> int:
        """At most this many data files per rank ([Note: derived file layout] in ``_files.py``)."""
        return self._threads

    @property
    def min_file_bytes(self) -> int:
        """The least tensor bytes that get a data file of their own."""
        return self._min_file_bytes

    def check_seen(self, written: list[RankFiles], landed: dict[str, Entry]) -> None:
        """Rank 0: ValueError unless every file of ``written`` is in the target with its size.

        ``landed``: the target's listing. See [Note: one directory for every rank].
        """
        sizes = {name: entry.size for name, entry in landed.items()}
        for part in sorted(written, key=lambda p: p.rank):
            for name, record in sorted(part.files.items()):
                if sizes.get(name) == record["size"]:
                    continue
                path = self.backend.join(self.target.data, name)
                entry = self.backend.stat(path)  # by name: a cached listing may lag another machine's writes
                if entry is not None and entry.size == record["size"]:
                    continue
                seen = "is missing" if entry is None else f"has {entry.size} bytes, not the {record['size']} written"
                raise ValueError(
                    f"save of checkpoint {self.checkpoint_id!r} refused: {name!r}, written by rank {part.rank} "
                    f"(host {part.host!r}) into {self.backend.uri(self.target.data)!r}, {seen} where rank 0 (host "
                    f"{socket.gethostname()!r}) looks: the ranks do not see the same directory (a node-local disk, "
                    f"or a relative path under different working directories?). Nothing was committed; {SHARED_DIRECTORY_FIX}"
                )

    def storage_meta(self) -> StorageMeta | None:
        """The checkpoint's path or URI (``.metadata``'s ``storage_meta.checkpoint_id``)."""
        return StorageMeta(checkpoint_id=self.checkpoint_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen by DCP from a ``checkpoint_id``: shardbridge passes the writer itself."""
        return False


def _write_items(
    backend: Backend, path: str, name: str, items: list[WriteItem], planner: SavePlanner
) -> tuple[list[WriteResult], dict[str, Any]]:
    """One data file: its items, as DCP lays them out; (write results, the file's record)."""
    results = []
    with backend.writing(path) as raw:
        f = ChecksumWriter(raw)
        for item in items:
            data = planner.resolve_data(item)
            offset = f.tell()
            if item.type == WriteItemType.BYTE_IO:
                f.write(data.getbuffer())
            else:
                t = data.detach().cpu()
                if t.untyped_storage().size() != t.nbytes:
                    t = t.clone()  # a view of a larger storage: its own bytes only, as DCP does
                torch_save_without_crc(t, f)
            length = f.tell() - offset
            results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=DCPStorageInfo(name, offset, length))
            )
        f.flush()
    return results, f.record()


def _write_bytes(backend: Backend, path: str, data: bytes | Callable[[Callable[[bytes], Any]], None]) -> dict[str, Any]:
    """One file of ``data``, or of what ``data(write)`` writes (a stream); its record."""
    with backend.writing(path) as raw:
        f = ChecksumWriter(raw)
        if callable(data):
            data(f.write)
        else:
            f.write(data)
        f.flush()
    return f.record()
