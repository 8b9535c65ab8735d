"""Every storage record of a derived save, as the rules give it: for the save's ``.metadata`` and a load.

The records a derived save writes ([Note: the derived protocol] in ``_save.py``) are a function
of each entry's spread (which rank writes which box), the file rule ([Note: derived file layout]
in ``storage/_files.py``) and each bytes item's length: :func:`derive` computes them as tensor
columns (one row per box, no Python object per box), :func:`head_metadata` the entries'
descriptions. The same computation serves a derived load ([Note: derived loads] below).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from shardbridge._compat import DCPStorageInfo
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.derived._recipes import (
    decode_grid,
    decode_properties,
    encode_grid,
    encode_properties,
    rebuild,
)
from shardbridge.checkpoint.derived._spread import (
    NotDerivable,
    Spread,
    SpreadTable,
    spread_table,
    spreads_digest,
    writers,
)
from shardbridge.checkpoint.storage._coverage import coverage_fault
from shardbridge.checkpoint.storage._files import DATA_FILE_PATTERN, Rows, data_file_name, derive_rows, record_length
from shardbridge.checkpoint.storage._manifest import DERIVED_KEY

__all__ = [
    "Derivation",
    "DerivedRecords",
    "Entry",
    "derive",
    "derive_load",
    "describe",
    "head_metadata",
    "offsets_of",
    "positions",
]

logger = logging.getLogger("shardbridge.checkpoint")


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
class Derivation:
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
    memo = entry.table.memo
    hit = memo.get(("lengths", dtype))
    if hit is None:
        distinct: dict[tuple[int, ...], tuple[int, int]] = {}
        for sizes in entry.table.sizes:
            if sizes not in distinct:
                numel = 1
                for s in sizes:
                    numel *= s
                distinct[sizes] = (numel * dtype.itemsize, record_length(sizes, dtype))
        pairs = torch.tensor([distinct[s] for s in entry.table.sizes], dtype=torch.int64).reshape(-1, 2)
        hit = memo[("lengths", dtype)] = (pairs[:, 0].contiguous(), pairs[:, 1].contiguous())
    return hit


def derive(
    entries: list[Entry], *, only: int | None, bytes_lengths: dict[str, int], threads: int, min_file_bytes: int
) -> Derivation:
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
    return Derivation(rows, spans, sizes, only)


def _chunks(table: SpreadTable) -> list[ChunkStorageMetadata]:
    hit = table.memo.get("chunks")
    if hit is None:
        hit = table.memo["chunks"] = [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in zip(table.offsets, table.sizes)
        ]
    return hit


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


def offsets_of(table: SpreadTable) -> torch.Tensor:
    """``[boxes, dims]``: each box's offsets."""
    return _columns(table)[0]


def _sizes(table: SpreadTable) -> torch.Tensor:
    """``[boxes, dims]``: each box's sizes."""
    return _columns(table)[1]


def _columns(table: SpreadTable) -> tuple[torch.Tensor, torch.Tensor]:
    hit = table.memo.get("columns")
    if hit is None:
        n = len(table.offsets)
        offsets = torch.tensor(table.offsets, dtype=torch.int64).reshape(n, -1)
        sizes = torch.tensor(table.sizes, dtype=torch.int64).reshape(n, -1)
        hit = table.memo["columns"] = (offsets, sizes)
    return hit


@functools.lru_cache(maxsize=256)
def positions(count: int) -> torch.Tensor:
    """0 .. count - 1: each box's index hint (its position in the entry's chunk list)."""
    return torch.arange(count, dtype=torch.int64)


# ------------------------------------------------------------------------------ derived loads
#
# [Note: derived loads]
# ~~~~~~~~~~~~~~~~~~~~~
# ``.metadata`` lists one storage record per distinct box: for Llama-3 405B at 16,384 ranks
# 272 MB, which a load would have rank 0 read (restricted unpickler) and every rank receive.
# But a derived save's records ARE the rules' ([Note: the derived protocol]): rank 0 streamed
# ``.metadata`` from them. So the save also writes, into the manifest (``layout.derived``), what
# the rules need -- each entry's spread recipe ([Note: spread recipes] in
# ``derived/_recipes.py``), the grids, the file rule's two numbers, each bytes item's length and
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


def records_digest(entries: list[Entry], derivation: Derivation) -> str:
    """A digest of every record ``.metadata`` lists: each entry's name and boxes (offsets, sizes) and
    each box's writer, file, offset and length. What a derived load must reproduce exactly: the
    recipes' digest covers what the layouts are built FROM, this one what they give (another
    version of the layout algebra or of torch could give the same inputs other boxes)."""
    rows = derivation.rows
    assert rows.file is not None and rows.offset is not None
    h = hashlib.blake2b(digest_size=16)
    for column in (rows.writer, rows.file, rows.offset, rows.length):
        h.update(column.numpy().tobytes())
    seen: list[SpreadTable] = []
    for entry in entries:
        table = entry.table
        number = next((i for i, t in enumerate(seen) if t is table), None)
        if number is None:
            number = len(seen)
            seen.append(table)
            h.update(b"T" + offsets_of(table).numpy().tobytes() + b"S" + _sizes(table).numpy().tobytes())
        h.update(f"\0{entry.fqn}\0{number}\0{entry.properties is None}".encode())
    return h.hexdigest()


def describe(
    entries: list[Entry],
    digest: int,
    bytes_lengths: dict[str, int],
    threads: int,
    min_file_bytes: int,
    derivation: Derivation,
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
    derivation: Derivation
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
    offsets, sizes = offsets_of(entry.table), _sizes(entry.table)
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
    for ordinal, ((fqn, spread), size) in enumerate(zip(spreads, sizes)):
        table = spread_table(spread)
        if size is not None:
            _check_covers(table, tuple(size), ordinal)
        is_bytes = spread.properties is None
        entries.append(
            Entry(fqn, spread, table, writers(table, ordinal, bytes_item=is_bytes), spread.properties,
                  None if size is None else torch.Size(size))
        )  # fmt: skip
    derivation = derive(entries, only=None, bytes_lengths=lengths, threads=threads, min_file_bytes=min_file_bytes)
    derived = {data_file_name(w, f): size for (w, f), size in derivation.sizes.items()}
    if derived != data_files:
        wrong = sorted(set(derived) ^ set(data_files)) or [n for n in sorted(derived) if derived[n] != data_files[n]]
        raise NotDerivable(f"derived data files differ from the manifest's records (first: {wrong[0]})")
    if records_digest(entries, derivation) != record.get("records"):
        raise NotDerivable("the derived records are not the ones the save wrote (records digest)")
    return DerivedRecords(entries, derivation, digest)


def _check_covers(table: SpreadTable, size: tuple[int, ...], ordinal: int) -> None:
    """NotDerivable unless the table's boxes cover a tensor of ``size`` exactly, each element once
    ([Note: exact chunk coverage], as ``.metadata``'s reader checks it); once per table and size."""
    if size in table.memo.get("covers", ()):
        return
    offsets, sizes = offsets_of(table), _sizes(table)
    fault = None
    if table.offsets and offsets.shape[1] != len(size):
        fault = f"have {offsets.shape[1]} dims"
    elif table.offsets and bool(((offsets < 0) | (offsets + sizes > torch.tensor(size, dtype=torch.int64))).any()):
        fault = "reach outside it"
    else:
        fault = coverage_fault(size, list(zip(table.offsets, table.sizes)))
    if fault is not None:
        raise NotDerivable(f"layout.derived.entries[{ordinal}]: the boxes of a tensor of size {list(size)} {fault}")
    table.memo.setdefault("covers", set()).add(size)


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

