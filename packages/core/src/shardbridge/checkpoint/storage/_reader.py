"""DCP's ``StorageReader`` on a backend: restricted metadata, one pass per file, nothing executed.

:class:`TrustedReader` is what ``dcp.load`` (and export, one tensor at a time) reads through:

- ``read_metadata``: the restricted unpickler and structure check ([Note: untrusted
  checkpoints] in ``_trust.py``), never rank-local metadata;
- ``read_data``: every item of the plan, each file (or each run of the records wanted from it)
  read as one stream straight into the targets ([Note: reading records in one pass] in
  ``_read.py``), the files of ``verify`` hashed in the same pass ([Note: verifying while
  reading]); a record that is not the plain one is ``torch.load``-ed with ``weights_only=True``,
  as DCP's own reader does; bytes items only through a planner that loads them with
  ``weights_only=True`` (:class:`WeightsOnlyBytes`).

[Note: verifying while reading]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A load with ``verify=True`` compares every file's xxh3_128 with the manifest. It used to read
every file once to hash it and then again to load it (16% of a 1 GB local load; on an object
store every byte fetched twice). Now each file has one hashing rank (``_verify.hash_share``: a
data file its writer's rank, which in the same layout needs all of it; the rest balanced by
size), which reads it as ONE stream from its first byte to its last, hashing every byte as it
lands and putting the records it wants into its tensors on the way; the records other ranks
want from it they read themselves, unhashed, as before. What "before use" means, then:

- every byte a rank hands on was read in a pass whose checksum is compared before ``load``
  lets any value out: the digests are compared when ``read_data`` ends, and ``load``'s read
  round agrees that every rank's files matched BEFORE the state reaches the model
  (``set_state_dict``, a provider's ``load_state_dicts``, FP8 re-quantization, RNG restore);
  a mismatch on any rank is a ``ValueError`` on every rank, and ``load_latest`` moves on to the
  next older checkpoint as before;
- but the bytes land IN PLACE: a live parameter's or optimizer state's storage is a target,
  so a refused load has already written the damaged file's bytes (and the intact files') into
  the model's tensors. Its error says so: the model is to be loaded again (``load_latest``'s
  fallback does that, loading every key the older checkpoint holds over it) or rebuilt, never
  trained on. Staging the whole state to check it first would cost a second copy of every byte,
  the cost this pass removes; a refused load is rare, and never silent;
- a record that fails to parse in a hashed file (a damaged zip header ``torch.load`` refuses)
  waits for the file's checksum: a mismatch reports the damage (what ``load_latest`` skips),
  a match raises the record's own error (a crafted file whose manifest agrees with it).

``verify`` is None for export and ``inspect`` (``verify`` itself hashes what they read).
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardbridge.checkpoint.storage import _read
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._integrity import FileProblem
from shardbridge.checkpoint.storage._manifest import CHECKSUM_KEY, DCP_METADATA_NAME
from shardbridge.checkpoint.storage._trust import (
    _REFUSED,
    UntrustedCheckpointError,
    WeightsOnlyBytes,
    _stored,
    _weights_only_reason,
    read_metadata,
)

__all__ = ["REMOTE_GAP", "REMOTE_READERS", "TrustedReader"]

REMOTE_READERS = 8
"""Streams in flight per rank on an object store (a file or a run of records each)."""
REMOTE_GAP = 4 << 20
"""On an object store, wanted bytes of one file less than this apart are fetched in one request
(the gap streamed and dropped): a request's first byte costs 20-60 ms, about what one stream
transfers in 2-6 MB, so a smaller gap is cheaper to read through than to ask for again
(:func:`_read.plan_ranges`)."""


class TrustedReader(StorageReader):
    """DCP's storage reader for one checkpoint that runs no code from it (see the module docstring).

    Args:
        checkpoint: the stored checkpoint (or a local checkpoint directory).
        metadata: already read metadata (from :func:`read_metadata`), to skip a second read.
        verify: files to hash while reading (name -> its manifest record: ``size`` and checksum),
            each read whole; their mismatches are in :attr:`problems` after ``read_data``.
    """

    def __init__(
        self,
        checkpoint: Stored | str | os.PathLike[str],
        metadata: Metadata | None = None,
        *,
        verify: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__()
        self.stored = _stored(checkpoint)
        self._metadata = metadata
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex
        self._verify = dict(verify or {})
        self.problems: list[FileProblem] = []
        """The files of ``verify`` whose checksum did not match, after ``read_data``."""

    @property
    def path(self) -> str:
        """Where the checkpoint's files are (a backend path)."""
        return self.stored.data

    def reset(self, checkpoint_id: Any = None) -> None:
        """A new load id (DCP records it in the metadata it hands the planner)."""
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The restricted read of ``.metadata`` (once per reader)."""
        if kwargs.get("rank") is not None:
            # DCP falls back to rank-local metadata when the global one fails to read.
            raise UntrustedCheckpointError(
                f"{str(self.stored)!r}: shardbridge reads only the global {DCP_METADATA_NAME}, never "
                "rank-local metadata"
            )
        if self._metadata is None:
            self._metadata = read_metadata(self.stored)
        if self._metadata.storage_meta is None:
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # as DCP's reader does
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Where each item lives."""
        self._metadata = metadata
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """Unchanged."""
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """Unchanged."""
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        """Never chosen by DCP from a ``checkpoint_id``: shardbridge passes the reader itself."""
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every item of ``plan`` into the planner's targets, the ``verify`` files hashed (module docstring)."""
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            if not getattr(planner, "weights_only_bytes", False):
                raise TypeError(
                    f"{type(planner).__name__} would unpickle checkpoint bytes items without weights_only; "
                    "use shardbridge.checkpoint.state._chunks.LoadPlanner (see [Note: untrusted checkpoints])"
                )
            if isinstance(planner, WeightsOnlyBytes):
                planner.checkpoint_dir = self.stored
        files: dict[str, dict[int, _read.Record]] = {}
        for item in plan.items:
            self._add(files, item, planner)
        jobs = []
        for name in sorted(set(files) | set(self._verify)):
            records = sorted(files.get(name, {}).values(), key=lambda r: r.offset)
            end = int(self._verify[name]["size"]) if name in self._verify else records[-1].offset + records[-1].length
            jobs.append((name, 0 if name in self._verify else records[0].offset, end, records))
        remote = self.stored.backend.remote
        jobs.sort(key=lambda job: job[1] - job[2])  # the longest first
        if remote and len(jobs) > 1:
            with ThreadPoolExecutor(min(REMOTE_READERS, len(jobs)), thread_name_prefix="shardbridge-read") as pool:
                found = list(pool.map(lambda job: self._read_job(*job), jobs))
        else:
            found = [self._read_job(*job) for job in jobs]
        self.problems = sorted((p for p in found if p is not None), key=lambda p: p.name)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _add(self, files: dict[str, dict[int, _read.Record]], item: ReadItem, planner: LoadPlanner) -> None:
        """``item`` as a target of its record (one record may feed several items)."""
        info = self.storage_data[item.storage_index]
        record = files.setdefault(info.relative_path, {}).get(info.offset)
        if record is None:
            record = _read.Record(info.offset, info.length, key=item)
            files[info.relative_path][info.offset] = record
        if item.type == LoadItemType.BYTE_IO:
            record.whole = lambda data: planner.load_bytes(item, io.BytesIO(data))
            return
        target = planner.resolve_tensor(item).detach()
        if target.size() != torch.Size(item.lengths):
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tuple(item.lengths)}")
        if not getattr(info, "transform_descriptors", None):  # a transformed record (none of ours): torch.load
            record.sizes, record.dtype = self._box(item)
        record.wants.append((target, tuple(item.storage_offsets)))
        previous = record.done
        record.done = lambda: (previous and previous(), planner.commit_tensor(item, target))

    def _box(self, item: ReadItem) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
        """(sizes, dtype) of the stored box ``item`` reads from, from the metadata."""
        index = item.storage_index
        md = self._metadata.state_dict_metadata.get(index.fqn) if self._metadata is not None else None
        chunks = getattr(md, "chunks", None)
        if chunks is None:
            return None, None
        at = index.index if index.index is not None and index.index < len(chunks) else None
        chunk = chunks[at] if at is not None and chunks[at].offsets == index.offset else None
        if chunk is None:
            chunk = next((c for c in chunks if c.offsets == index.offset), None)
        return (None, None) if chunk is None else (tuple(chunk.sizes), md.properties.dtype)

    def _read_job(self, name: str, start: int, end: int, records: list[_read.Record]) -> FileProblem | None:
        """One stream of file ``name``: its records into their targets, hashed if it is in ``verify``."""
        backend, path = self.stored.backend, self.stored.file(name)
        want = self._verify.get(name)
        digest = xxhash.xxh3_128() if want is not None else None

        def reread(offset: int, length: int) -> bytes:
            data = bytearray(length)
            if backend.read_into(path, offset, memoryview(data)) != length:
                raise ValueError(f"{self.stored.show(name)} ends before byte {offset + length}")
            return bytes(data)

        if want is not None or not backend.remote:  # the whole file / the records' span: one stream
            opened: Any = backend.stream(path, start, end)
        else:  # the parts of the records wanted, in as few requests as pay
            opened = _read.Ranges(lambda a, b: backend.stream(path, a, b), _read.plan_ranges(records, REMOTE_GAP))
        try:
            with opened as raw:
                stream = _read.Stream(raw, start, end, digest=digest, seek=want is None)
                failed = _read.read_records(stream, records, reread=reread)
                stream.skip(end - stream.pos)
        except _read.RecordError as exc:
            raise self._failure(name, exc) from exc.cause
        except ValueError as exc:  # the file ended early: changed since its size was checked
            if want is None:
                raise ValueError(f"{self.stored.show(name)} is shorter than recorded: {exc}; the checkpoint is damaged") from None
            return FileProblem(self.stored.prefix + name, f"cannot be read ({exc})")
        if want is not None and digest is not None and digest.hexdigest() != want[CHECKSUM_KEY]:
            return FileProblem(self.stored.prefix + name, "checksum mismatch (corrupted or from another checkpoint)")
        if failed:  # an intact file (as its manifest records it) whose record does not read
            raise self._failure(name, failed[0]) from failed[0].cause
        return None

    def _failure(self, name: str, exc: _read.RecordError) -> Exception:
        """The error for a record of file ``name`` that did not read: untrusted, or damaged."""
        item = exc.record.key
        what = item.storage_index.fqn if isinstance(item, ReadItem) else "a record"
        file = self.stored.show(name)
        if isinstance(exc.cause, pickle.UnpicklingError):  # torch.load(weights_only=True) refused it
            return UntrustedCheckpointError(
                f"the tensor record of {what!r} in {file!r} holds a pickle that torch.load(weights_only=True) "
                f"refuses ({_weights_only_reason(str(exc.cause))}): {_REFUSED}"
            )
        if isinstance(exc.cause, UntrustedCheckpointError):
            return exc.cause
        return ValueError(
            f"the record of {what!r} in {file!r} (bytes {exc.record.offset}..{exc.record.offset + exc.record.length}) "
            f"does not read: {exc}; the checkpoint is damaged or was not written by DCP"
        )
