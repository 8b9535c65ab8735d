"""``.metadata`` written as a stream: millions of storage records without millions of Python objects.

[Note: streamed .metadata]
~~~~~~~~~~~~~~~~~~~~~~~~~~
``.metadata`` is a pickle of DCP's ``Metadata``; its ``storage_data`` maps a ``MetadataIndex``
per box to a ``_StorageInfo`` (file, offset, length). A Llama-3 405B at 16,384 ranks
(dp_replicate 16 x dp_shard 128 x tp 8) with AdamW state has ~2.8 million boxes: built as
objects and pickled, that is ~6 million dataclass instances (seconds and GBs on rank 0) for
every save. But the records of one entry differ only in a few integers, so this module writes
the pickle itself:

- everything but ``storage_data`` (the entries' descriptions, with chunk lists shared between
  entries of the same layout, planner data, storage meta, version) is pickled by the standard
  pickler (protocol 3: no frames), with ``storage_data`` an empty dict placed LAST in the
  object's state; the stream then ends ``... 'storage_data' {} SETITEMS BUILD STOP``;
- before the final ``SETITEMS``, the records are appended as ``MARK key value ... SETITEMS``
  batches into that empty dict, one batch per entry. Each record is a fixed byte template (the
  classes, keys, file names and the entry's name referenced through the pickle memo, the
  integers fixed-width: ``BININT`` / ``LONG1``) filled for all rows of an entry with a few
  tensor operations.

What the stream unpickles to is exactly the ``Metadata`` DCP's own writer would pickle for the
same records (``MetadataIndex`` / ``_StorageInfo`` with the same state; ``tests/checkpoint/
test_metadata_stream.py`` compares them), so torch's ``dcp_to_torch_save``, DCP's readers and
shardbridge's restricted reader read it unchanged.

The bytes are a function of the VALUES written, not of which Python objects held them: the head
is rebuilt before it is pickled (:func:`_canonical`: every string interned, every object new but
the chunk lists the caller shares, one per layout), because the pickler writes a second
reference to one object as a memo lookup and two equal objects twice. So a derived load can
render the stream again from the manifest and compare it with the file byte for byte ([Note:
derived loads] in ``derived/_records.py``).
"""

from __future__ import annotations

import io
import pickle
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from shardbridge._compat import DCPStorageInfo

__all__ = ["StorageGroup", "write_metadata"]

_PROTOCOL = 3
_I4_MAX = (1 << 31) - 1


@dataclass
class StorageGroup:
    """The storage records of one entry: one row per box (or one bytes item)."""

    fqn: str
    offsets: torch.Tensor | None
    """``[rows, ndim]`` int64 global offsets; None = a bytes item (its index has no offset)."""
    index: torch.Tensor | None
    """``[rows]`` index hints (the chunk's position), or None (no hint)."""
    name: torch.Tensor
    """``[rows]`` positions in the names table of each record's file."""
    offset: torch.Tensor
    """``[rows]`` byte offset in the file."""
    length: torch.Tensor
    """``[rows]`` record length."""


def _global(cls: type) -> bytes:
    return b"c" + f"{cls.__module__}\n{cls.__qualname__}\n".encode()


def _string(text: str) -> bytes:
    data = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(data)) + data


class _Memo:
    """Memo slots after the standard pickler's: definitions (push, put, pop) and references."""

    def __init__(self, start: int) -> None:
        self.next = start
        self.slots: dict[object, int] = {}
        self.pending: list[bytes] = []
        """Definitions not yet written (:meth:`flush`)."""

    def define(self, key: object, push: bytes) -> int:
        slot = self.next
        self.next += 1
        self.pending.append(push + b"r" + struct.pack("<I", slot) + b"0")  # LONG_BINPUT, POP
        self.slots[key] = slot
        return slot

    def flush(self, out: Callable[[bytes], None]) -> None:
        out(b"".join(self.pending))
        self.pending.clear()

    def ref(self, key: object) -> bytes:
        return b"j" + struct.pack("<I", self.slots[key])  # LONG_BINGET


class _Template:
    """One record's bytes, with the positions of its variable fields."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.fields: list[tuple[str, int, int]] = []  # (name, position, width)
        self.size = 0

    def fixed(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)

    def field(self, name: str, opcode: bytes, width: int) -> None:
        self.fixed(opcode)
        self.fields.append((name, self.size, width))
        self.fixed(b"\0" * width)

    def render(self, values: dict[str, torch.Tensor], rows: int) -> torch.Tensor:
        base = torch.frombuffer(bytearray(b"".join(self.parts)), dtype=torch.uint8)
        out = base.repeat(rows, 1)
        for name, at, width in self.fields:
            dtype = torch.int32 if width == 4 else torch.int64
            column = torch.empty(rows, dtype=dtype).copy_(values[name])  # dense: a 1-row column may have any stride
            out[:, at : at + width] = column.view(torch.uint8).view(rows, width)
        return out


def _int_field(t: _Template, name: str, values: torch.Tensor) -> None:
    small = values.numel() == 0 or (int(values.min()) >= -_I4_MAX - 1 and int(values.max()) <= _I4_MAX)
    if small:
        t.field(name, b"J", 4)  # BININT
    else:
        t.field(name, b"\x8a\x08", 8)  # LONG1, 8 bytes


def _template(memo: _Memo, ndim: int | None, with_index: bool, columns: dict[str, torch.Tensor]) -> _Template:
    """The record template of every row of one kind (offset dims, index or not)."""
    t = _Template()
    # key: MetadataIndex(fqn, offset, index) -- NEWOBJ of the class, BUILD with its __dict__
    t.fixed(memo.ref(MetadataIndex) + b")\x81}(" + memo.ref("fqn"))
    t.field("fqn", b"j", 4)  # LONG_BINGET of the entry's name
    t.fixed(memo.ref("index"))
    if with_index:
        _int_field(t, "index", columns["index"])
    else:
        t.fixed(b"N")
    if ndim is not None:
        t.fixed(memo.ref("offset") + memo.ref(torch.Size) + b"(")
        for d in range(ndim):
            _int_field(t, f"o{d}", columns[f"o{d}"])
        t.fixed(b"t\x85R")  # TUPLE, TUPLE1, REDUCE: torch.Size((...,))
    t.fixed(b"ub")
    # value: _StorageInfo(relative_path, offset, length) -- its __getstate__ drops None fields
    t.fixed(memo.ref(DCPStorageInfo) + b")\x81}(" + memo.ref("relative_path"))
    t.field("name", b"j", 4)
    t.fixed(memo.ref("offset"))
    _int_field(t, "offset", columns["offset"])
    t.fixed(memo.ref("length"))
    _int_field(t, "length", columns["length"])
    t.fixed(b"ub")
    return t


_ROWS_PER_BATCH = 1 << 18
"""Records rendered at once (~25 MB of pickle): bounds the writer's memory at any size."""


def _intern(value: Any) -> Any:
    return sys.intern(value) if type(value) is str else value


def _canonical(head: Metadata) -> Metadata:
    """``head`` with every string interned and every object new, except the chunk lists ``head``
    shares between entries (one per layout): its pickle is then a function of its values."""
    described: dict[str, Any] = {}
    for key, entry in head.state_dict_metadata.items():
        if type(entry) is TensorStorageMetadata:
            p = entry.properties  # pin_memory is not kept: it says where a save staged, nothing a reader uses
            props = TensorProperties(p.dtype, p.layout, p.requires_grad, p.memory_format, pin_memory=False)
            entry = TensorStorageMetadata(props, torch.Size(entry.size), entry.chunks)
        else:
            entry = BytesStorageMetadata()
        described[_intern(key)] = entry
    planner = head.planner_data
    if isinstance(planner, dict):
        planner = {_intern(k): tuple(_intern(p) for p in v) for k, v in planner.items()}
    meta = head.storage_meta
    if meta is not None:
        meta = StorageMeta(_intern(meta.checkpoint_id), _intern(meta.save_id), _intern(meta.load_id),
                           [_intern(m) for m in meta.modules])  # fmt: skip
    return Metadata(state_dict_metadata=described, planner_data=planner, storage_meta=meta,
                    version=_intern(head.version))  # fmt: skip


def _shell(head: Metadata) -> tuple[bytes, int]:
    """The pickle of ``head`` (made canonical) with an empty ``storage_data`` last in its state, and its memo size.

    The stream ends ``... 'storage_data' EMPTY_DICT BINPUT|LONG_BINPUT <slot> SETITEMS BUILD STOP``:
    the records go in before the final ``SETITEMS``.
    """
    shell = _canonical(head)
    del shell.storage_data
    shell.storage_data = {}  # last in the pickled state: the stream ends with it on the stack
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=_PROTOCOL)
    pickler.dump(shell)
    data = buf.getvalue()
    body = data[:-3]
    assert data.endswith(b"ub.") and (body[-3:-1] == b"}q" or body[-6:-4] == b"}r"), data[-16:]
    return data, len(pickler.memo.copy())


def write_metadata(
    head: Metadata, names: Sequence[str], groups: Sequence[StorageGroup], write: Callable[[bytes], None]
) -> None:
    """Write the pickle of ``head`` with ``storage_data`` holding ``groups``' records. See [Note: streamed .metadata].

    Args:
        head: the metadata without storage records (its ``storage_data`` is ignored).
        names: the data file names the groups' ``name`` columns index.
        groups: the records, one group per entry (any order).
        write: receives the stream's bytes, in order.
    """
    data, memo_size = _shell(head)
    tail = b"ub."  # the state dict's last SETITEMS, BUILD, STOP
    write(data[: -len(tail)])
    memo = _Memo(memo_size)
    memo.define(MetadataIndex, _global(MetadataIndex))
    memo.define(DCPStorageInfo, _global(DCPStorageInfo))
    memo.define(torch.Size, b"ctorch\nSize\n")
    for key in ("fqn", "index", "offset", "relative_path", "length"):
        memo.define(key, _string(key))
    name_base = memo.next
    for name in names:
        memo.define(("name", name), _string(name))
    # Records of every entry of one kind are rendered together (a kind: offset dims, index or not)
    kinds: dict[tuple[int | None, bool], list[StorageGroup]] = {}
    for group in groups:
        if group.name.numel() == 0:
            continue
        if ("fqn", group.fqn) not in memo.slots:
            memo.define(("fqn", group.fqn), _string(group.fqn))
        ndim = None if group.offsets is None else int(group.offsets.shape[1])
        kinds.setdefault((ndim, group.index is not None), []).append(group)
    memo.flush(write)  # every definition, before the records that reference them
    for (ndim, with_index), members in kinds.items():
        counts = torch.tensor([g.name.numel() for g in members], dtype=torch.int64)
        slots = torch.tensor([memo.slots[("fqn", g.fqn)] for g in members], dtype=torch.int64)
        columns = {
            "fqn": torch.repeat_interleave(slots, counts),
            "name": torch.cat([g.name for g in members]) + name_base,
            "offset": torch.cat([g.offset for g in members]),
            "length": torch.cat([g.length for g in members]),
        }
        if with_index:
            columns["index"] = torch.cat([g.index for g in members if g.index is not None])
        if ndim is not None:
            offsets = torch.cat([g.offsets for g in members if g.offsets is not None])
            for d in range(ndim):
                columns[f"o{d}"] = offsets[:, d]
        template = _template(memo, ndim, with_index, columns)
        total = int(counts.sum())
        for start in range(0, total, _ROWS_PER_BATCH):
            stop = min(total, start + _ROWS_PER_BATCH)
            rows = template.render({k: v[start:stop] for k, v in columns.items()}, stop - start)
            write(b"J" + struct.pack("<i", stop - start) + b"0")  # the batch's row count, pushed and popped
            write(b"(")  # MARK
            write(memoryview(rows.numpy()).cast("B"))  # no copy
            write(b"u")  # SETITEMS into storage_data
    write(tail)
