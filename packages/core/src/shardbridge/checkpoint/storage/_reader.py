"""DCP's ``StorageReader`` on a backend: restricted metadata, boxes read in place, nothing executed.

:class:`TrustedReader` is what ``dcp.load`` (and export, one tensor at a time) reads through:

- ``read_metadata``: the restricted unpickler and structure check ([Note: untrusted
  checkpoints] in ``_trust.py``), never rank-local metadata;
- ``read_data``: every tensor item (a stored box, or the part of one a rank needs) straight into
  its target ([Note: reading boxes in place] in ``_read.py``; on an object store ranged GETs,
  ``REMOTE_READERS`` items at a time); an unusual record (a view of a larger storage, ...) is
  fetched whole and ``torch.load``-ed with ``weights_only=True``, as DCP's own reader does;
  bytes items only through a planner that loads them with ``weights_only=True``
  (:class:`WeightsOnlyBytes`).
"""

from __future__ import annotations

import io
import os
import pickle
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from shardbridge.checkpoint.storage import _read
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._trust import (
    _REFUSED,
    UntrustedCheckpointError,
    WeightsOnlyBytes,
    _stored,
    _weights_only_reason,
    read_metadata,
)

__all__ = ["REMOTE_READERS", "TrustedReader"]

REMOTE_READERS = 4
"""Items read concurrently per rank from an object store (ranged GETs in flight)."""
_DCP_METADATA_NAME = ".metadata"


class TrustedReader(StorageReader):
    """DCP's storage reader for one checkpoint that runs no code from it (see the module docstring).

    Args:
        checkpoint: the stored checkpoint (or a local checkpoint directory).
        metadata: already read metadata (from :func:`read_metadata`), to skip a second read.
    """

    def __init__(self, checkpoint: Stored | str | os.PathLike[str], metadata: Metadata | None = None) -> None:
        super().__init__()
        self.stored = _stored(checkpoint)
        self._metadata = metadata
        self.storage_data: dict[Any, Any] = {}
        self.load_id = uuid.uuid4().hex

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
                f"{str(self.stored)!r}: shardbridge reads only the global {_DCP_METADATA_NAME}, never "
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
        """Every item of ``plan`` into the planner's targets (see the module docstring)."""
        if any(item.type == LoadItemType.BYTE_IO for item in plan.items):
            if not getattr(planner, "weights_only_bytes", False):
                raise TypeError(
                    f"{type(planner).__name__} would unpickle checkpoint bytes items without weights_only; "
                    "use shardbridge.checkpoint.state._chunks.LoadPlanner (see [Note: untrusted checkpoints])"
                )
            if isinstance(planner, WeightsOnlyBytes):
                planner.checkpoint_dir = self.stored
        rest = self._read_in_place(plan.items, planner)
        for item in rest:
            try:
                self._read_whole(item, planner)
            except pickle.UnpicklingError as err:  # a tensor record torch.load(weights_only=True) refused
                file = f"{str(self.stored).rstrip('/')}/{self.storage_data[item.storage_index].relative_path}"
                raise UntrustedCheckpointError(
                    f"the tensor record of {item.storage_index.fqn!r} in {file!r} holds a pickle that "
                    f"torch.load(weights_only=True) refuses ({_weights_only_reason(str(err))}): {_REFUSED}"
                ) from None
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_in_place(self, items: list[ReadItem], planner: LoadPlanner) -> list[ReadItem]:
        """Read every tensor item straight into its target; the items left for :meth:`_read_whole`.

        See [Note: reading boxes in place] in ``_read.py``: one pass over the bytes instead
        of DCP's ``torch.load`` of the box then a copy; a load into another layout reads only
        the rows of a box it needs.
        """
        backend = self.stored.backend
        todo, rest = [], []
        for item in items:
            info = self.storage_data.get(item.storage_index) if item.type != LoadItemType.BYTE_IO else None
            if info is None or info.length < _read.IN_PLACE_MIN_BYTES or getattr(info, "transform_descriptors", None):
                rest.append(item)
            else:
                todo.append((item, info))

        def one(entry: tuple[ReadItem, Any]) -> bool:
            item, info = entry
            target = planner.resolve_tensor(item).detach()
            source = (backend, self.stored.file(info.relative_path))
            if tuple(target.shape) == tuple(item.lengths) and _read.read_box_into(
                source, info.offset, info.length, target, tuple(item.storage_offsets)
            ):
                planner.commit_tensor(item, target)
                return True
            return False

        if backend.remote and len(todo) > 1:
            with ThreadPoolExecutor(REMOTE_READERS, thread_name_prefix="shardbridge-read") as pool:
                done = list(pool.map(one, todo))
        else:
            done = [one(entry) for entry in todo]
        rest.extend(item for (item, _), ok in zip(todo, done) if not ok)
        return rest

    def _read_whole(self, item: ReadItem, planner: LoadPlanner) -> None:
        """One item the slow way: its whole record fetched, then ``torch.load(weights_only=True)`` (DCP's way)."""
        info = self.storage_data[item.storage_index]
        path = self.stored.file(info.relative_path)
        record = bytearray(info.length)
        got = self.stored.backend.read_into(path, info.offset, memoryview(record))
        if got != info.length:
            raise ValueError(
                f"data file {self.stored.show(info.relative_path)!r} is truncated (item {item.storage_index.fqn!r} "
                f"needs bytes {info.offset}..{info.offset + info.length}); the checkpoint is damaged"
            )
        stream = io.BytesIO(record)
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, stream)
            return
        tensor = torch.load(stream, map_location="cpu", weights_only=True)
        for dim, (offset, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)
