"""Read one stored box of a DCP checkpoint straight into the tensor it belongs to.

[Note: reading boxes in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP stores each box (one rank's piece of one tensor) as a ``torch.save`` record: a zip
archive whose entry ``<archive>/data/0`` holds the raw bytes of the tensor's storage, not
compressed. DCP's own reader ``torch.load``s the record whole and copies it into the
target, so the box exists twice in memory. :func:`read_box_into` instead:

1. reads the record's tensor metadata with ``torch.load(weights_only=True)`` under
   ``torch.serialization.skip_data`` (shape, dtype, strides, storage offset; no bytes read);
2. finds the storage entry's byte range in the file from the zip headers;
3. reads those bytes into the target: directly when the target region is contiguous, else
   through a buffer of at most ``_BUFFER_BYTES`` (a few rows at a time).

Anything unusual (a transform such as compression, a non-contiguous or offset storage, a
big-endian record, several storages) returns False and the caller falls back to DCP's
reader for that box. Export reads every record so (its peak memory is the point); ``load``
only records of at least ``IN_PLACE_MIN_BYTES`` (its speed is: steps 1-2 cost ~3 ms a record
here, more than the copy they save for small boxes). Only ``weights_only`` unpickling runs (see [Note: untrusted
checkpoints] in ``_trust.py``); byte ranges are checked to lie inside the record.
"""

from __future__ import annotations

import io
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["EXPORT_IN_PLACE_MIN_BYTES", "IN_PLACE_MIN_BYTES", "read_box_into"]

_BUFFER_BYTES = 8 << 20
IN_PLACE_MIN_BYTES = 8 << 20
"""Smallest record ``load`` reads in place: below it, parsing the record (~2-3 ms here, mostly
``torch.load`` of its metadata and the zip directory) costs more than the copy it saves."""
EXPORT_IN_PLACE_MIN_BYTES = 0
"""Smallest record export reads in place: every one (memory, not speed, is what export bounds;
with 1 MB here a 4-rank export peaked 1.0x the largest tensor + 16 MB instead of + 6 MB)."""
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")
_LOCAL_MAGIC = 0x04034B50


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``[start, start + length)`` of an open binary file."""

    def __init__(self, f: Any, start: int, length: int) -> None:
        super().__init__()
        self._f, self._start, self._length, self._pos = f, start, length, 0

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
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(view[:n])
        self._pos += got or 0
        return got or 0


def _storage_range(window: _Window) -> tuple[int, int] | None:
    """(offset within the record, size) of the record's single storage; None if unusual."""
    with zipfile.ZipFile(window) as archive:
        infos = archive.infolist()
        storages = [i for i in infos if i.filename.split("/")[-2:-1] == ["data"]]
        order = [i for i in infos if i.filename.endswith("/byteorder")]
        if len(storages) != 1 or storages[0].compress_type != zipfile.ZIP_STORED:
            return None
        if order and archive.read(order[0]).decode("ascii", "replace") != sys.byteorder:
            return None
        info = storages[0]
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


def read_box_into(file: Path, offset: int, length: int, target: torch.Tensor) -> bool:
    """Fill ``target`` (a view into the full tensor) from the record at ``file[offset:offset+length]``.

    Returns False (``target`` untouched or to be overwritten by the caller's fallback) when
    the record is not the plain case. See [Note: reading boxes in place].
    """
    with open(file, "rb", buffering=0) as f:
        window = _Window(f, offset, length)
        try:
            with torch.serialization.skip_data():
                meta = torch.load(window, map_location="cpu", weights_only=True)
            window.seek(0)
            where = _storage_range(window)
        except Exception:  # noqa: BLE001 (refused or damaged: DCP's trusted reader reports it)
            return False
        if not isinstance(meta, torch.Tensor) or type(meta) is not torch.Tensor or where is None:
            return False
        nbytes = meta.numel() * meta.element_size()
        plain = (
            meta.shape == target.shape
            and meta.dtype == target.dtype
            and meta.is_contiguous()
            and meta.storage_offset() == 0
            and where[1] == nbytes
        )
        del meta
        if not plain:
            return False
        if nbytes == 0:
            return True
        f.seek(offset + where[0])
        if target.is_contiguous():
            return _read_exact(f, target.reshape(-1).view(torch.uint8).numpy())
        # Rows along dim 0, a bounded buffer at a time, copied into the strided target.
        row_bytes = max(1, nbytes // target.shape[0])
        rows = max(1, _BUFFER_BYTES // row_bytes)
        for start in range(0, target.shape[0], rows):
            part = target[start : start + rows]
            buffer = torch.empty(part.shape, dtype=part.dtype)
            if not _read_exact(f, buffer.reshape(-1).view(torch.uint8).numpy()):
                return False
            part.copy_(buffer)
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
