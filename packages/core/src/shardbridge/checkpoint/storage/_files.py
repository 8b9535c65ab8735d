"""Where every item of a save lands in its rank's data files: a rule, so rank 0 can derive it.

[Note: derived file layout]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
``.metadata`` records, for every box of every entry, its data file, offset and length. DCP's
writers return them to rank 0 after writing (every rank's write results, world x items bytes
on rank 0). shardbridge's writer lays its files out by a rule instead, so that rank 0 computes
every rank's storage records from the derived plan ([Note: derived plans] in
``derived/_spread.py``) without being sent them:

- a rank's items are written in the order it is handed them, bytes items first (as DCP's
  ``FileSystemWriter``); the derived protocol hands them entries held by more ranks first, each
  group in plan order (``derived/_records.py``: :func:`laid_out`), so that what several ranks read
  lies side by side;
- a rank writes ``n = min(threads, ceil(tensor bytes / min_file_bytes), tensor items)`` files
  (at least one); a tensor item goes to file ``min(n - 1, bytes_before * n // total)``, where
  ``bytes_before`` are the raw bytes of the rank's tensor items before it (contiguous runs of
  about equal bytes: :func:`split_items`, which the writer uses);
- each tensor item is one ``torch.save`` record whose length is a function of its shape and
  dtype (:func:`record_length`: torch writes the same zip structure for any data; computed once
  per distinct shape with ``torch.serialization.skip_data``, no bytes touched).

:func:`derive_rows` evaluates the rule for every item of every rank at once (a sort by writer,
segmented sums: no loop over ranks). Each rank compares its own derived records with what its
writer really wrote; a rank where they differ (another torch's record format, a non-contiguous
view written with other strides) sends its real records instead, so a wrong prediction costs
bytes, never a wrong ``.metadata``.
"""

from __future__ import annotations

import functools
import io
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from shardbridge._compat import torch_save_without_crc

__all__ = ["DATA_FILE_PATTERN", "Rows", "data_file_name", "derive_rows", "file_count", "record_length", "split_items"]

_SUFFIX = ".distcp"
DATA_FILE_PATTERN = re.compile(r"[A-Za-z0-9_.-]+\.distcp")
"""What a ``.metadata`` may name as a data file: a ``.distcp`` file of the checkpoint's directory."""


def data_file_name(rank: int, n: int) -> str:
    """``__<rank>_<n>.distcp``, as DCP's ``FileSystemWriter`` names a rank's files."""
    return f"__{rank}_{n}{_SUFFIX}"


class _Counter(io.RawIOBase):
    """A seekable sink that only tracks the length written (torch's ``skip_data`` seeks over data)."""

    def __init__(self) -> None:
        self.pos = self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        n = memoryview(b).nbytes
        self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.end + offset
        self.end = max(self.end, self.pos)
        return self.pos

    def tell(self) -> int:
        return self.pos


@functools.lru_cache(maxsize=65536)
def record_length(sizes: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of one ``torch.save`` record of a contiguous tensor of ``sizes`` and ``dtype``.

    ``torch.empty`` reserves address space without touching it, and ``skip_data`` writes the
    record's structure without the data, so this costs ~0.2 ms for any size.

    Example:
        >>> record_length((3,), torch.float32) - 3 * 4 > 0
        True
    """
    sink = _Counter()
    with torch.serialization.skip_data():
        torch_save_without_crc(torch.empty(sizes, dtype=dtype), sink)
    return sink.end


def file_count(tensor_bytes: int, tensor_items: int, threads: int, min_file_bytes: int) -> int:
    """How many data files a rank writes. See [Note: derived file layout]."""
    return max(1, min(threads, -(-tensor_bytes // max(1, min_file_bytes)), tensor_items))


def split_items(items: Sequence[WriteItem], threads: int, min_file_bytes: int) -> list[list[WriteItem]]:
    """A rank's items per data file number, in plan order, bytes items first (file 0 always
    exists; a later one may get no item, and is then not written). See [Note: derived file layout]."""
    tensors = [i for i in items if i.type != WriteItemType.BYTE_IO]
    sizes = [_nbytes(i) for i in tensors]
    total = sum(sizes)
    n = file_count(total, len(tensors), threads, min_file_bytes)
    buckets: list[list[WriteItem]] = [[] for _ in range(n)]
    buckets[0].extend(i for i in items if i.type == WriteItemType.BYTE_IO)
    before = 0
    for item, size in zip(tensors, sizes):
        buckets[min(n - 1, before * n // total) if total else 0].append(item)
        before += size
    return buckets  # file n holds buckets[n] (one may be empty when a large item spans its share)


def _nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.chunk.sizes.numel() * item.tensor_data.properties.dtype.itemsize


@dataclass
class Rows:
    """Every derived item of a save, in plan order (entries in order, each entry's boxes in order).

    All fields are int64 tensors of one length (rows): the writing rank, the raw bytes, the
    record length; :func:`derive_rows` fills ``file`` and ``offset``.
    """

    writer: torch.Tensor
    nbytes: torch.Tensor
    length: torch.Tensor
    is_bytes: torch.Tensor
    """bool: a bytes item (written first, no raw tensor bytes)."""
    file: torch.Tensor | None = None
    """The data file's number ``n`` in ``__<writer>_<n>.distcp``."""
    offset: torch.Tensor | None = None
    """Byte offset of the record in its file."""


def derive_rows(
    rows: Rows, *, threads: int, min_file_bytes: int, segments: Sequence[tuple[int, int]] | None = None
) -> dict[tuple[int, int], int]:
    """Fill ``rows.file`` and ``rows.offset`` by the rule; returns ``(writer, file) -> size``.

    See [Note: derived file layout]. ``segments``: ``(first row, rows)`` per entry, in the order the
    writer lays them out (None: a row each). Entry by entry, every writer's running offset advances
    at once (one entry's rows usually have distinct writers; an entry with several boxes of one
    writer goes in rounds):
    ~15 small tensor operations per entry, no sort of all rows.
    """
    n = rows.writer.numel()
    rows.file = torch.zeros(n, dtype=torch.int64)
    rows.offset = torch.zeros(n, dtype=torch.int64)
    if n == 0:
        return {}
    segments = [(i, 1) for i in range(n)] if segments is None else segments
    world = int(rows.writer.max()) + 1
    tensor = ~rows.is_bytes
    raw = torch.where(rows.is_bytes, 0, rows.nbytes)
    total = torch.zeros(world, dtype=torch.int64).index_add_(0, rows.writer, raw)
    count = torch.zeros(world, dtype=torch.int64).index_add_(0, rows.writer, tensor.to(torch.int64))
    files = torch.clamp(torch.clamp(-(-total // max(1, min_file_bytes)), max=threads).minimum(count), min=1)
    run = torch.zeros(world, dtype=torch.int64)  # each writer's offset in its current file
    cur = torch.zeros(world, dtype=torch.int64)  # each writer's current file
    before = torch.zeros(world, dtype=torch.int64)  # each writer's raw tensor bytes so far
    closed: list[torch.Tensor] = []  # (writer, file, size) of files a writer moved on from

    def advance(at: torch.Tensor) -> None:  # rows ``at``: distinct writers, in plan order
        w, length = rows.writer[at], rows.length[at]
        if threads > 1:
            file = torch.where(total[w] > 0, torch.minimum(files[w] - 1, before[w] * files[w] // total[w].clamp(min=1)), 0)
            moved = file != cur[w]
            if bool(moved.any()):
                closed.append(torch.stack([w[moved], cur[w][moved], run[w][moved]], 1))
            offset = torch.where(moved, 0, run[w])
            cur[w] = file
            before[w] += raw[at]
            rows.file[at] = file
        else:
            offset = run[w]
        rows.offset[at] = offset
        run[w] = offset + length

    for first_pass in (True, False):  # bytes items first (file 0), then the tensors, each in segment order
        for start, size in segments:
            if size == 0 or bool(rows.is_bytes[start]) != first_pass:
                continue
            at = torch.arange(start, start + size)
            w = rows.writer[at]
            if torch.unique(w).numel() == size:
                advance(at)
                continue
            # several rows of one writer: round k takes each writer's k-th row
            order = torch.sort(w, stable=True).indices
            sorted_w = w[order]
            new = torch.ones(size, dtype=torch.bool)
            new[1:] = sorted_w[1:] != sorted_w[:-1]
            group_start = torch.cummax(torch.where(new, torch.arange(size), 0), 0).values
            occurrence = torch.empty(size, dtype=torch.int64)
            occurrence[order] = torch.arange(size) - group_start
            for k in range(int(occurrence.max()) + 1):
                advance(at[occurrence == k])
    sizes = {}
    for w, f, size in torch.cat(closed).tolist() if closed else []:
        sizes[(w, f)] = size
    has_rows = torch.zeros(world, dtype=torch.bool)
    has_rows[rows.writer] = True
    for w in torch.nonzero(has_rows).flatten().tolist():
        sizes[(w, int(cur[w]))] = int(run[w])
    return sizes
