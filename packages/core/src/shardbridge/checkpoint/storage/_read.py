"""Read a checkpoint's records in one sequential pass: every stored box straight into its targets.

[Note: reading records in one pass]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP stores each box (one rank's piece of one tensor) as a ``torch.save`` record: a zip archive
whose entry ``<archive>/data/0`` holds the raw bytes of the tensor's storage, uncompressed. DCP's
reader ``torch.load``s each record whole and copies it into the target, so the box exists twice
in memory, and on an object store each record is a request of its own. This module reads a
file, or a run of its records, as ONE sequential stream (:class:`Stream`: one open on local
disk, one GET on an object store) and puts each record's tensor bytes straight into the tensors
that want them (:func:`read_records`):

- where a record lies and how long it is, ``.metadata`` (or the manifest's derived records)
  says; where its tensor bytes start inside it is predicted, not fetched: ``torch.save`` writes
  the same zip structure around any data of one shape and dtype, so the record of a contiguous
  box is ``head + raw bytes + tail``, with ``head`` and ``tail`` a function of (shape, dtype)
  (:func:`_template`: written once per distinct pair under ``torch.serialization.skip_data``,
  no bytes touched; shardbridge's writer leaves the zip CRC32 fields at 0, as the template does);
- the prediction is checked, never trusted: the record's own head, streamed before its data,
  must equal the template byte for byte (its pickle then IS the template's: nothing of the
  file is unpickled at all), and its tail, streamed after the data, too. A record that
  differs (another torch's or writer's format, a non-contiguous or offset storage, a CRC32
  written, damage) is read whole from the stream and ``torch.load``-ed with
  ``weights_only=True``, DCP's own way (:func:`_whole`); one whose tail alone differs is read
  again whole (its bytes already went to the targets and are overwritten);
- the raw bytes go into a target directly when it is a contiguous host tensor of the record's
  dtype that takes whole rows, else through a bounded buffer (``_BUFFER_BYTES``) of rows copied
  into the strided, narrower, other-dtype or device targets: a load into another layout takes
  the parts of a box it needs; the rows nobody wants are skipped (a seek on local disk unless
  the stream hashes, else read and dropped);
- on an object store, a rank that does not hash the file asks only for what it wants: each
  record's head, the rows it needs and its tail, one ranged GET per run of them with gaps of at
  most a few MB read through (:func:`plan_ranges`, :class:`Ranges`); requests grow with the files
  and the bytes skipped, never with the records;
- a :class:`Stream` given a digest hashes every byte that passes, in the order of the file, in
  pieces of ``_PIECE`` bytes right after they land (still in the cache): with the whole file
  streamed, that is its xxh3_128 checksum, computed in the pass that fills the tensors
  ([Note: verifying while reading] in ``_reader.py``).

Only ``weights_only`` unpickling runs, and only for records that differ from the template (see
[Note: untrusted checkpoints] in ``_trust.py``); every read is bounded by the record's length.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Union

import torch

from shardbridge._compat import torch_save_without_crc

if TYPE_CHECKING:
    from shardbridge.checkpoint.storage._backend import Backend

__all__ = [
    "EXPORT_IN_PLACE_MIN_BYTES",
    "BoxSource",
    "Ranges",
    "Record",
    "RecordError",
    "Stream",
    "plan_ranges",
    "read_box_into",
    "read_records",
]

BoxSource = Union[str, "os.PathLike[str]", "tuple[Backend, str]"]
"""Where a record lives: a local file, or ``(backend, path)`` (an object on an object store)."""
EXPORT_IN_PLACE_MIN_BYTES = 0
"""Smallest record export reads with :func:`read_box_into`: every one (memory, not speed, is what
export bounds; with 1 MB here a 4-rank export peaked 1.0x the largest tensor + 16 MB instead of + 6 MB)."""
_BUFFER_BYTES = 8 << 20
"""Rows buffered at a time for targets the bytes cannot land in directly."""
_PIECE = 4 << 20
"""Bytes read into a target before they are hashed (still in the cache when hashed)."""


class Stream:
    """Sequential reads of ``[start, end)`` of one file or object, each byte hashed on the way.

    Args:
        raw: a binary reader positioned at ``start`` (``readinto`` -> bytes read, 0 at the end),
            e.g. from :meth:`Backend.stream`.
        start: where ``raw`` starts, in the file.
        end: where the stream ends.
        digest: an ``xxhash`` object fed every byte (None: nothing hashed).
        seek: ``raw`` seeks cheaply (a local file): bytes skipped without a digest are not read.
    """

    def __init__(self, raw: Any, start: int, end: int, *, digest: Any = None, seek: bool = False) -> None:
        self._raw, self.pos, self.end, self._digest = raw, start, end, digest
        self._seek = seek and digest is None
        self._at = start  # where ``raw`` is: a skip by seeking moves ``pos`` only, ``raw`` at the next read
        self._scratch: memoryview | None = None

    @property
    def hashing(self) -> bool:
        """Whether every byte passing is hashed."""
        return self._digest is not None

    def covers(self, n: int) -> bool:
        """Whether the next ``n`` bytes can be read (a :class:`Ranges` reader leaves holes)."""
        covers = getattr(self._raw, "covers", None)
        return self.pos + n <= self.end and (covers is None or covers(self.pos, self.pos + n))

    def readinto(self, out: Any) -> None:
        """Fill ``out`` (a writable buffer) exactly; ValueError if the stream ends first."""
        view = memoryview(out).cast("B")
        if self.pos + len(view) > self.end:
            raise ValueError(f"read of {len(view)} bytes at {self.pos} runs past the end of the stream ({self.end})")
        if self._at != self.pos:
            self._raw.seek(self.pos)
        for first in range(0, len(view), _PIECE):
            piece = view[first : first + _PIECE]
            done = 0
            while done < len(piece):
                n = self._raw.readinto(piece[done:])
                if not n:
                    raise ValueError(f"the file ends at {self.pos + first + done}, before byte {self.end} (truncated?)")
                done += n
            if self._digest is not None:
                self._digest.update(piece)
        self.pos += len(view)
        self._at = self.pos

    def read(self, n: int) -> bytes:
        """The next ``n`` bytes."""
        out = bytearray(n)
        self.readinto(out)
        return bytes(out)

    def skip(self, n: int) -> None:
        """Pass over ``n`` bytes (read and hashed when there is a digest or ``raw`` cannot seek)."""
        if n <= 0:
            return
        if self._seek:
            self.pos += n
            return
        if self._scratch is None:
            self._scratch = memoryview(bytearray(min(_BUFFER_BYTES, max(n, 1 << 16))))
        while n > 0:
            step = min(n, len(self._scratch))
            self.readinto(self._scratch[:step])
            n -= step


class Ranges:
    """One reader over several ranges of an object, each read as a stream of its own (one request).

    ``open_range(start, end)``: a context manager giving a reader of that range (e.g.
    :meth:`Backend.stream`). ``seek`` moves forward only: inside a range by reading and dropping
    the bytes between (a gap the plan found cheaper to read than to ask for again), to a later
    range by closing this one and opening that. See :func:`plan_ranges`.
    """

    def __init__(self, open_range: Callable[[int, int], Any], ranges: list[tuple[int, int]]) -> None:
        self._open, self._ranges = open_range, ranges
        self._at = -1
        self._pos = ranges[0][0] if ranges else 0
        self._body: Any = None
        self._stack = contextlib.ExitStack()
        self._scratch = memoryview(bytearray(1 << 16))

    def __enter__(self) -> Ranges:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def covers(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` lies inside one range."""
        return any(a <= start and end <= b for a, b in self._ranges)

    def readinto(self, out: Any) -> int:
        if self._body is None or self._pos >= self._ranges[self._at][1]:
            following = self._at + 1
            if following >= len(self._ranges) or self._ranges[following][0] != self._pos:
                return 0  # a hole: the plan did not ask for these bytes
            self._switch(following, self._pos)
        view = memoryview(out).cast("B")[: self._ranges[self._at][1] - self._pos]
        n = self._body.readinto(view)
        self._pos += n
        return n

    def seek(self, pos: int) -> None:
        if self._body is not None and self._pos <= pos < self._ranges[self._at][1]:
            while self._pos < pos:  # a gap inside the range: read through it
                if not self.readinto(self._scratch[: min(len(self._scratch), pos - self._pos)]):
                    raise ValueError(f"the object ends at {self._pos}, before byte {pos}")
            return
        at = next((i for i, (a, b) in enumerate(self._ranges) if a <= pos < b and i > self._at), None)
        if at is None:
            raise AssertionError(f"byte {pos} is in no range of the plan {self._ranges}")
        self._switch(at, pos)

    def _switch(self, at: int, pos: int) -> None:
        self._stack.close()
        self._stack = contextlib.ExitStack()
        self._at, self._pos = at, pos
        self._body = self._stack.enter_context(self._open(pos, self._ranges[at][1]))


@dataclass
class Record:
    """One stored record of a file and what to do with it (see [Note: reading records in one pass]).

    A tensor record names its box (``sizes``, ``dtype``) and the targets that want it: ``wants``,
    ``(target, starts)`` each, ``target`` a view (of any strides, dtype or device) that receives
    the part of the box starting at ``starts`` with ``target``'s shape. A bytes item (no
    ``sizes``) is handed its bytes (``whole``). ``done`` runs once the targets are filled.
    """

    offset: int
    length: int
    sizes: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    wants: list[tuple[torch.Tensor, tuple[int, ...]]] = field(default_factory=list)
    whole: Callable[[bytes], None] | None = None
    done: Callable[[], None] | None = None
    key: Any = None
    """What the caller names the record by in errors (its item)."""
    tail: bool = True
    """Read and check the record's tail (False: :func:`plan_ranges` left it out of every range)."""


class RecordError(Exception):
    """A record that could not be read into its targets (:attr:`record`; the cause is chained)."""

    def __init__(self, record: Record, cause: BaseException) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.record, self.cause = record, cause


def plan_ranges(records: list[Record], gap: int) -> list[tuple[int, int]]:
    """The byte ranges of one file to fetch for ``records`` (sorted by offset), one request each.

    A record of the template ([Note: reading records in one pass]) needs its head, the rows of its
    data that some target wants, and its tail; any other record all of it. Those spans merge into
    one range where at most ``gap`` bytes lie between them (read and dropped: cheaper than a
    request), so a file whose wanted records lie together is one request, and a range of its own
    is only ever asked for where it saves more than ``gap`` bytes. A tail that would be a request
    of its own is left out (``record.tail`` = False: not checked; its head was).
    """
    spans: list[tuple[int, int, Record | None]] = []
    for record in records:
        template = _layout(record)
        end = record.offset + record.length
        if template is None or not record.wants:
            spans.append((record.offset, end, None))
            continue
        head_end = record.offset + len(template.head)
        rows = record.sizes[0] if record.sizes else 1
        row_bytes = template.nbytes // rows if rows else 0
        first = min((s[0] if s else 0) for _, s in record.wants)
        last = max((s[0] + t.shape[0]) if s else 1 for t, s in record.wants)
        spans.append((record.offset, head_end, None))
        if last > first and row_bytes:
            spans.append((head_end + first * row_bytes, head_end + last * row_bytes, None))
        spans.append((end - len(template.tail), end, record))
    ranges: list[list[int]] = []
    for i, (start, end, tail_of) in enumerate(spans):
        joins = bool(ranges) and start - ranges[-1][1] <= gap
        if tail_of is not None and not joins:
            following = spans[i + 1][0] if i + 1 < len(spans) else None
            if following is None or following - end > gap:
                tail_of.tail = False  # a request for the tail alone: not worth it
                continue
        if joins:
            ranges[-1][1] = max(ranges[-1][1], end)
        else:
            ranges.append([start, end])
    return [(a, b) for a, b in ranges]


def _layout(record: Record) -> _Template | None:
    """The template of a tensor record whose length is the template's; else None (read it whole)."""
    if record.sizes is None or record.dtype is None or record.whole is not None or _misfit(record) is not None:
        return None
    template = _template(record.sizes, record.dtype)
    if template is None or len(template.head) + template.nbytes + len(template.tail) != record.length:
        return None
    return template


def read_records(
    stream: Stream, records: list[Record], *, reread: Callable[[int, int], bytes] | None = None
) -> list[RecordError]:
    """Every record (sorted by offset, inside the stream) into its targets, in one pass of ``stream``.

    ``reread(offset, length)``: a record's bytes read again (for one whose tail differs from the
    template after its data went to the targets); None reads nothing again (the record fails).
    Returns the records that failed (their stream bytes consumed: the pass goes on, so that a
    digest still sees the whole file) when the stream hashes; otherwise the first failure is
    raised. I/O errors and a stream that ends early are raised at once.
    """
    failed: list[RecordError] = []
    for record in records:
        stream.skip(record.offset - stream.pos)
        if stream.pos != record.offset:
            raise AssertionError(f"records overlap at {record.offset} (stream at {stream.pos})")
        try:
            _read_record(stream, record, reread)
        except RecordError as exc:
            if not stream.hashing:
                raise
            failed.append(exc)
    return failed


def _read_record(stream: Stream, record: Record, reread: Callable[[int, int], bytes] | None) -> None:
    misfit = _misfit(record)
    if misfit is not None:
        stream.skip(record.length)
        _settle(record, lambda: _raise(ValueError(misfit)))
        return
    template = _layout(record)
    if template is None:
        data = stream.read(record.length)
        _settle(record, lambda: _whole(data, record))
        return
    head = stream.read(len(template.head))
    if head != template.head:  # not the template's record: torch.load it whole
        rest = record.length - len(head)
        if stream.covers(rest):
            data = head + stream.read(rest)
            _settle(record, lambda: _whole(data, record))
        else:  # the plan fetched only parts of it
            _settle(record, lambda: _whole(_again(record, reread), record))
        return
    _fill(stream, template.nbytes, record)
    if not record.tail or stream.read(len(template.tail)) == template.tail:
        _settle(record, lambda: None)
        return
    # The head was torch's but the tail is not: the central directory torch.load would follow may
    # place the data elsewhere. Read the record again and take what torch.load takes.
    _settle(record, lambda: _whole(_again(record, reread), record))


def _again(record: Record, reread: Callable[[int, int], bytes] | None) -> bytes:
    if reread is None:
        raise ValueError(f"the record at {record.offset} must be read again and cannot be")
    return reread(record.offset, record.length)


def _misfit(record: Record) -> str | None:
    """Why a target does not fit inside the record's box (None: every one does)."""
    if record.sizes is None:
        return None
    for target, starts in record.wants:
        inside = all(0 <= o and o + n <= s for o, n, s in zip(starts, target.shape, record.sizes))
        if not (len(starts) == target.dim() == len(record.sizes) and inside):
            return f"a part of shape {tuple(target.shape)} at {starts} is not inside the stored box {record.sizes}"
    return None


def _settle(record: Record, fill: Callable[[], None]) -> None:
    try:
        fill()
        if record.done is not None:
            record.done()
    except Exception as exc:  # noqa: BLE001 (the caller decides: raise now, or after the file's checksum)
        raise RecordError(record, exc) from exc


def _raise(exc: Exception) -> None:
    raise exc


def _fill(stream: Stream, nbytes: int, record: Record) -> None:
    """The record's raw tensor bytes (the stream at their start) into its targets."""
    assert record.sizes is not None and record.dtype is not None
    sizes, dtype = record.sizes, record.dtype
    wants = record.wants
    if not sizes:  # a 0-d tensor: one row of one element
        sizes, wants = (1,), [(t.reshape(1), (0,)) for t, _ in wants]
    rows = sizes[0]
    if rows == 0 or nbytes == 0:
        stream.skip(nbytes)
        return
    row_bytes = nbytes // rows
    cuts = {0, rows}
    for target, starts in wants:
        cuts.update((starts[0], starts[0] + target.shape[0]))
    cuts_sorted = sorted(c for c in cuts if 0 <= c <= rows)
    buffer: torch.Tensor | None = None
    for a, b in zip(cuts_sorted, cuts_sorted[1:]):
        covering = [(t, s) for t, s in wants if s[0] <= a and b <= s[0] + t.shape[0]]
        if not covering:
            stream.skip((b - a) * row_bytes)
            continue
        target, starts = covering[0]
        if len(covering) == 1 and _direct(target, starts, sizes, dtype):
            stream.readinto(_bytes(target[a - starts[0] : b - starts[0]]))
            continue
        step = max(1, _BUFFER_BYTES // row_bytes)
        for first in range(a, b, step):
            count = min(step, b - first)
            if buffer is None or buffer.shape[0] < count:
                buffer = torch.empty((min(step, b - a), *sizes[1:]), dtype=dtype)
            rows_in = buffer[:count]
            stream.readinto(_bytes(rows_in))
            for target, starts in covering:
                inner = tuple(slice(o, o + n) for o, n in zip(starts[1:], target.shape[1:]))
                target[first - starts[0] : first - starts[0] + count].copy_(rows_in[(slice(None), *inner)])


def _direct(target: torch.Tensor, starts: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether rows of the record land in ``target`` as they are: whole rows, same dtype, contiguous host memory."""
    return (
        target.dtype == dtype
        and target.device.type == "cpu"
        and target.is_contiguous()
        and tuple(target.shape[1:]) == tuple(sizes[1:])
        and not any(starts[1:])
    )


def _bytes(tensor: torch.Tensor) -> Any:
    """The bytes of a contiguous host tensor, writable."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _whole(data: bytes, record: Record) -> None:
    """A record that is not the template's: ``torch.load(weights_only=True)``, then into its targets."""
    if record.whole is not None:
        record.whole(data)
        return
    tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    if type(tensor) is not torch.Tensor:
        raise ValueError(f"the record holds a {type(tensor).__name__}, not a tensor")
    if record.sizes is not None and tuple(tensor.shape) != tuple(record.sizes):
        raise ValueError(f"the record holds a tensor of shape {tuple(tensor.shape)}, not {record.sizes}")
    for target, starts in record.wants:
        if tensor.dim() != target.dim() or any(o + n > s for o, n, s in zip(starts, target.shape, tensor.shape)):
            raise ValueError(f"the record's tensor of shape {tuple(tensor.shape)} does not hold the box asked for")
        target.copy_(tensor[tuple(slice(o, o + n) for o, n in zip(starts, target.shape))])


@dataclass(frozen=True)
class _Template:
    """A ``torch.save`` record of one shape and dtype, around its raw bytes."""

    head: bytes
    nbytes: int
    tail: bytes


class _Capture(io.RawIOBase):
    """A seekable sink keeping what is written as runs of bytes (``skip_data`` seeks over the data:
    nothing is kept, or allocated, for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: list[tuple[int, bytearray]] = []
        self.pos = self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        last = self.runs[-1] if self.runs else None
        if last is not None and last[0] + len(last[1]) == self.pos:
            last[1].extend(view)
        else:
            assert self.pos >= self.end, "torch's writer wrote back into what it wrote"
            self.runs.append((self.pos, bytearray(view)))
        self.pos += len(view)
        self.end = max(self.end, self.pos)
        return len(view)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self.pos = offset if whence == io.SEEK_SET else self.pos + offset if whence == io.SEEK_CUR else self.end + offset
        return self.pos

    def tell(self) -> int:
        return self.pos


@functools.lru_cache(maxsize=4096)
def _template(sizes: tuple[int, ...], dtype: torch.dtype) -> _Template | None:
    """What shardbridge's writer puts around the raw bytes of a contiguous box (None: not predictable)."""
    sink = _Capture()
    with torch.serialization.skip_data():
        torch_save_without_crc(torch.empty(sizes, dtype=dtype), sink)
    nbytes = math.prod(sizes) * dtype.itemsize
    if nbytes and len(sink.runs) == 2 and sink.runs[1][0] - len(sink.runs[0][1]) == nbytes:
        return _Template(bytes(sink.runs[0][1]), nbytes, bytes(sink.runs[1][1]))  # the data: the one run skipped
    return None  # an empty box (no data to find the start of), or not what torch writes today: read whole


@contextlib.contextmanager
def _opened(source: BoxSource, start: int, end: int) -> Iterator[Stream]:
    if isinstance(source, tuple):
        backend, path = source
        with backend.stream(path, start, end) as raw:
            yield Stream(raw, start, end, seek=not backend.remote)
        return
    with open(source, "rb", buffering=0) as f:
        f.seek(start)
        yield Stream(f, start, end, seek=True)


def read_box_into(
    source: BoxSource, offset: int, length: int, target: torch.Tensor, box_offsets: tuple[int, ...] | None = None
) -> bool:
    """Fill ``target`` from the record at ``source[offset:offset+length]`` (one stream).

    ``target`` receives the part of the stored box that starts at ``box_offsets`` (None: the
    whole box, which then has ``target``'s shape and dtype) and has ``target``'s shape. Returns
    False (``target`` possibly written, to be overwritten by the caller's fallback) when the
    record cannot fill it: a part that is not inside the box, a record that does not read.
    """
    record = Record(offset, length, wants=[(target, tuple(box_offsets or (0,) * target.dim()))])
    if box_offsets is None:
        record.sizes, record.dtype = tuple(target.shape), target.dtype
    try:
        with _opened(source, offset, offset + length) as stream:
            read_records(stream, [record])
    except (RecordError, ValueError):
        return False
    return True
