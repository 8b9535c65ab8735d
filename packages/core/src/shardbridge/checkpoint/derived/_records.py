"""Every storage record of a derived save, as the rules give it: for the save's ``.metadata`` and a load.

The records a derived save writes ([Note: the derived protocol] in ``_save.py``) are a function
of each entry's spread (which rank writes which box), the file rule ([Note: derived file layout]
in ``storage/_files.py``) and each bytes item's length: :func:`derive` computes them as tensor
columns (one row per box, no Python object per box), :func:`head_metadata` the entries'
descriptions. The same computation serves a derived load ([Note: derived loads] below).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
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
    table_key,
    writers,
)
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._coverage import coverage_fault
from shardbridge.checkpoint.storage._files import DATA_FILE_PATTERN, Rows, data_file_name, derive_rows, record_length
from shardbridge.checkpoint.storage._integrity import check_files
from shardbridge.checkpoint.storage._manifest import DCP_METADATA_NAME, DERIVED_KEY, Manifest
from shardbridge.checkpoint.storage._metadata_stream import StorageGroup, write_metadata
from shardbridge.checkpoint.storage._trust import read_metadata

__all__ = [
    "Derivation",
    "DerivedRecords",
    "Entry",
    "checkpoint_records",
    "declared_digest",
    "derive",
    "derive_load",
    "describe",
    "head_metadata",
    "laid_out",
    "metadata_of",
    "positions",
    "record_groups",
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
                distinct[sizes] = (math.prod(sizes) * dtype.itemsize, record_length(sizes, dtype))
        pairs = torch.tensor([distinct[s] for s in entry.table.sizes], dtype=torch.int64).reshape(-1, 2)
        hit = memo[("lengths", dtype)] = (pairs[:, 0].contiguous(), pairs[:, 1].contiguous())
    return hit


def laid_out(entries: list[Entry]) -> list[int]:
    """The order the derived writer lays entries out in: the entries held by more ranks first, each
    group in plan order (a stable sort). What several ranks read (AdamW's ``step``, a replicated
    norm, a replica's shards under HSDP) then lies side by side in a file: a rank reading another
    rank's file asks for one range, not the scattered records between that rank's own shards (which
    a read-through of the gaps would fetch too: 2.2x the checkpoint's bytes per load on S3 before)."""
    return sorted(range(len(entries)), key=lambda i: -entries[i].table.holders.shape[1])


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
    laid = [spans[i] for i in laid_out(entries)]
    sizes = derive_rows(rows, threads=threads, min_file_bytes=min_file_bytes, segments=laid)
    return Derivation(rows, spans, sizes, only)


def _chunks(table: SpreadTable) -> list[ChunkStorageMetadata]:
    hit = table.memo.get("chunks")
    if hit is None:
        hit = table.memo["chunks"] = [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in zip(table.offsets, table.sizes)
        ]
    return hit


def head_metadata(
    entries: list[Entry], planner_data: Any = None, storage_meta: StorageMeta | None = None, version: str | None = None
) -> Metadata:
    """``.metadata`` without its storage records: one description per entry, one chunk list per
    layout shared by its entries (by the layout, not by which table object holds it, so a load
    rendering the stream again shares the same lists: [Note: derived loads])."""
    described: dict[str, Any] = {}
    lists: dict[tuple[Any, ...], list[ChunkStorageMetadata]] = {}
    for entry in entries:
        if entry.properties is None:
            described[entry.fqn] = BytesStorageMetadata()
        else:
            assert entry.size is not None
            chunks = lists.setdefault(table_key(entry.spread), _chunks(entry.table))
            described[entry.fqn] = TensorStorageMetadata(entry.properties, entry.size, chunks)
    return Metadata(state_dict_metadata=described, planner_data=planner_data, storage_meta=storage_meta, version=version)


def record_groups(
    entries: list[Entry], derivation: Derivation, skip: Sequence[int] = ()
) -> tuple[list[str], list[StorageGroup]]:
    """Every derived record for ``.metadata`` (but those of the writers in ``skip``): the files'
    names and one group per entry."""
    rows = derivation.rows
    assert rows.file is not None and rows.offset is not None
    files = max((f for _, f in derivation.sizes), default=0) + 1
    pairs = sorted(derivation.sizes)
    names = [data_file_name(w, f) for w, f in pairs]
    keys = torch.tensor([w * files + f for w, f in pairs], dtype=torch.int64)  # ascending, as pairs
    name = torch.searchsorted(keys, rows.writer * files + rows.file)  # each row's position in names
    keep = ~torch.isin(rows.writer, torch.tensor(sorted(skip), dtype=torch.int64)) if len(skip) else None
    groups = []
    for entry, (start, count) in zip(entries, derivation.entry_rows):
        sl = slice(start, start + count)
        tensor = entry.properties is not None
        columns = [_columns(entry.table)[0] if tensor else None, positions(count) if tensor else None,
                   name[sl], rows.offset[sl], rows.length[sl]]  # fmt: skip
        if keep is not None:
            columns = [None if c is None else c[keep[sl]] for c in columns]
        groups.append(StorageGroup(entry.fqn, *columns))
    return names, groups


def _columns(table: SpreadTable) -> tuple[torch.Tensor, torch.Tensor]:
    """``[boxes, dims]`` twice: each box's offsets and sizes (computed once per table)."""
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
# 272 MB, which a load would have rank 0 read (restricted unpickler: minutes) and every rank
# receive. But a derived save's records ARE the rules' ([Note: the derived protocol]): rank 0
# streamed ``.metadata`` from them. So the save also writes, into the manifest
# (``layout.derived``), what the rules need -- each entry's spread recipe ([Note: spread
# recipes] in ``derived/_recipes.py``), the grids, the file rule's two numbers, each bytes item's
# length, the digest the saving ranks agreed on -- and the few save-time values ``.metadata``
# holds that no rule gives: ``storage_meta.checkpoint_id``, DCP's metadata version and the
# flatten paths (``planner_data``) that are not ``(top, rest)`` of the key. A few hundred bytes
# per distinct layout plus a line per entry, whatever the world size.
#
# One checkpoint, one meaning. Export, inspect and torch's own ``dcp_to_torch_save`` read
# ``.metadata``; a manifest is as editable as any file (its checksums can be recomputed: [Note:
# untrusted checkpoints]). A derivation checked only against itself let a crafted
# ``layout.derived`` (names swapped, a grid's ranks permuted, placements swapped, every digest
# recomputed) make a load read other values than every other reader. So a derivation is used
# only once it is shown to BE ``.metadata``: rank 0 renders the whole stream from it
# (:meth:`DerivedRecords.render`: the head and every record, through the very stream writer the
# save used, ``storage/_metadata_stream.py``, which writes a function of the values) and compares
# it with the file byte for byte, reading the file once, sequentially (:meth:`DerivedRecords.
# differs`). Equal: the derived records are the records the restricted reader would unpickle,
# and what that reader checks holds -- by construction (one record per box, each at least as
# long as its raw bytes, laid end to end in its file, distinct offsets per entry: the file
# rule, the tables) or checked here (coverage, sizes >= 0, no offset past 2**63, every data
# file's derived size the manifest's, which the load's file check holds against the file). Not
# equal: the load reads ``.metadata``, with a warning naming the first differing byte. A byte
# comparison, not the manifest's xxh3_128 of ``.metadata``: xxh3 is not collision resistant, and
# whoever writes both files could give two streams one checksum. Cost: one render and one
# sequential read of ``.metadata`` on one rank (``tools/bench/bench_scale.py``).
#
# Order and bounds. Rank 0 derives only after its file check found every listed file (RNG
# files included) with its size: the world size a derivation evaluates is backed by files that
# exist. The other ranks derive after the load's first round agreed that rank 0's rendering
# matched (all derive alike from one manifest); one whose derivation fails reads ``.metadata``
# itself (the same records, slower). Before any table is built the work is bounded:
# :data:`MAX_LAYOUTS`, :data:`MAX_GRIDS`, :data:`MAX_COORDINATES` (world size x distinct
# layouts), split factors whose product exceeds the world size refused (``_recipes.py``); boxes
# and records are bounded by the bytes ``.metadata`` has (each takes at least
# ``_CHUNK_BYTES`` / ``_RECORD_BYTES`` of it). A record beyond a bound is refused by name.
#
# Each rank's metadata then lists, per entry, only the saved boxes that overlap a box it loads
# (:meth:`DerivedRecords.metadata`, by DCP's own overlap rule, so DCP plans the same read items
# without testing every saved box of every entry: 405B at 16,384 ranks, 3.1 s instead of 8.9 s on
# rank 0). Inspect and export read records the same way (:func:`metadata_of`). ``.metadata`` stays
# in the checkpoint for DCP's own readers.

DERIVED_VERSION = 3
"""3: the entries held by more ranks laid out first in each file ([Note: derived file layout]); 2: the
save-time values of ``.metadata`` recorded, the rendering compared; 1: a digest of the records. A
checkpoint of an earlier version is read through ``.metadata``, as DCP reads it."""
MAX_LAYOUTS = 512
"""Distinct layouts a derived load rebuilds at most (Llama-3 405B with AdamW state has a few dozen)."""
MAX_GRIDS = 64
"""Distinct meshes, each decoded and checked over every rank."""
MAX_COORDINATES = 1 << 17
"""Mesh coordinates a derived load evaluates at most over every distinct layout (world size x
layouts, less the replicated dims). Each costs ~15-40 us to derive and as much to render, and
~2 KB, so a manifest adds at most seconds and ~0.3 GB to a rank's load, whatever it says
(``test_a_forged_65536_rank_manifest_with_its_files_costs_a_load_seconds``). Real jobs are far
below: Llama-3 405B at 16,384 ranks has 6,273 over 8 layouts; a job past the bound (e.g. 9
distinct shapes sharded over 16,384 ranks without HSDP) loads through ``.metadata``, as DCP does."""
_CHUNK_BYTES = 16
"""Fewer bytes than any chunk takes in ``.metadata``'s head."""
_RECORD_BYTES = 64
"""Fewer bytes than any storage record takes in a streamed ``.metadata``."""
_PIECE = 16 << 20
"""Bytes of ``.metadata`` read per request while comparing."""


def describe(
    entries: list[Entry],
    digest: int,
    bytes_lengths: dict[str, int],
    threads: int,
    min_file_bytes: int,
    planner_data: Any,
    storage_meta: StorageMeta,
    version: str,
) -> dict[str, Any] | None:
    """``layout.derived`` for the manifest; None when some entry cannot be rebuilt (no recipe) or
    ``.metadata`` holds a value the record cannot give again."""
    grids: dict[str, int] = {}
    grid_records: list[dict[str, Any]] = []
    recipes: dict[str, int] = {}
    recipe_records: list[Any] = []
    rows: list[list[Any]] = []
    fqns = [e.fqn for e in entries]
    if not isinstance(planner_data, dict) or list(planner_data) != fqns or not isinstance(storage_meta.checkpoint_id, str):
        return None
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
        "threads": threads,
        "min_file_bytes": min_file_bytes,
        "grids": grid_records,
        "recipes": recipe_records,
        "entries": rows,
        "bytes": {e.fqn: bytes_lengths.get(e.fqn, 0) for e in entries if e.properties is None},
        "checkpoint_id": storage_meta.checkpoint_id,
        "dcp_version": version,
        "paths": {k: list(v) for k, v in planner_data.items() if tuple(v) != _path(k)},
    }


def _path(fqn: str) -> tuple[str, ...]:
    """DCP's flatten path of a key of shardbridge's two-level state dict (``model.a.b`` -> ``("model", "a.b")``)."""
    return tuple(fqn.split(".", 1))


@dataclass
class DerivedRecords:
    """Every storage record of a checkpoint, derived from its manifest ([Note: derived loads])."""

    entries: list[Entry]
    derivation: Derivation
    digest: int
    paths: dict[str, tuple[Any, ...]]
    """Flatten paths that are not :func:`_path` of their key."""
    checkpoint_id: str
    version: str

    def head(self) -> Metadata:
        """``.metadata`` without its storage records, as the save wrote it."""
        planner = {e.fqn: self.paths.get(e.fqn) or _path(e.fqn) for e in self.entries}
        return head_metadata(self.entries, planner, StorageMeta(checkpoint_id=self.checkpoint_id), self.version)

    def render(self, write: Callable[[bytes], Any]) -> None:
        """``.metadata``'s bytes as the save streamed them, to ``write``."""
        write_metadata(self.head(), *record_groups(self.entries, self.derivation), write)

    def differs(self, stored: Stored, size: int | None = None) -> str | None:
        """None when ``stored``'s ``.metadata`` is byte for byte :meth:`render`; else where they part.

        ``size``: the file's size when known (the manifest's, checked against the listing): no read
        past the end to find it (on an object store, one request less)."""
        compare = _Compare(stored.backend, stored.file(DCP_METADATA_NAME), size)
        with contextlib.suppress(_Parted):  # the rest of the rendering is not needed
            self.render(compare.write)
        return compare.verdict()

    def metadata(self, local: dict[str, Any] | None = None) -> Metadata:
        """``.metadata`` as the save wrote it: the head, and each record computed when looked up.

        ``local``: this rank's flattened state dict: each entry then lists only the saved boxes
        that overlap a box this rank loads (DCP's overlap rule: the same read items, without
        DCP's planner sorting and testing every saved box of every entry on every rank)."""
        head = self.head()
        if local is not None:
            described = dict(head.state_dict_metadata)
            for entry in self.entries:
                if entry.fqn in local and entry.properties is not None:
                    described[entry.fqn] = _narrowed(entry, described[entry.fqn], local[entry.fqn])
            head.state_dict_metadata = described
        head.storage_data = _DerivedStorage(self)  # type: ignore[assignment]
        return head


class _Expected(NotDerivable):
    """Not a problem, so logged at info: a record past a bound on the work of a derived load
    (:data:`MAX_COORDINATES`, ...), or of an earlier :data:`DERIVED_VERSION`."""


class _Parted(Exception):
    """The rendering parted from the file: rendering the rest would only cost time."""


class _Compare:
    """A ``write`` target comparing what it is given with a file, read once, in order, ``_PIECE`` at a time."""

    def __init__(self, backend: Any, path: str, size: int | None = None) -> None:
        self.backend, self.path, self.size = backend, path, size
        self.piece, self.pos, self.start = bytearray(), 0, 0  # the file's bytes from ``start``; compared up to ``pos``
        self.first: str | None = None

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            if self.pos == len(self.piece):
                self.start += len(self.piece)
                left = _PIECE if self.size is None else self.size - self.start  # no 16 MB for a 3 KB file
                self.piece, self.pos = bytearray(max(0, min(_PIECE, left))), 0
                if self.piece:
                    del self.piece[self.backend.read_into(self.path, self.start, memoryview(self.piece)) :]
                if not self.piece:
                    self.first = f"the file ends at byte {self.start}, before the rendering does"
                    raise _Parted
            k = min(len(view), len(self.piece) - self.pos)
            mine = self.piece[self.pos : self.pos + k]
            if mine != view[:k]:
                step = 4096
                i = next(i for i in range(0, k, step) if mine[i : i + step] != view[i : i + step])
                i = next(j for j in range(i, k) if mine[j] != view[j])
                self.first = f"they first differ at byte {self.start + self.pos + i}"
                raise _Parted
            self.pos += k
            view = view[k:]

    def verdict(self) -> str | None:
        """None when the file held exactly what was written."""
        end = self.start + len(self.piece)
        if self.first is None and (
            self.pos < len(self.piece)
            or (self.size > end if self.size is not None else self.backend.read_into(self.path, end, memoryview(bytearray(1))))
        ):
            self.first = "the file is longer than the rendering"
        return self.first


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
    offsets, sizes = _columns(entry.table)
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
    ``.metadata``). Not yet shown to be ``.metadata``'s (:func:`checkpoint_records`). Call it
    only once the listed files were found with their sizes. See [Note: derived loads]."""
    record = layout.get(DERIVED_KEY)
    if record is None:
        return None
    try:
        return _derive_load(record, world_size, files)
    except Exception as exc:  # noqa: BLE001 (any failure: the load reads .metadata, which is checked on its own)
        if _dist.rank() == 0:  # past a bound, or saved by an earlier shardbridge: read .metadata, as DCP does
            (logger.info if isinstance(exc, _Expected) else logger.warning)(
                "shardbridge.checkpoint: the manifest's layout.derived is not used (%s); reading .metadata instead",
                str(exc)[:300],
            )
        return None


def declared_digest(layout: dict[str, Any]) -> int:
    """The digest ``layout.derived`` says its spreads have (0: none)."""
    record = layout.get(DERIVED_KEY)
    digest = record.get("digest") if isinstance(record, dict) else None
    return digest if type(digest) is int and 0 < digest < 1 << 62 else 0


def checkpoint_records(stored: Stored, manifest: Manifest) -> DerivedRecords | None:
    """The derived records of ``stored`` if they render its ``.metadata`` byte for byte, else None
    (logged: read ``.metadata``). One rank's part of a load; inspect and export. See [Note: derived loads]."""
    records = derive_load(manifest.layout, manifest.world_size, manifest.files) if manifest.files else None
    if records is None:
        return None
    try:
        why = records.differs(stored, (manifest.files.get(DCP_METADATA_NAME) or {}).get("size"))
    except OSError as exc:
        why = f"it cannot be read: {exc}"
    if why is None:
        return records
    saved_by = manifest.torch_version.split("+")[0].split(".")[:2]
    if saved_by != torch.__version__.split("+")[0].split(".")[:2]:  # another torch pickles .metadata its own way
        why = f"{why}; saved under torch {manifest.torch_version}, this is {torch.__version__}"
    (logger.info if "saved under torch" in why else logger.warning)(
        "shardbridge.checkpoint: %s: the manifest's layout.derived does not give %s's records (%s): reading %s "
        "instead, which every other reader reads",
        stored, DCP_METADATA_NAME, why, DCP_METADATA_NAME,
    )  # fmt: skip
    return None


def metadata_of(stored: Stored, manifest: Manifest, *, data_files: bool = True) -> Metadata:
    """``stored``'s ``.metadata``: from its derived records when they render it, else read (restricted reader).

    ``data_files``: the caller found every listed file with its size (export); False (inspect):
    the sizes are checked here first, and the records are read from ``.metadata`` alone if any differs."""
    found = data_files or not check_files(stored, manifest, checksums=False)
    records = checkpoint_records(stored, manifest) if found else None
    return records.metadata() if records is not None else read_metadata(stored, data_files=data_files)


def _derive_load(record: Any, world_size: int, files: dict[str, dict[str, Any]]) -> DerivedRecords:
    if isinstance(record, dict) and type(record.get("version")) is int and 0 < record["version"] < DERIVED_VERSION:
        raise _Expected(f"layout.derived version {record['version']}, of an earlier shardbridge")
    if not isinstance(record, dict) or record.get("version") != DERIVED_VERSION:
        raise NotDerivable(f"layout.derived version {record.get('version') if isinstance(record, dict) else record!r}")
    data_files = {n: f["size"] for n, f in files.items() if DATA_FILE_PATTERN.fullmatch(n)}
    rng_files = sum(1 for n in files if n.startswith("rng/"))
    if not data_files or rng_files != world_size:  # every rank wrote its RNG file: bounds what follows
        raise NotDerivable(f"the manifest lists {rng_files} RNG files for a world of {world_size}")
    metadata_bytes = files.get(DCP_METADATA_NAME, {}).get("size", 0)
    digest, threads, min_file_bytes = (record.get(k) for k in ("digest", "threads", "min_file_bytes"))
    for name, value in (("digest", digest), ("threads", threads), ("min_file_bytes", min_file_bytes)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 1 << 62:
            raise NotDerivable(f"layout.derived.{name}={value!r}")
    checkpoint_id, version, paths = record.get("checkpoint_id"), record.get("dcp_version"), record.get("paths")
    if not (isinstance(checkpoint_id, str) and isinstance(version, str) and isinstance(paths, dict)) or not all(
        isinstance(v, list) and 1 <= len(v) <= 16 and all(type(p) in (str, int) for p in v) for v in paths.values()
    ):
        raise NotDerivable("layout.derived.checkpoint_id / dcp_version / paths are not str / str / {key: path}")
    grid_records = _list(record.get("grids"))
    if len(grid_records) > MAX_GRIDS:
        raise _Expected(f"layout.derived has more than {MAX_GRIDS} meshes")
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
    coordinates: dict[tuple[Any, ...], int] = {}  # per table: the mesh coordinates it evaluates
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
                raise _Expected(f"layout.derived has more than {MAX_LAYOUTS} distinct layouts")
            properties = decode_properties(props)
            spread = built[key] = rebuild(recipes[r], grids[g], keep_empty=keep_empty, properties=properties)
            shape = spread.grid.shape
            coordinates[table_key(spread)] = math.prod(n for d, n in enumerate(shape) if d not in spread.fixed_dims)
            if sum(coordinates.values()) > MAX_COORDINATES:
                raise _Expected(
                    f"layout.derived asks for more than {MAX_COORDINATES} mesh coordinates (world size {world_size} "
                    f"x {len(coordinates)} layouts); a derived load evaluates at most that many"
                )
        if (size is None) != (spread.properties is None) or (size is not None and not _valid_size(size)):
            raise NotDerivable(f"layout.derived.entries[{ordinal}]: size {size!r:.80}")
        spreads.append((fqn, spread))
        sizes.append(size)
    if spreads_digest(spreads) != digest:
        raise NotDerivable("the rebuilt spreads are not the ones the save agreed on (digest)")
    # 2. their tables (the work: every coordinate of every distinct layout), checked, and the writers
    budget, records = metadata_bytes // _CHUNK_BYTES, 0  # boxes, records: each takes bytes of .metadata
    tables: dict[tuple[Any, ...], SpreadTable] = {}
    for _, spread in spreads:
        tk = table_key(spread)
        if tk not in tables:
            tables[tk] = spread_table(spread, limit=budget)
            budget -= len(tables[tk].sizes)
        records += len(tables[tk].sizes)
    if budget < 0 or records > metadata_bytes // _RECORD_BYTES:
        raise NotDerivable(f"layout.derived gives more boxes or records than the {metadata_bytes}-byte .metadata holds")
    entries: list[Entry] = []
    for ordinal, ((fqn, spread), size) in enumerate(zip(spreads, sizes)):
        table = tables[table_key(spread)]
        if size is not None:
            _check_covers(table, tuple(size), ordinal)
        is_bytes = spread.properties is None
        entries.append(
            Entry(fqn, spread, table, writers(table, ordinal, bytes_item=is_bytes), spread.properties,
                  None if size is None else torch.Size(size))
        )  # fmt: skip
    derivation = derive(entries, only=None, bytes_lengths=lengths, threads=threads, min_file_bytes=min_file_bytes)
    rows = derivation.rows
    assert rows.offset is not None
    if bool(((rows.offset < 0) | (rows.length < 0) | (rows.offset + rows.length < rows.offset)).any()):
        raise NotDerivable("layout.derived lays records out past 2**63 bytes")
    derived = {data_file_name(w, f): size for (w, f), size in derivation.sizes.items()}
    if derived != data_files:
        wrong = sorted(set(derived) ^ set(data_files)) or [n for n in sorted(derived) if derived[n] != data_files[n]]
        raise NotDerivable(f"derived data files differ from the manifest's records (first: {wrong[0]})")
    return DerivedRecords(entries, derivation, digest, {k: tuple(v) for k, v in paths.items()}, checkpoint_id, version)


def _check_covers(table: SpreadTable, size: tuple[int, ...], ordinal: int) -> None:
    """NotDerivable unless the table's boxes cover a tensor of ``size`` exactly, each element once
    ([Note: exact chunk coverage], as ``.metadata``'s reader checks it); once per table and size."""
    if size in table.memo.get("covers", ()):
        return
    offsets, sizes = _columns(table)
    fault = None
    if table.offsets and offsets.shape[1] != len(size):
        fault = f"have {offsets.shape[1]} dims"
    elif table.offsets and bool(
        ((offsets < 0) | (sizes < 0) | (offsets + sizes > torch.tensor(size, dtype=torch.int64))).any()
    ):
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
