"""The derived save protocol: no plan round, and a write round that carries only file records.

[Note: the derived protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The default save protocol ([Note: save protocols] in ``_protocol.py``). Per save, every rank:

1. in the save's argument round (which runs anyway): builds its local plan as DCP does, the
   spread of every entry ([Note: derived plans] in ``state/_spread.py``) and their digest; the
   round's all-reduce compares the digests (two more int64s);
2. keeps the items it writes by the writer rule (each box by one of its holders), writes them
   by the file rule ([Note: derived file layout] in ``storage/_files.py``), and checks that what
   it wrote is what the rules say;
3. in the write round: sends rank 0 its files' records (size, checksum) and whether step 2's
   check held -- a fixed-size message ([Note: fixed-size gather] in ``_dist.py``); rank 0 derives
   every rank's storage records, checks every file's size against them, writes ``.metadata``
   as a stream ([Note: streamed .metadata]) and commits; the outcome is broadcast.

Rounds per save: 4 collectives whatever the world size; bytes received per rank other than 0:
constant; rank 0 receives world x (one fixed-size message). Rank 0's work is the distinct boxes
``.metadata`` must list (tensor operations per entry, no Python object per box).

Where a rank's digest differs (not SPMD: pipeline stages, different models), an entry has no
spread (a framework's own boxes through a ``StateDictProvider``), or a rank's plan is not what
its spreads say, every rank falls back to the gathered rounds (:class:`~shardbridge.checkpoint.
_protocol.OwnRounds`) for this save, with the same result. Where a rank's records differ from the
file rule, that rank alone sends its records (the slow path of step 3).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor

from shardbridge._compat import DCPStorageInfo, DCPStoragePrefix
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.state._chunks import LocalChunks, SavePlanner
from shardbridge.checkpoint.state._recipes import (
    decode_grid,
    decode_properties,
    encode_grid,
    encode_properties,
    rebuild,
)
from shardbridge.checkpoint.state._repair import dtensor_spread
from shardbridge.checkpoint.state._spread import (
    NotDerivable,
    Spread,
    SpreadTable,
    matches_plan,
    spread_table,
    spreads_digest,
    writers,
)
from shardbridge.checkpoint.storage._coverage import coverage_fault
from shardbridge.checkpoint.storage._files import DATA_FILE_PATTERN, Rows, data_file_name, derive_rows, record_length
from shardbridge.checkpoint.storage._manifest import DERIVED_KEY
from shardbridge.checkpoint.storage._metadata_stream import StorageGroup
from shardbridge.checkpoint.storage._writer import RECORDS_KEY, RankFiles, Writer

if TYPE_CHECKING:
    from shardbridge.checkpoint._protocol import OwnRounds

__all__ = ["Derived", "DerivedLocal", "DerivedRecords", "Entry", "derive_load", "describe", "entry_spread"]

logger = logging.getLogger("shardbridge.checkpoint")


def entry_spread(value: Any, world_size: int) -> Spread | None:
    """The spread of one flattened state-dict value (None: not derivable)."""
    if isinstance(value, LocalChunks):
        return value.spread
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return None  # a sub-mesh this rank is not on: DCP writes nothing here
        return dtensor_spread(value, "dcp")
    if isinstance(value, torch.Tensor):
        return Spread.replicated(world_size, tuple(value.shape), TensorProperties.create_from_tensor(value))
    return Spread.replicated(world_size, (), None)


@dataclass
class Entry:
    """One flattened entry of the save, with its spread evaluated."""

    fqn: str
    spread: Spread
    table: SpreadTable
    writer: torch.Tensor
    """``[boxes]`` the rank writing each box."""
    properties: TensorProperties | None
    """None: a bytes item."""
    size: torch.Size | None


@dataclass
class DerivedLocal:
    """A rank's part of the argument round: its local plan and (when derivable) its entries."""

    plan: SavePlan
    entries: list[Entry] | None
    digest: int
    """Of every entry's name and spread; 0 when this rank cannot derive (see [Note: the derived protocol])."""
    gathered: Any = None
    """What the gathered protocol's local step returned (the fallback)."""


def _entries(planner: SavePlanner, plan: SavePlan, world_size: int) -> tuple[list[Entry] | None, int]:
    items: dict[str, list[Any]] = {}
    for item in plan.items:
        items.setdefault(item.index.fqn, []).append(item)
    values = planner.state_dict
    spreads = [(fqn, entry_spread(value, world_size)) for fqn, value in values.items()]
    digest = spreads_digest(spreads)
    if digest == 0:
        return None, 0
    rank = _dist.rank()
    out: list[Entry] = []
    by_fqn: dict[str, Spread] = {}
    try:
        for ordinal, (fqn, spread) in enumerate(spreads):
            assert spread is not None
            table = spread_table(spread)
            mine = items.get(fqn, [])
            is_bytes = spread.properties is None
            properties = spread.properties
            size = None if is_bytes else torch.Size(values[fqn].size())
            if mine and mine[0].tensor_data is not None:
                properties, size = mine[0].tensor_data.properties, mine[0].tensor_data.size
            out.append(Entry(fqn, spread, table, writers(table, ordinal, bytes_item=is_bytes), properties, size))
            by_fqn[fqn] = spread
    except Exception:  # noqa: BLE001 (NotDerivable, or any surprise: the gathered rounds save it right)
        return None, 0
    if not matches_plan(plan, by_fqn, lambda s: _coordinate(s, rank)):
        return None, 0
    return out, digest


_COORDS: dict[tuple[str, int], tuple[int, ...] | None] = {}


def _coordinate(spread: Spread, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinate on the spread's grid (None: not on it)."""
    grid = spread.grid
    key = (grid.digest, rank)
    if key not in _COORDS:
        hit = torch.nonzero(grid.ranks == rank).flatten()
        coordinate = None
        if hit.numel():
            flat, out = int(hit[0]), []
            for size in reversed(grid.shape):
                out.append(flat % size)
                flat //= size
            coordinate = tuple(reversed(out))
        if len(_COORDS) > 4096:
            _COORDS.clear()
        _COORDS[key] = coordinate
    return _COORDS[key]


@dataclass
class _Derivation:
    """Every rank's storage records, as the rules say (rank 0), or this rank's (the others)."""

    rows: Rows
    entry_rows: list[tuple[int, int]]
    """Per entry: (first row, number of rows) in ``rows``."""
    sizes: dict[tuple[int, int], int]
    """(writer, file number) -> the file's size."""
    only: int | None = None
    """The one writer whose rows these are (each entry's rows: its boxes of that writer, in order);
    None: every writer's (each entry's rows: all its boxes, row ``u`` for box ``u``)."""


def _nbytes_and_lengths(entry: Entry) -> tuple[torch.Tensor, torch.Tensor]:
    if entry.properties is None:
        n = len(entry.table.sizes)
        return torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    dtype = entry.properties.dtype
    cache = _LENGTHS.setdefault(id(entry.table), (entry.table, {}))[1]
    hit = cache.get(dtype)
    if hit is None:
        distinct: dict[tuple[int, ...], tuple[int, int]] = {}
        for sizes in entry.table.sizes:
            if sizes not in distinct:
                numel = 1
                for s in sizes:
                    numel *= s
                distinct[sizes] = (numel * dtype.itemsize, record_length(sizes, dtype))
        pairs = torch.tensor([distinct[s] for s in entry.table.sizes], dtype=torch.int64).reshape(-1, 2)
        hit = (pairs[:, 0].contiguous(), pairs[:, 1].contiguous())
        if len(_LENGTHS) > 4096:
            _LENGTHS.clear()
        cache[dtype] = hit
    return hit


_LENGTHS: dict[int, tuple[SpreadTable, dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]]]] = {}


def _derive(
    entries: list[Entry], *, only: int | None, bytes_lengths: dict[str, int], threads: int, min_file_bytes: int
) -> _Derivation:
    writer, nbytes, length, is_bytes, spans = [], [], [], [], []
    start = 0
    for entry in entries:
        w = entry.writer
        b, n = _nbytes_and_lengths(entry)
        if entry.properties is None:
            n = torch.full_like(n, bytes_lengths.get(entry.fqn, 0))
        if only is not None:
            keep = w == only
            w, b, n = w[keep], b[keep], n[keep]
        writer.append(w)
        nbytes.append(b)
        length.append(n)
        is_bytes.append(torch.full((w.numel(),), entry.properties is None, dtype=torch.bool))
        spans.append((start, w.numel()))
        start += w.numel()
    rows = Rows(torch.cat(writer), torch.cat(nbytes), torch.cat(length), torch.cat(is_bytes))
    sizes = derive_rows(rows, threads=threads, min_file_bytes=min_file_bytes, segments=spans)
    return _Derivation(rows, spans, sizes, only)


def _own_keys(entries: list[Entry], derivation: _Derivation, rank: int) -> dict[tuple[str, Any], tuple[str, int, int]]:
    """This rank's derived records: (fqn, offsets or None) -> (file, offset, length)."""
    rows = derivation.rows
    out = {}
    for entry, (start, count) in zip(entries, derivation.entry_rows):
        if count == 0:
            continue
        positions = torch.nonzero(entry.writer == rank).flatten().tolist()
        for k, u in enumerate(positions):
            r = start + (u if derivation.only is None else k)
            at = None if entry.properties is None else torch.Size(entry.table.offsets[u])
            out[(entry.fqn, at)] = (data_file_name(rank, int(rows.file[r])), int(rows.offset[r]), int(rows.length[r]))
    return out


def _actual(results: Iterable[WriteResult]) -> dict[tuple[str, Any], tuple[str, int, int]]:
    out = {}
    for r in results:
        if r.index.fqn == RECORDS_KEY:
            continue
        info = r.storage_data
        out[(r.index.fqn, r.index.offset)] = (info.relative_path, info.offset, info.length)
    return out


def _chunks(table: SpreadTable) -> list[ChunkStorageMetadata]:
    hit = _CHUNKS.get(id(table))
    if hit is None or hit[0] is not table:
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in zip(table.offsets, table.sizes)
        ]
        if len(_CHUNKS) > 4096:
            _CHUNKS.clear()
        hit = _CHUNKS[id(table)] = (table, chunks)
    return hit[1]


_CHUNKS: dict[int, tuple[SpreadTable, list[ChunkStorageMetadata]]] = {}


def head_metadata(entries: list[Entry], planner_data: Any) -> Metadata:
    """``.metadata`` without its storage records: one description per entry, chunk lists shared per layout."""
    described: dict[str, Any] = {}
    for entry in entries:
        if entry.properties is None:
            described[entry.fqn] = BytesStorageMetadata()
        else:
            assert entry.size is not None
            described[entry.fqn] = TensorStorageMetadata(entry.properties, entry.size, _chunks(entry.table))
    return Metadata(state_dict_metadata=described, planner_data=planner_data)


def storage_groups(
    entries: list[Entry], derivation: _Derivation, own: dict[int, list[WriteResult]]
) -> tuple[list[str], list[StorageGroup]]:
    """Every record for ``.metadata``: derived rows, except the ranks in ``own`` (their real records)."""
    rows = derivation.rows
    assert rows.file is not None and rows.offset is not None
    files = max((f for _, f in derivation.sizes), default=0) + 1
    pairs = sorted(derivation.sizes)
    names = [data_file_name(w, f) for w, f in pairs]
    keys = torch.tensor([w * files + f for w, f in pairs], dtype=torch.int64)  # ascending, as pairs
    name = torch.searchsorted(keys, rows.writer * files + rows.file)  # each row's position in names
    skip = torch.tensor(sorted(own), dtype=torch.int64)
    keep = ~torch.isin(rows.writer, skip) if len(own) else None
    groups = []
    for entry, (start, count) in zip(entries, derivation.entry_rows):
        sl = slice(start, start + count)
        tensor = entry.properties is not None
        offsets = _offsets(entry.table) if tensor else None
        index = _positions(count) if tensor else None
        group = StorageGroup(entry.fqn, offsets, index, name[sl], rows.offset[sl], rows.length[sl])
        if keep is not None:
            k = keep[sl]
            group = StorageGroup(
                entry.fqn,
                None if offsets is None else offsets[k],
                None if index is None else index[k],
                group.name[k],
                group.offset[k],
                group.length[k],
            )
        groups.append(group)
    groups += _real_groups(entries, own, names)
    return names, groups


def _offsets(table: SpreadTable) -> torch.Tensor:
    """``[boxes, dims]``: each box's offsets."""
    return _columns(table)[0]


def _sizes(table: SpreadTable) -> torch.Tensor:
    """``[boxes, dims]``: each box's sizes."""
    return _columns(table)[1]


def _columns(table: SpreadTable) -> tuple[torch.Tensor, torch.Tensor]:
    hit = _COLUMNS.get(id(table))
    if hit is None or hit[0] is not table:
        n = len(table.offsets)
        offsets = torch.tensor(table.offsets, dtype=torch.int64).reshape(n, -1)
        sizes = torch.tensor(table.sizes, dtype=torch.int64).reshape(n, -1)
        if len(_COLUMNS) > 4096:
            _COLUMNS.clear()
        hit = _COLUMNS[id(table)] = (table, offsets, sizes)
    return hit[1], hit[2]


_COLUMNS: dict[int, tuple[SpreadTable, torch.Tensor, torch.Tensor]] = {}


@functools.lru_cache(maxsize=256)
def _positions(count: int) -> torch.Tensor:
    """0 .. count - 1: each box's index hint (its position in the entry's chunk list)."""
    return torch.arange(count, dtype=torch.int64)


def _real_groups(entries: list[Entry], own: dict[int, list[WriteResult]], names: list[str]) -> list[StorageGroup]:
    """The records the ranks in ``own`` really wrote (their rows are left out of the derived groups)."""
    position = {e.fqn: {o: i for i, o in enumerate(e.table.offsets)} for e in entries if own}
    by_name = {n: i for i, n in enumerate(names)}
    per_fqn: dict[str, list[tuple[Any, int, str, int, int]]] = {}
    for rank in sorted(own):
        for r in own[rank]:
            if r.index.fqn == RECORDS_KEY:
                continue
            info = r.storage_data
            if info.relative_path not in by_name:
                by_name[info.relative_path] = len(names)
                names.append(info.relative_path)
            at = r.index.offset
            u = -1 if at is None else position[r.index.fqn].get(tuple(at), 0)
            per_fqn.setdefault(r.index.fqn, []).append((at, u, info.relative_path, info.offset, info.length))
    groups = []
    for fqn, recs in per_fqn.items():
        tensor = recs[0][0] is not None
        groups.append(
            StorageGroup(
                fqn,
                torch.tensor([list(r[0]) for r in recs], dtype=torch.int64).reshape(len(recs), -1) if tensor else None,
                torch.tensor([r[1] for r in recs], dtype=torch.int64) if tensor else None,
                torch.tensor([by_name[r[2]] for r in recs], dtype=torch.int64),
                torch.tensor([r[3] for r in recs], dtype=torch.int64),
                torch.tensor([r[4] for r in recs], dtype=torch.int64),
            )
        )
    return groups


# ------------------------------------------------------------------------------ derived loads
#
# [Note: derived loads]
# ~~~~~~~~~~~~~~~~~~~~~
# ``.metadata`` lists one storage record per distinct box: for Llama-3 405B at 16,384 ranks
# 272 MB, which a load would have rank 0 read (restricted unpickler) and every rank receive.
# But a derived save's records ARE the rules' ([Note: the derived protocol]): rank 0 streamed
# ``.metadata`` from them. So the save also writes, into the manifest (``layout.derived``), what
# the rules need -- each entry's spread recipe ([Note: spread recipes] in
# ``state/_recipes.py``), the grids, the file rule's two numbers, each bytes item's length and
# the digest the saving ranks agreed on -- a few hundred bytes per distinct layout plus a line
# per entry, whatever the world size. Only a save in which every record is the rules' records it
# (no rank sent its own records). A load then derives every record on every rank
# (:func:`derive_load`, tensor operations as in the save): no rank reads ``.metadata``, nothing
# is broadcast, and the load is two constant all-reduces. Each rank's metadata then lists, per
# entry, only the saved boxes that overlap a box it loads (:meth:`DerivedRecords.metadata`, by
# DCP's own overlap rule, so DCP plans the same read items without testing every saved box of
# every entry: 405B at 16,384 ranks, 3.1 s instead of 8.9 s on rank 0).
#
# What makes that safe: the rebuilt spreads' digest must be the one the saving ranks agreed on
# (the same inputs), checked before any table is built; each entry's boxes must lie inside its
# size and cover it exactly, each element once (the check ``.metadata``'s reader makes, [Note:
# exact chunk coverage]); every data file's derived size must be the manifest's record of it (the
# manifest is checksummed, its file records are what the commit listed); the derived records
# must hash to the digest of the records the save wrote (:func:`records_digest`: the same outputs,
# whatever version of the layout algebra or torch derives them); and the ranks agree in the
# load's argument round that each of them derived. A crafted record is bounded in the work it
# can cause (:data:`MAX_LAYOUTS`, :data:`MAX_GRIDS`, the recipes' own bounds).
# Otherwise every rank reads rank 0's ``.metadata`` as before (a checkpoint from a save that fell
# back, an older shardbridge, a recipe this version does not rebuild). ``.metadata`` stays in the
# checkpoint for DCP's own readers (``dcp_to_torch_save``) and for inspect and export.

DERIVED_VERSION = 1
MAX_LAYOUTS = 512
"""Distinct layouts a derived load rebuilds at most (each one a table over every coordinate of its
mesh: ~0.5 s and ~4 MB at 16,384 ranks; Llama-3 405B with AdamW state has a few dozen). A record
with more is not derived (the load reads ``.metadata``): a few hundred bytes of a crafted manifest
must not cost a rank hours."""
MAX_GRIDS = 64
"""Distinct meshes, each decoded and checked over every rank."""


def records_digest(entries: list[Entry], derivation: _Derivation) -> str:
    """A digest of every record ``.metadata`` lists: each entry's name and boxes (offsets, sizes) and
    each box's writer, file, offset and length. What a derived load must reproduce exactly: the
    recipes' digest covers what the layouts are built FROM, this one what they give (another
    version of the layout algebra or of torch could give the same inputs other boxes)."""
    rows = derivation.rows
    assert rows.file is not None and rows.offset is not None
    h = hashlib.blake2b(digest_size=16)
    for column in (rows.writer, rows.file, rows.offset, rows.length):
        h.update(column.numpy().tobytes())
    seen: dict[int, int] = {}
    for entry in entries:
        table = entry.table
        if id(table) not in seen:
            seen[id(table)] = len(seen)
            h.update(b"T" + _offsets(table).numpy().tobytes() + b"S" + _sizes(table).numpy().tobytes())
        h.update(f"\0{entry.fqn}\0{seen[id(table)]}\0{entry.properties is None}".encode())
    return h.hexdigest()


def describe(
    entries: list[Entry],
    digest: int,
    bytes_lengths: dict[str, int],
    threads: int,
    min_file_bytes: int,
    derivation: _Derivation,
) -> dict[str, Any] | None:
    """``layout.derived`` for the manifest; None when some entry cannot be rebuilt (no recipe)."""
    grids: dict[str, int] = {}
    grid_records: list[dict[str, Any]] = []
    recipes: dict[str, int] = {}
    recipe_records: list[Any] = []
    rows: list[list[Any]] = []
    try:
        for entry in entries:
            spread = entry.spread
            props = encode_properties(spread.properties)
            if spread.recipe is None or props != encode_properties(entry.properties):
                return None
            if spread.grid.digest not in grids:
                grids[spread.grid.digest] = len(grid_records)
                grid_records.append(encode_grid(spread.grid))
            recipe = [spread.recipe[0], spread.recipe[1]]
            text = json.dumps(recipe, sort_keys=True)
            if text not in recipes:
                recipes[text] = len(recipe_records)
                recipe_records.append(recipe)
            size = None if entry.size is None else list(entry.size)
            rows.append([entry.fqn, grids[spread.grid.digest], recipes[text], spread.keep_empty, props, size])
    except NotDerivable:
        return None
    return {
        "version": DERIVED_VERSION,
        "digest": digest,
        "records": records_digest(entries, derivation),
        "threads": threads,
        "min_file_bytes": min_file_bytes,
        "grids": grid_records,
        "recipes": recipe_records,
        "entries": rows,
        "bytes": {e.fqn: bytes_lengths.get(e.fqn, 0) for e in entries if e.properties is None},
    }


@dataclass
class DerivedRecords:
    """Every storage record of a checkpoint, derived from its manifest ([Note: derived loads])."""

    entries: list[Entry]
    derivation: _Derivation
    digest: int

    def metadata(self, local: dict[str, Any] | None = None) -> Metadata:
        """``.metadata`` as the save wrote it: the head, and each record computed when looked up.

        ``local``: this rank's flattened state dict: each entry then lists only the saved boxes
        that overlap a box this rank loads (DCP's overlap rule: the same read items, without
        DCP's planner sorting and testing every saved box of every entry on every rank)."""
        head = head_metadata(self.entries, None)
        if local is not None:
            described = dict(head.state_dict_metadata)
            for entry in self.entries:
                if entry.fqn in local and entry.properties is not None:
                    described[entry.fqn] = _narrowed(entry, described[entry.fqn], local[entry.fqn])
            head = Metadata(state_dict_metadata=described)
        head.storage_data = _DerivedStorage(self)  # type: ignore[assignment]
        return head


NARROW_FROM = 16
"""Entries with fewer saved boxes are left whole: DCP's planner tests a few boxes faster than
the tensor operations that would pick them (8B at 8 ranks: 0.06 s of 0.21 s, 1,164 entries)."""


def _narrowed(entry: Entry, md: Any, value: Any) -> Any:
    """``md`` with only the chunks that overlap a box of ``value`` (as DCP's planner tests overlap)."""
    if isinstance(value, DTensor) and value.device_mesh.get_coordinate() is None:
        return md  # not on this rank's mesh: DCP's planner reads nothing for it
    if hasattr(value, "__create_chunk_list__"):
        wanted = [(tuple(c.offsets), tuple(c.sizes)) for c in value.__create_chunk_list__()]
    elif isinstance(value, torch.Tensor):
        wanted = [((0,) * value.dim(), tuple(value.shape))]
    else:
        return md
    count = len(entry.table.sizes)
    if count < NARROW_FROM or not wanted:
        return md
    offsets, sizes = _offsets(entry.table), _sizes(entry.table)
    if any(len(lo) != offsets.shape[1] or len(n) != offsets.shape[1] for lo, n in wanted):
        return md  # another number of dims: _check_compatible names the shape mismatch
    keep = torch.zeros(count, dtype=torch.bool)
    for lo, n in wanted:
        lo_t, n_t = torch.tensor(lo, dtype=torch.int64), torch.tensor(n, dtype=torch.int64)
        apart = (lo_t >= offsets + sizes) | (offsets >= lo_t + n_t)  # DCP: no overlap along some dim
        keep |= ~apart.any(dim=1)
    chunks = _chunks(entry.table)
    return TensorStorageMetadata(md.properties, md.size, [chunks[u] for u in torch.nonzero(keep).flatten().tolist()])




class _DerivedStorage(Mapping[MetadataIndex, Any]):
    """``Metadata.storage_data`` computed on lookup from the derived rows (no dict of every box)."""

    def __init__(self, records: DerivedRecords) -> None:
        self._records = records
        self._at = {e.fqn: (e, span) for e, span in zip(records.entries, records.derivation.entry_rows)}
        sizes = records.derivation.sizes
        self._names = {key: data_file_name(*key) for key in sizes}

    def __getitem__(self, index: MetadataIndex) -> Any:
        hit = self._at.get(index.fqn)
        if hit is None:
            raise KeyError(index)
        entry, (start, count) = hit
        if index.offset is None:
            if entry.properties is not None or count != 1:
                raise KeyError(index)
            u = 0
        else:
            u = entry.table.position.get(tuple(index.offset), -1)
            if not 0 <= u < count:
                raise KeyError(index)
        rows = self._records.derivation.rows
        assert rows.file is not None and rows.offset is not None
        r = start + u
        name = self._names[(int(rows.writer[r]), int(rows.file[r]))]
        return DCPStorageInfo(name, int(rows.offset[r]), int(rows.length[r]))

    def __iter__(self) -> Iterator[MetadataIndex]:
        for entry, (_, count) in zip(self._records.entries, self._records.derivation.entry_rows):
            if entry.properties is None:
                yield MetadataIndex(entry.fqn)
                continue
            for u in range(count):
                yield MetadataIndex(entry.fqn, torch.Size(entry.table.offsets[u]), u)

    def __len__(self) -> int:
        return sum(count for _, count in self._records.derivation.entry_rows)


def derive_load(layout: dict[str, Any], world_size: int, files: dict[str, dict[str, Any]]) -> DerivedRecords | None:
    """Every record of the checkpoint whose manifest has this ``layout``, ``world_size`` and
    ``files``, derived as its save derived them; None when they cannot be (the load reads
    ``.metadata``). See [Note: derived loads]."""
    record = layout.get(DERIVED_KEY)
    if record is None:
        return None
    try:
        return _derive_load(record, world_size, files)
    except Exception as exc:  # noqa: BLE001 (any failure: the load reads .metadata, which is checked on its own)
        if _dist.rank() == 0:
            logger.warning(
                "shardbridge.checkpoint: the manifest's layout.derived is not used (%s): this load reads .metadata "
                "on rank 0 and broadcasts it, one collective more",
                str(exc)[:300],
            )
        return None


def _derive_load(record: Any, world_size: int, files: dict[str, dict[str, Any]]) -> DerivedRecords:
    if not isinstance(record, dict) or record.get("version") != DERIVED_VERSION:
        raise NotDerivable(f"layout.derived version {record.get('version') if isinstance(record, dict) else record!r}")
    data_files = {n: f["size"] for n, f in files.items() if DATA_FILE_PATTERN.fullmatch(n)}
    rng_files = sum(1 for n in files if n.startswith("rng/"))
    if not data_files or rng_files != world_size:  # every rank wrote its RNG file: bounds what follows
        raise NotDerivable(f"the manifest lists {rng_files} RNG files for a world of {world_size}")
    digest, threads, min_file_bytes = (record.get(k) for k in ("digest", "threads", "min_file_bytes"))
    for name, value in (("digest", digest), ("threads", threads), ("min_file_bytes", min_file_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 1 << 62:
            raise NotDerivable(f"layout.derived.{name}={value!r}")
    grid_records = _list(record.get("grids"))
    if len(grid_records) > MAX_GRIDS:
        raise NotDerivable(f"layout.derived has more than {MAX_GRIDS} meshes")
    grids = [decode_grid(g, world_size) for g in grid_records]
    recipes = _list(record.get("recipes"))
    lengths = record.get("bytes")
    if not isinstance(lengths, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 62 for v in lengths.values()
    ):
        raise NotDerivable("layout.derived.bytes is not {name: length}")
    # 1. every entry's spread (closures: no table yet), and the digest the save agreed on
    spreads: list[tuple[str, Spread]] = []
    sizes: list[Any] = []
    built: dict[tuple[Any, ...], Spread] = {}
    for ordinal, row in enumerate(_list(record.get("entries"))):
        if not isinstance(row, list) or len(row) != 6:
            raise NotDerivable(
                f"layout.derived.entries[{ordinal}] is not [fqn, grid, recipe, keep_empty, properties, size]"
            )
        fqn, g, r, keep_empty, props, size = row
        if (
            not (isinstance(fqn, str) and isinstance(keep_empty, bool))
            or g not in range(len(grids))
            or r not in range(len(recipes))
        ):
            raise NotDerivable(f"layout.derived.entries[{ordinal}] = {row!r:.120}")
        key = (g, r, keep_empty, json.dumps(props))
        spread = built.get(key)
        if spread is None:
            if len(built) >= MAX_LAYOUTS:  # each costs a table over every rank: see the constant
                raise NotDerivable(f"layout.derived has more than {MAX_LAYOUTS} distinct layouts")
            properties = decode_properties(props)
            spread = built[key] = rebuild(recipes[r], grids[g], keep_empty=keep_empty, properties=properties)
        if (size is None) != (spread.properties is None) or (size is not None and not _valid_size(size)):
            raise NotDerivable(f"layout.derived.entries[{ordinal}]: size {size!r:.80}")
        spreads.append((fqn, spread))
        sizes.append(size)
    if spreads_digest(spreads) != digest:
        raise NotDerivable("the rebuilt spreads are not the ones the save agreed on (digest)")
    # 2. their tables (the work: every coordinate of every distinct layout), checked, and the writers
    entries: list[Entry] = []
    checked: dict[tuple[int, tuple[int, ...]], SpreadTable] = {}
    for ordinal, ((fqn, spread), size) in enumerate(zip(spreads, sizes)):
        table = spread_table(spread)
        if size is not None:
            _check_covers(table, tuple(size), ordinal, checked)
        is_bytes = spread.properties is None
        entries.append(
            Entry(fqn, spread, table, writers(table, ordinal, bytes_item=is_bytes), spread.properties,
                  None if size is None else torch.Size(size))
        )  # fmt: skip
    derivation = _derive(entries, only=None, bytes_lengths=lengths, threads=threads, min_file_bytes=min_file_bytes)
    derived = {data_file_name(w, f): size for (w, f), size in derivation.sizes.items()}
    if derived != data_files:
        wrong = sorted(set(derived) ^ set(data_files)) or [n for n in sorted(derived) if derived[n] != data_files[n]]
        raise NotDerivable(f"derived data files differ from the manifest's records (first: {wrong[0]})")
    if records_digest(entries, derivation) != record.get("records"):
        raise NotDerivable("the derived records are not the ones the save wrote (records digest)")
    return DerivedRecords(entries, derivation, digest)


def _check_covers(table: SpreadTable, size: tuple[int, ...], ordinal: int, checked: dict[Any, SpreadTable]) -> None:
    """NotDerivable unless the table's boxes cover a tensor of ``size`` exactly, each element once
    ([Note: exact chunk coverage], as ``.metadata``'s reader checks it); once per table and size."""
    key = (id(table), size)
    if checked.get(key) is table:
        return
    offsets, sizes = _offsets(table), _sizes(table)
    fault = None
    if table.offsets and offsets.shape[1] != len(size):
        fault = f"have {offsets.shape[1]} dims"
    elif table.offsets and bool(((offsets < 0) | (offsets + sizes > torch.tensor(size, dtype=torch.int64))).any()):
        fault = "reach outside it"
    else:
        fault = coverage_fault(size, list(zip(table.offsets, table.sizes)))
    if fault is not None:
        raise NotDerivable(f"layout.derived.entries[{ordinal}]: the boxes of a tensor of size {list(size)} {fault}")
    checked[key] = table


def _list(value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise NotDerivable(f"{value!r:.80} is not a list")
    return value


def _valid_size(size: Any) -> bool:
    return (
        isinstance(size, list)
        and len(size) <= 16
        and all(isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 1 << 62 for s in size)
    )


@dataclass(kw_only=True)
class Derived:
    """Plans derived from the mesh, records from the file rule. See [Note: the derived protocol]."""

    fallback: OwnRounds
    """The gathered protocol for saves that cannot be derived."""
    name: str = "derived"
    cache: dict[str, Any] = field(default_factory=dict)
    """This rank's entries of the last save, kept while its local plan stays the same."""

    def local(self, dcp_state: dict[str, Any]) -> tuple[DerivedLocal, bool]:
        """This rank's local plan, its entries' spreads and digest; whether its plan is the last save's.

        The entries are kept between saves while this rank's local plan stays the same (what
        changes between saves of a training run is the data, not the layout)."""
        planner, plan, unchanged = self.fallback.planned(dcp_state)
        world = _dist.world_size()
        cached = self.cache.get("local")
        if cached is not None and cached[0] == (world, _dist.rank()) and cached[1] == plan:
            entries, digest = cached[2], cached[3]
        else:
            entries, digest = _entries(planner, plan, world)
            self.cache["local"] = ((world, _dist.rank()), plan, entries, digest)
        return DerivedLocal(plan, entries, digest, plan), unchanged

    @staticmethod
    def digest(local: DerivedLocal) -> int:
        """What the argument round compares across ranks (0: this rank cannot derive)."""
        return local.digest

    def save(
        self, dcp_state: dict[str, Any], writer: Writer, local: DerivedLocal, unchanged: bool, derived: bool = False
    ) -> None:
        """The derived write round, or the gathered rounds when ``derived`` is False (see the Note)."""
        if not derived or local.entries is None:
            self.fallback.save(dcp_state, writer, local.gathered, unchanged)
            return
        entries = local.entries
        rank = _dist.rank()
        threads, min_file_bytes = writer.threads, writer.min_file_bytes
        state: dict[str, Any] = {}

        def write() -> tuple[RankFiles, bool, list[WriteResult] | None]:
            mine = [item for item in local.plan.items if _writes(item, entries_by_fqn, rank)]
            plan = SavePlan(mine, storage_data=DCPStoragePrefix(f"__{rank}_"), planner_data=local.plan.planner_data)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            planner = SavePlanner()
            planner.set_up_planner(state_dict=dcp_state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            results = writer.write_data(planner.finish_plan(plan), planner).wait()
            records = next(r.storage_data for r in results if r.index.fqn == RECORDS_KEY)
            actual = _actual(results)
            bytes_lengths = {fqn: length for (fqn, at), (_, _, length) in actual.items() if at is None}
            derivation = _derive(
                entries, only=None if rank == 0 else rank, bytes_lengths=bytes_lengths,
                threads=threads, min_file_bytes=min_file_bytes,
            )  # fmt: skip
            state["derivation"], state["bytes_lengths"] = derivation, bytes_lengths
            ok = _own_keys(entries, derivation, rank) == actual
            return records, ok, None if ok else results

        entries_by_fqn = {e.fqn: e for e in entries}

        def finish(parts: list[tuple[RankFiles, bool, list[WriteResult] | None]]) -> None:
            derivation: _Derivation = state["derivation"]
            own = {r: part[2] for r, part in enumerate(parts) if not part[1]}
            for (w, f), size in derivation.sizes.items():  # every file as the file rule sizes it
                records, ok, _ = parts[w]
                name = data_file_name(w, f)
                if ok and records.files.get(name, {}).get("size") != size:
                    raise RuntimeError(
                        f"internal: rank {w}'s {name} has {records.files.get(name)} where the file rule gives "
                        f"{size} bytes; nothing was committed"
                    )
            names, groups = storage_groups(entries, derivation, own)
            head = head_metadata(entries, local.plan.planner_data)
            # every record as the rules say: a load can derive them too ([Note: derived loads])
            recipe = None
            if not own:
                recipe = describe(entries, local.digest, state["bytes_lengths"], threads, min_file_bytes, derivation)
            writer.finish_stream(head, names, groups, [part[0] for part in parts], derived=recipe)

        _dist.gather_reduce(write, finish, small=True)


def _writes(item: Any, entries: dict[str, Entry], rank: int) -> bool:
    """Whether this rank writes ``item`` (the writer rule of its entry's box)."""
    entry = entries[item.index.fqn]
    if item.type == WriteItemType.BYTE_IO:
        return int(entry.writer[0]) == rank
    u = entry.table.position[tuple(item.index.offset)]
    return int(entry.writer[u]) == rank
