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
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

from shardbridge._compat import DCPStorageInfo
from shardbridge.checkpoint.storage._files import DATA_FILE_PATTERN

__all__ = ["Records", "StorageGroup", "check_records", "read_streamed", "write_metadata"]

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


def _shell(head: Metadata) -> tuple[bytes, int]:
    """The pickle of ``head`` with an empty ``storage_data`` last in its state, and its memo size.

    The stream ends ``... 'storage_data' EMPTY_DICT BINPUT|LONG_BINPUT <slot> SETITEMS BUILD STOP``:
    the records go in before the final ``SETITEMS``. The same bytes for the same head, so a reader
    can tell that a stream's head is exactly this (see [Note: reading a streamed .metadata]).
    """
    shell = Metadata(
        state_dict_metadata=head.state_dict_metadata,
        planner_data=head.planner_data,
        storage_meta=head.storage_meta,
        version=head.version,
    )
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


# --------------------------------------------------------------------------- reading

# [Note: reading a streamed .metadata]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The restricted reader (``_trust.py``) runs Python's pure-Python unpickler: ~35 opcodes per
# record, minutes for the millions of records of a large job. A ``.metadata`` in EXACTLY the shape
# :func:`write_metadata` writes is read faster, without trusting it:
#
# - the head (the entries' descriptions) goes through the restricted unpickler as always, its
#   structure is checked (``validate_head``: the restricted reader's own check), and re-pickled: the
#   stream's head must be byte for byte what :func:`_shell` writes for it. So the stream is at the
#   point where the records go in (``'storage_data' {}`` on the stack), whatever the bytes before;
# - the definitions are parsed one by one: only the three admitted classes and strings, in memo
#   slots that continue the head's without a gap (so no slot number sizes an allocation);
# - each batch's records must match ONE template byte for byte outside its integer fields (checked
#   for every row at once); every integer is then checked as the structural check checks it
#   (:func:`check_records`).
#
# The objects built are those the unpickler would build. Anything that deviates -- a byte, a
# class, a slot, an unknown name, a count, any exception -- returns None, and the caller reads the
# file with the restricted unpickler, which names the problem. So the fast path changes how long a
# valid file takes, never what is accepted (``tests/checkpoint/test_metadata_stream.py`` compares
# the two verdicts on mutated files).


class _Deviates(Exception):
    """Not in :func:`write_metadata`'s shape: read it with the restricted unpickler."""


_DEFINITIONS_START = _global(MetadataIndex) + b"r"
_KEYS = ("fqn", "index", "offset", "relative_path", "length")


@dataclass
class Records:
    """The storage records of a streamed ``.metadata`` as columns (what :func:`check_records` checks)."""

    fqn: list[str]
    """Per entry that has records, its name; ``entry`` indexes this list."""
    entry: torch.Tensor
    index: torch.Tensor
    """The chunk each record stores (-1: a bytes item)."""
    name: torch.Tensor
    names: list[str]
    offset: torch.Tensor
    length: torch.Tensor


def _int(data: bytes, at: int, width: int, signed: bool = True) -> int:
    return int.from_bytes(data[at : at + width], "little", signed=signed)


def _definitions(data: bytes, at: int, first_slot: int) -> tuple[list[object], int]:
    """The memo definitions ``write_metadata`` writes, in slots ``first_slot``, ``first_slot + 1``, ..."""
    admitted = {
        (MetadataIndex.__module__, MetadataIndex.__qualname__): MetadataIndex,
        (DCPStorageInfo.__module__, DCPStorageInfo.__qualname__): DCPStorageInfo,
        ("torch", "Size"): torch.Size,
    }
    defs: list[object] = []
    while at < len(data) and data[at] in b"cX":
        if data[at] == ord("c"):
            end1 = data.index(b"\n", at + 1)
            end2 = data.index(b"\n", end1 + 1)
            key = (data[at + 1 : end1].decode("ascii"), data[end1 + 1 : end2].decode("ascii"))
            if key not in admitted:
                raise _Deviates
            value: object = admitted[key]
            at = end2 + 1
        else:
            n = _int(data, at + 1, 4, signed=False)
            if at + 5 + n > len(data):
                raise _Deviates
            value = data[at + 5 : at + 5 + n].decode("utf-8", "surrogatepass")
            at += 5 + n
        if data[at : at + 1] != b"r" or data[at + 5 : at + 6] != b"0":
            raise _Deviates
        if _int(data, at + 1, 4, signed=False) != first_slot + len(defs):
            raise _Deviates
        defs.append(value)
        at += 6
    return defs, at


def _first_record(data: bytes, at: int, refs: dict[object, bytes]) -> tuple[int, list[tuple[str, int, int, bool]], int | None, bool]:
    """The template of the record at ``at``: (length, fields (name, position, width, signed), offset dims, index or not)."""
    start, fields = at, []

    def expect(b: bytes) -> None:
        nonlocal at
        if data[at : at + len(b)] != b:
            raise _Deviates
        at += len(b)

    def field(name: str) -> None:
        nonlocal at
        if data[at : at + 1] == b"J":
            fields.append((name, at + 1 - start, 4, True))
            at += 5
        elif data[at : at + 2] == b"\x8a\x08":
            fields.append((name, at + 2 - start, 8, True))
            at += 10
        else:
            raise _Deviates

    def ref_field(name: str) -> None:
        nonlocal at
        expect(b"j")
        fields.append((name, at - start, 4, False))
        at += 4

    expect(refs[MetadataIndex] + b")\x81}(" + refs["fqn"])
    ref_field("fqn")
    expect(refs["index"])
    with_index = data[at : at + 1] != b"N"
    if with_index:
        field("index")
    else:
        at += 1
    ndim = None
    if data[at : at + 5] == refs["offset"]:
        expect(refs["offset"] + refs[torch.Size] + b"(")
        ndim = 0
        while data[at : at + 1] in (b"J", b"\x8a"):
            field(f"o{ndim}")
            ndim += 1
        expect(b"t\x85R")
    expect(b"ub" + refs[DCPStorageInfo] + b")\x81}(" + refs["relative_path"])
    ref_field("name")
    expect(refs["offset"])
    field("offset")
    expect(refs["length"])
    field("length")
    expect(b"ub")
    return at - start, fields, ndim, with_index


def read_streamed(
    data: bytes, load_head: Callable[[bytes], object], validate_head: Callable[[Metadata], None]
) -> tuple[Metadata, Records] | None:
    """``data`` read as :func:`write_metadata` writes it, or None (not in that shape: read it with the
    restricted unpickler). ``load_head`` is the restricted unpickler, ``validate_head`` its structural
    check of the entries' descriptions. See [Note: reading a streamed .metadata]."""
    try:
        return _read_streamed(data, load_head, validate_head)
    except Exception:  # noqa: BLE001 (any deviation: the restricted reader reads it and names the problem)
        return None


def _read_streamed(
    data: bytes, load_head: Callable[[bytes], object], validate_head: Callable[[Metadata], None]
) -> tuple[Metadata, Records]:
    at = data.find(_DEFINITIONS_START)
    if at < 0:
        raise _Deviates
    head = load_head(data[:at] + b"ub.")
    if type(head) is not Metadata or type(head.storage_data) is not dict or head.storage_data:
        raise _Deviates
    validate_head(head)  # the restricted reader's check of every description
    canonical, memo_size = _shell(head)
    if canonical != data[:at] + b"ub.":  # the head is exactly what write_metadata writes for it
        raise _Deviates
    defs, at = _definitions(data, at, memo_size)
    refs: dict[object, bytes] = {}
    for k, value in enumerate(defs[:8]):  # MetadataIndex, _StorageInfo, torch.Size, then the keys
        refs[value if isinstance(value, type) else value] = b"j" + struct.pack("<I", memo_size + k)
    if defs[:8] != [MetadataIndex, DCPStorageInfo, torch.Size, *_KEYS]:
        raise _Deviates
    described = head.state_dict_metadata
    storage: dict[MetadataIndex, object] = {}
    parts: dict[str, list[torch.Tensor]] = {k: [] for k in ("entry", "index", "name", "offset", "length")}
    fqns: list[str] = []
    fqn_at: dict[int, int] = {}  # definition -> position in fqns
    names: list[str] = []
    name_at = torch.full((len(defs),), -1, dtype=torch.int64)  # definition -> position in names
    while data[at : at + 3] != b"ub.":
        if data[at : at + 1] != b"J" or data[at + 5 : at + 7] != b"0(":
            raise _Deviates
        count = _int(data, at + 1, 4)
        at += 7
        size, fields, ndim, with_index = _first_record(data, at, refs)
        end = at + count * size
        if count <= 0 or end >= len(data) or data[end : end + 1] != b"u":
            raise _Deviates
        rows = torch.frombuffer(bytearray(data[at:end]), dtype=torch.uint8).view(count, size)
        fixed = torch.ones(size, dtype=torch.bool)
        for _, pos, width, _ in fields:
            fixed[pos : pos + width] = False
        if not bool((rows[:, fixed] == rows[0, fixed]).all()):
            raise _Deviates
        value = {}
        for name, pos, width, signed in fields:
            raw = torch.empty(count, width, dtype=torch.uint8).copy_(rows[:, pos : pos + width])  # aligned
            column = raw.view(torch.int32 if width == 4 else torch.int64).flatten().to(torch.int64)
            value[name] = column if signed else column & 0xFFFFFFFF
        batch = _Batch(value, ndim, with_index, memo_size)
        batch.build(defs, described, storage, parts, fqns, fqn_at, names, name_at)
        at = end + 1
    if at + 3 != len(data):
        raise _Deviates
    head.storage_data = storage

    def column(key: str) -> torch.Tensor:
        return torch.cat(parts[key]) if parts[key] else torch.empty(0, dtype=torch.int64)

    records = Records(fqns, column("entry"), column("index"), column("name"), names, column("offset"), column("length"))
    return head, records


@dataclass
class _Batch:
    """One batch's integer columns (``fqn`` / ``name``: memo slots) and its template's kind."""

    value: dict[str, torch.Tensor]
    ndim: int | None
    with_index: bool
    first_slot: int

    def build(
        self,
        defs: list[object],
        described: dict,
        storage: dict,
        parts: dict[str, list[torch.Tensor]],
        fqns: list[str],
        fqn_at: dict[int, int],
        names: list[str],
        name_at: torch.Tensor,
    ) -> None:
        """The batch's records as DCP's objects, each offset the described chunk's own ``torch.Size``."""
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

        v, ndim = self.value, self.ndim
        fqn_def, name_def = v["fqn"] - self.first_slot, v["name"] - self.first_slot
        if bool(((fqn_def < 8) | (fqn_def >= len(defs)) | (name_def < 8) | (name_def >= len(defs))).any()):
            raise _Deviates
        for d in torch.unique(name_def).tolist():  # every name a string definition
            if int(name_at[d]) < 0:
                if not isinstance(defs[d], str):
                    raise _Deviates
                name_at[d] = len(names)
                names.append(defs[d])
        # rows grouped by entry (one sort), each entry's rows checked against its chunks at once
        order = torch.sort(fqn_def, stable=True).indices
        groups, counts = torch.unique_consecutive(fqn_def[order], return_counts=True)
        entry_col = torch.empty_like(fqn_def)
        index_col = v["index"] if self.with_index else torch.full_like(fqn_def, -1)
        start = 0
        for d, n in zip(groups.tolist(), counts.tolist()):
            rows = order[start : start + n]
            start += n
            fqn = defs[d]
            entry = described.get(fqn) if isinstance(fqn, str) else None
            if entry is None:
                raise _Deviates
            if d not in fqn_at:
                fqn_at[d] = len(fqns)
                fqns.append(fqn)
            entry_col[rows] = fqn_at[d]
            if ndim is None:
                if type(entry) is not BytesStorageMetadata or self.with_index:
                    raise _Deviates
                continue
            if type(entry) is not TensorStorageMetadata or len(entry.size) != ndim or not self.with_index:
                raise _Deviates
            index = v["index"][rows]
            if int(index.min()) < 0 or int(index.max()) >= len(entry.chunks):
                raise _Deviates
            offsets = torch.stack([v[f"o{k}"][rows] for k in range(ndim)], 1) if ndim else index.new_zeros(n, 0)
            if not bool((_chunk_offsets(entry.chunks, ndim)[index] == offsets).all()):
                raise _Deviates
        path = [names[i] for i in name_at[name_def].tolist()]
        keys, idx = fqn_def.tolist(), index_col.tolist()
        where, length = v["offset"].tolist(), v["length"].tolist()
        new_index, new_info = MetadataIndex.__new__, DCPStorageInfo.__new__
        chunks_of = {d: described[defs[d]].chunks for d in set(keys)} if ndim is not None else {}
        for k, d in enumerate(keys):
            mi = new_index(MetadataIndex)  # frozen: its __dict__ is filled, as unpickling does
            if ndim is None:
                mi.__dict__.update({"fqn": defs[d], "index": None})
            else:
                mi.__dict__.update({"fqn": defs[d], "index": idx[k], "offset": chunks_of[d][idx[k]].offsets})
            info = new_info(DCPStorageInfo)
            info.__dict__ = {"relative_path": path[k], "offset": where[k], "length": length[k]}
            storage[mi] = info
        parts["entry"].append(entry_col)
        parts["index"].append(index_col)
        parts["name"].append(name_at[name_def])
        parts["offset"].append(v["offset"])
        parts["length"].append(v["length"])


def _chunk_offsets(chunks: list, ndim: int) -> torch.Tensor:
    hit = _OFFSETS_OF.get(id(chunks))
    if hit is None or hit[0] is not chunks:
        table = torch.tensor([list(c.offsets) for c in chunks], dtype=torch.int64).reshape(len(chunks), ndim)
        if len(_OFFSETS_OF) > 4096:
            _OFFSETS_OF.clear()
        hit = _OFFSETS_OF[id(chunks)] = (chunks, table)
    return hit[1]


_OFFSETS_OF: dict[int, tuple[list, torch.Tensor]] = {}


def check_records(md: Metadata, records: Records, file_sizes: Callable[[], dict[str, int]] | None) -> bool:
    """The structural check of ``_trust.py`` on :func:`read_streamed`'s records, as tensor operations.

    True when every record lives in a ``.distcp`` file of this directory, at an offset >= 0 and
    at least as long as its chunk's raw bytes; every chunk of every tensor and every bytes item
    has exactly one record; records of one file do not overlap; and (``file_sizes``: the data
    files' sizes) each lies inside its file. False sends the caller to the restricted reader,
    which names the problem.
    """
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if any(not DATA_FILE_PATTERN.fullmatch(n) or n.startswith("..") for n in records.names):
        return False
    if bool((records.offset < 0).any()) or bool((records.length < 0).any()):
        return False
    described = md.state_dict_metadata
    if set(records.fqn) != set(described):
        return False
    base, raw = [], []
    total = 0
    for fqn in records.fqn:
        entry = described[fqn]
        base.append(total)
        if type(entry) is TensorStorageMetadata:
            if not _distinct_offsets(entry.chunks):  # two chunks at one offset: one record could not tell them apart
                return False
            sizes = _chunk_bytes(entry.chunks, entry.properties.dtype)
            raw.append(sizes)
            total += len(sizes)
        else:
            raw.append(torch.zeros(1, dtype=torch.int64))
            total += 1
    slot = torch.tensor(base, dtype=torch.int64)[records.entry] + torch.clamp(records.index, min=0)
    if not bool((torch.bincount(slot, minlength=total) == 1).all()):
        return False
    if not bool((torch.cat(raw)[slot] <= records.length).all()):
        return False
    order = torch.sort(records.offset, stable=True).indices
    order = order[torch.sort(records.name[order], stable=True).indices]
    name, offset, length = records.name[order], records.offset[order], records.length[order]
    same = name[1:] == name[:-1]
    if bool((same & (offset[1:] < offset[:-1] + length[:-1])).any()):
        return False
    if file_sizes is not None:
        ends = torch.zeros(len(records.names), dtype=torch.int64).scatter_reduce_(0, name, offset + length, "amax")
        sizes = file_sizes()
        for n, end in zip(records.names, ends.tolist()):
            if n not in sizes or end > sizes[n]:
                return False
    return True


def _chunk_bytes(chunks: list, dtype: torch.dtype) -> torch.Tensor:
    hit = _BYTES_OF.get((id(chunks), dtype))
    if hit is None or hit[0] is not chunks:
        table = torch.tensor([math.prod(c.sizes) * dtype.itemsize for c in chunks], dtype=torch.int64)
        if len(_BYTES_OF) > 4096:
            _BYTES_OF.clear()
        hit = _BYTES_OF[(id(chunks), dtype)] = (chunks, table)
    return hit[1]


_BYTES_OF: dict[tuple[int, torch.dtype], tuple[list, torch.Tensor]] = {}


def _distinct_offsets(chunks: list) -> bool:
    hit = _DISTINCT.get(id(chunks))
    if hit is None or hit[0] is not chunks:
        if len(_DISTINCT) > 4096:
            _DISTINCT.clear()
        hit = _DISTINCT[id(chunks)] = (chunks, len({tuple(c.offsets) for c in chunks}) == len(chunks))
    return hit[1]


_DISTINCT: dict[int, tuple[list, bool]] = {}
