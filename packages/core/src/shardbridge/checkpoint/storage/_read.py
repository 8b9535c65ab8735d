"""Read one stored box of a DCP checkpoint straight into the tensor it belongs to.

[Note: reading boxes in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP stores each box (one rank's piece of one tensor) as a ``torch.save`` record: a zip
archive whose entry ``<archive>/data/0`` holds the raw bytes of the tensor's storage, not
compressed. DCP's own reader ``torch.load``s the record whole and copies it into the
target, so the box exists twice in memory. :func:`read_box_into` instead:

1. finds the byte ranges of the pickle entry (``data.pkl``) and of the storage entry in the
   file from the zip headers;
2. reads the record's tensor metadata (shape, dtype, strides, storage offset) from its
   pickle with ``torch.load(weights_only=True)`` under ``torch.serialization.skip_data`` (no
   bytes read). That costs ~0.2 ms a record, so the result is kept per distinct pickle
   (``_META``): the metadata is a function of the pickle's bytes alone, and the boxes of one
   checkpoint share few pickles (a parameter and its two AdamW states, every layer's copy of
   a weight: 150 records of a 5-layer Llama with AdamW had 12 distinct pickles);
3. reads the storage bytes into the target: directly when the target region is contiguous,
   else through a buffer of at most ``_BUFFER_BYTES`` (a few rows at a time).

On an object store every read is a ranged GET: the zip headers of a record (its first and
last few KB) are fetched in two blocks of ``_REMOTE_BLOCK`` bytes (``_Window``'s cache), the
storage bytes in reads of at most ``_REMOTE_READ`` bytes straight into the target (so memory
stays bounded, and a load into another layout fetches only the rows it needs).

Anything unusual (a target not in host memory, e.g. a CUDA parameter; a transform such as
compression, a non-contiguous or offset storage, a big-endian record, several storages) returns
False and the caller falls back to the reader's whole-record path for that box. Export and ``load`` read every whole box so (export: its peak memory is
the point; load: one pass over the bytes, and no per-record ``torch.load``). Only
``weights_only`` unpickling runs (see [Note: untrusted checkpoints] in ``_trust.py``); byte
ranges are checked to lie inside the record.
"""

from __future__ import annotations

import contextlib
import io
import os
import struct
import sys
import zipfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Union

import torch

if TYPE_CHECKING:
    from shardbridge.checkpoint.storage._backend import Backend

__all__ = ["EXPORT_IN_PLACE_MIN_BYTES", "IN_PLACE_MIN_BYTES", "BoxSource", "read_box_into"]

BoxSource = Union[str, "os.PathLike[str]", "tuple[Backend, str]"]
"""Where a record lives: a local file, or ``(backend, path)`` (an object on an object store)."""
_BUFFER_BYTES = 8 << 20
_REMOTE_BLOCK = 64 << 10
"""Bytes fetched for a small read of a record on an object store (its zip headers)."""
_REMOTE_READ = 16 << 20
"""Most bytes of one ranged GET into a target."""
IN_PLACE_MIN_BYTES = 0
"""Smallest record ``load`` reads in place (every one: with the metadata kept per distinct
pickle, parsing a record costs less than DCP's ``torch.load`` of it)."""
_META: dict[bytes, tuple[Any, ...] | None] = {}
"""pickle bytes of a record -> (dtype, shape, contiguous, storage offset, bytes) or None (unusual)."""
_META_MAX = 4096
EXPORT_IN_PLACE_MIN_BYTES = 0
"""Smallest record export reads in place: every one (memory, not speed, is what export bounds;
with 1 MB here a 4-rank export peaked 1.0x the largest tensor + 16 MB instead of + 6 MB)."""
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``[start, start + length)`` of an open binary file.

    ``cached``: small reads are served from blocks of ``_REMOTE_BLOCK`` bytes (at most three kept:
    a record's head and tail, and one more), each fetched with one read of ``f``.
    """

    def __init__(self, f: Any, start: int, length: int, *, cached: bool = False) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0
        self._blocks: list[tuple[int, bytes]] | None = [] if cached else None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + offset))
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = min(len(view), self._length - self._pos)
        if n <= 0:
            return 0
        if self._blocks is not None and n < _REMOTE_BLOCK:
            block = self._block(self._pos, n)
            view[:n] = block
            self._pos += n
            return n
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n])
        self._pos += got or 0
        return got or 0

    def _block(self, pos: int, n: int) -> memoryview:
        """``n`` bytes at ``pos`` from a cached block (fetching one when none holds them)."""
        assert self._blocks is not None
        for start, data in self._blocks:
            if start <= pos and pos + n <= start + len(data):
                return memoryview(data)[pos - start : pos - start + n]
        # The head (local headers, the pickle) and the tail (central directory) of a record are
        # each one block; anything else starts a block where it is read.
        start = 0 if pos + n <= _REMOTE_BLOCK else max(0, min(pos, self._length - _REMOTE_BLOCK))
        size = min(_REMOTE_BLOCK, self._length - start)
        data = bytearray(size)
        self._f.seek(self._start + start)
        got = _read_exact(self._f, data)
        if not got:
            raise OSError(f"short read of {size} bytes at {self._start + start}")
        self._blocks = [*self._blocks[-2:], (start, bytes(data))]
        return memoryview(data)[pos - start : pos - start + n]


def _entry_range(window: _Window, info: zipfile.ZipInfo) -> tuple[int, int] | None:
    """(offset within the record, size) of a stored entry's bytes; None if unusual."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    window.seek(info.header_offset)
    head = window.read(_LOCAL_HEADER.size)
    if len(head) != _LOCAL_HEADER.size:
        return None
    fields = _LOCAL_HEADER.unpack(head)
    if fields[0] != _LOCAL_MAGIC:
        return None
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.file_size > window._length:
        return None
    return start, info.file_size


def _ranges(window: _Window) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """(pickle range, storage range) of a record with one storage; None if unusual."""
    with zipfile.ZipFile(window) as archive:
        infos = archive.infolist()
        storages = [i for i in infos if i.filename.split("/")[-2:-1] == ["data"]]
        pickles = [i for i in infos if i.filename.endswith("/data.pkl")]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(storages) != 1 or len(pickles) != 1 or len(order) > 1:
            return None
    # Entries are read by their ranges, never with ``archive.read``: zipfile checks the CRC32,
    # which shardbridge's writer leaves at 0 ([Note: the data file writer] in _writer.py).
    if order:
        order_at = _entry_range(window, order[0])
        if order_at is None:
            return None
        window.seek(order_at[0])
        if window.read(order_at[1]).decode("ascii", "replace") != sys.byteorder:
            return None
    pickle_at, storage_at = _entry_range(window, pickles[0]), _entry_range(window, storages[0])
    return None if pickle_at is None or storage_at is None else (pickle_at, storage_at)


def _record_meta(window: _Window, pickle_bytes: bytes) -> tuple[Any, ...] | None:
    """The record's tensor metadata, from ``_META`` or ``torch.load`` under ``skip_data``."""
    if pickle_bytes in _META:
        return _META[pickle_bytes]
    window.seek(0)
    with torch.serialization.skip_data():
        meta = torch.load(window, map_location="cpu", weights_only=True)
    found = None
    if isinstance(meta, torch.Tensor) and type(meta) is torch.Tensor:
        found = (meta.dtype, tuple(meta.shape), meta.is_contiguous(), meta.storage_offset(), meta.numel() * meta.element_size())
    if len(_META) >= _META_MAX:
        _META.clear()
    _META[pickle_bytes] = found
    return found


class _RemoteFile(io.RawIOBase):
    """An object read with ranged GETs: ``seek`` + ``readinto`` (at most ``_REMOTE_READ`` bytes a GET)."""

    def __init__(self, backend: Backend, path: str) -> None:
        super().__init__()
        self._backend, self._path, self._pos = backend, path, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        assert whence == io.SEEK_SET, whence
        self._pos = offset
        return offset

    def tell(self) -> int:
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:_REMOTE_READ]
        got = self._backend.read_into(self._path, self._pos, view)
        self._pos += got
        return got


@contextlib.contextmanager
def _opened(source: BoxSource) -> Iterator[tuple[Any, bool]]:
    """``(raw binary file, remote)`` for a record source."""
    if isinstance(source, tuple):
        backend, path = source
        if backend.remote:
            yield _RemoteFile(backend, path), True
            return
        source = path
    with open(source, "rb", buffering=0) as f:
        yield f, False


def read_box_into(
    source: BoxSource, offset: int, length: int, target: torch.Tensor, box_offsets: tuple[int, ...] | None = None
) -> bool:
    """Fill ``target`` from the record at ``source[offset:offset+length]``.

    ``target`` is a view into the destination tensor; it receives the part of the stored box
    that starts at ``box_offsets`` (None: the whole box, which must then have ``target``'s
    shape) and has ``target``'s shape: a load into another layout reads only the rows of the
    box it needs. Returns False (``target`` untouched or to be overwritten by the caller's
    fallback) when the record is not the plain case. See [Note: reading boxes in place].
    """
    if target.device.type != "cpu":  # file bytes go straight into host memory only; DCP's reader copies
        return False
    with _opened(source) as (f, remote):
        window = _Window(f, offset, length, cached=remote)
        try:
            ranges = _ranges(window)
            if ranges is None:
                return False
            (pickle_start, pickle_size), where = ranges
            window.seek(pickle_start)
            pickle_bytes = window.read(pickle_size)
            meta = _record_meta(window, pickle_bytes) if len(pickle_bytes) == pickle_size else None
        except Exception:  # noqa: BLE001 (refused or damaged: DCP's trusted reader reports it)
            return False
        if meta is None:
            return False
        dtype, shape, contiguous, storage_offset, nbytes = meta
        want = tuple(target.shape)
        starts = tuple(box_offsets) if box_offsets is not None else (0,) * len(shape)
        plain = (
            dtype == target.dtype
            and contiguous
            and storage_offset == 0
            and where[1] == nbytes
            and len(starts) == len(shape) == len(want)
            and all(0 <= o and o + n <= size for o, n, size in zip(starts, want, shape))
            and (box_offsets is not None or want == shape)
        )
        if not plain:
            return False
        if target.numel() == 0:
            return True
        if not shape:  # a 0-d tensor: its one element
            f.seek(offset + where[0])
            return _read_exact(f, target.reshape(-1).view(torch.uint8).numpy())
        # The rows [starts[0], starts[0] + want[0]) of the box are one contiguous byte range.
        row_bytes = nbytes // shape[0]
        f.seek(offset + where[0] + starts[0] * row_bytes)
        whole_rows = want[1:] == shape[1:]
        if whole_rows and target.is_contiguous():
            return _read_exact(f, target.reshape(-1).view(torch.uint8).numpy())
        # A bounded buffer of rows at a time, the wanted columns copied into the strided target.
        rows = max(1, _BUFFER_BYTES // max(1, row_bytes))
        inner = tuple(slice(o, o + n) for o, n in zip(starts[1:], want[1:]))
        for first in range(0, want[0], rows):
            count = min(rows, want[0] - first)
            buffer = torch.empty((count, *shape[1:]), dtype=dtype)
            if not _read_exact(f, buffer.reshape(-1).view(torch.uint8).numpy()):
                return False
            target[first : first + count].copy_(buffer[(slice(None), *inner)])
        return True


def _read_exact(f: Any, out: Any) -> bool:
    view = memoryview(out).cast("B")
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            return False
        done += n
    return True
