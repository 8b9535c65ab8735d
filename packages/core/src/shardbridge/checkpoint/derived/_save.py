"""The derived save protocol: no plan round, and a write round that carries only file records.

[Note: the derived protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The default save protocol ([Note: save protocols] in ``checkpoint/_protocol.py``). Per save, every rank:

1. in the save's argument round (which runs anyway; an asynchronous save: in its writer thread,
   on the snapshot, in a round of its own): builds its local plan as DCP does, the spread of
   every entry ([Note: derived plans] in ``_spread.py``) and their digest; the round's
   all-reduce compares the digests (two more int64s);
2. keeps the items it writes by the writer rule (each box by one of its holders), writes them
   by the file rule ([Note: derived file layout] in ``storage/_files.py``), and checks that what
   it wrote is what the rules say;
3. in the write round: sends rank 0 its files' records (size, checksum) and whether step 2's
   check held -- a fixed-size message ([Note: fixed-size gather] in ``checkpoint/_dist.py``); rank 0 derives
   every rank's storage records, checks every file's size against them, writes ``.metadata``
   as a stream ([Note: streamed .metadata]) and commits; the outcome is broadcast.

Rounds per save: 5 collectives whatever the world size (the write round opens with a gate:
[Note: collective entry points] in ``checkpoint/_dist.py``); bytes received per rank other than 0:
constant; rank 0 receives world x (one fixed-size message). Rank 0's work is the distinct boxes
``.metadata`` must list (tensor operations per entry, no Python object per box).

Where a rank's digest differs (not SPMD: pipeline stages, different models), an entry has no
spread (a framework's own boxes through a ``StateDictProvider``), or a rank's plan is not what
its spreads say, every rank falls back to ``dcp.save`` (:class:`~shardbridge.checkpoint._protocol.
DCPSave`) for this save, with the same result. Where a rank's records differ from the
file rule, that rank alone sends its records (the slow path of step 3).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from shardbridge._compat import DCPStoragePrefix
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._protocol import DCPSave
from shardbridge.checkpoint.derived._layouts import entry_spread
from shardbridge.checkpoint.derived._records import (
    Derivation,
    Entry,
    derive,
    describe,
    head_metadata,
    laid_out,
    record_groups,
)
from shardbridge.checkpoint.derived._spread import Spread, matches_plan, spread_table, spreads_digest, writers
from shardbridge.checkpoint.state._chunks import SavePlanner
from shardbridge.checkpoint.storage._files import data_file_name
from shardbridge.checkpoint.storage._metadata_stream import StorageGroup
from shardbridge.checkpoint.storage._writer import DCP_VERSION, RECORDS_KEY, RankFiles, Writer

__all__ = ["DerivedSave"]


@dataclass
class DerivedLocal:
    """A rank's part of the argument round: its local plan and (when derivable) its entries."""

    plan: SavePlan
    entries: list[Entry] | None
    digest: int
    """Of every entry's name and spread; 0 when this rank cannot derive (see [Note: the derived protocol])."""


def _entries(planner: SavePlanner, plan: SavePlan, world_size: int) -> tuple[list[Entry] | None, int]:
    items: dict[str, list[Any]] = {}
    for item in plan.items:
        items.setdefault(item.index.fqn, []).append(item)
    values = planner.state_dict
    grids: dict[Any, Any] = {}  # each mesh's grid, for this save's entries
    spreads = [(fqn, entry_spread(value, world_size, grids)) for fqn, value in values.items()]
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
    except Exception:  # noqa: BLE001 (NotDerivable, or any surprise: dcp.save saves it right)
        return None, 0
    if not matches_plan(plan, by_fqn, lambda s: _coordinate(s, rank)):
        return None, 0
    return out, digest


_COORDS: dict[tuple[str, int], tuple[int, ...] | None] = {}
_UNKNOWN = object()


def _coordinate(spread: Spread, rank: int) -> tuple[int, ...] | None:
    """``rank``'s coordinate on the spread's grid (None: not on it)."""
    grid = spread.grid
    key = (grid.digest, rank)
    known = _COORDS.get(key, _UNKNOWN)  # one lookup: an async save's writer thread may clear the cache meanwhile
    if known is not _UNKNOWN:
        return known
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
    return coordinate


def _own_keys(entries: list[Entry], derivation: Derivation, rank: int) -> dict[tuple[str, Any], tuple[str, int, int]]:
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


def storage_groups(
    entries: list[Entry], derivation: Derivation, own: dict[int, list[WriteResult]]
) -> tuple[list[str], list[StorageGroup]]:
    """Every record for ``.metadata``: derived rows, except the ranks in ``own`` (their real records)."""
    names, groups = record_groups(entries, derivation, sorted(own))
    return names, groups + _real_groups(entries, own, names)


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


@dataclass(kw_only=True)
class DerivedSave:
    """Plans derived from the mesh, records from the file rule. See [Note: the derived protocol]."""

    name: str = "derived"

    def local(self, dcp_state: dict[str, Any]) -> DerivedLocal:
        """This rank's local plan, its entries' spreads and their digest (0: not derivable here)."""
        planner = SavePlanner()
        planner.set_up_planner(state_dict=dcp_state, storage_meta=None, is_coordinator=_dist.rank() == 0)
        plan = planner.create_local_plan()
        entries, digest = _entries(planner, plan, _dist.world_size())
        return DerivedLocal(plan, entries, digest)

    @staticmethod
    def digest(local: DerivedLocal) -> int:
        """What the argument round compares across ranks (0: this rank cannot derive)."""
        return local.digest

    def save(self, dcp_state: dict[str, Any], writer: Writer, local: DerivedLocal, derived: bool = False) -> None:
        """The derived write round, or the fallback protocol when ``derived`` is False (see the Note)."""
        if not derived or local.entries is None:
            DCPSave().save(dcp_state, writer, None)  # a save that cannot be derived
            return
        entries = local.entries
        rank = _dist.rank()
        threads, min_file_bytes = writer.threads, writer.min_file_bytes
        state: dict[str, Any] = {}

        def write() -> tuple[RankFiles, bool, list[WriteResult] | None]:
            order = {entries[i].fqn: k for k, i in enumerate(laid_out(entries))}  # [Note: derived file layout]
            mine = sorted((i for i in local.plan.items if _writes(i, entries_by_fqn, rank)), key=lambda i: order[i.index.fqn])
            plan = SavePlan(mine, storage_data=DCPStoragePrefix(f"__{rank}_"), planner_data=local.plan.planner_data)
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            planner = SavePlanner()
            planner.set_up_planner(state_dict=dcp_state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            results = writer.write_data(planner.finish_plan(plan), planner).wait()
            records = next(r.storage_data for r in results if r.index.fqn == RECORDS_KEY)
            actual = _actual(results)
            bytes_lengths = {fqn: length for (fqn, at), (_, _, length) in actual.items() if at is None}
            derivation = derive(
                entries, only=None if rank == 0 else rank, bytes_lengths=bytes_lengths,
                threads=threads, min_file_bytes=min_file_bytes,
            )  # fmt: skip
            state["derivation"], state["bytes_lengths"] = derivation, bytes_lengths
            ok = _own_keys(entries, derivation, rank) == actual
            return records, ok, None if ok else results

        entries_by_fqn = {e.fqn: e for e in entries}

        def finish(parts: list[tuple[RankFiles, bool, list[WriteResult] | None]]) -> None:
            derivation: Derivation = state["derivation"]
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
                recipe = describe(entries, local.digest, state["bytes_lengths"], threads, min_file_bytes,
                                  local.plan.planner_data, writer.storage_meta(), DCP_VERSION)  # fmt: skip
            writer.finish_stream(head, names, groups, [part[0] for part in parts], derived=recipe)

        _dist.gather_reduce(write, finish, small=True, last=True)  # the save's last round


def _writes(item: Any, entries: dict[str, Entry], rank: int) -> bool:
    """Whether this rank writes ``item`` (the writer rule of its entry's box)."""
    entry = entries[item.index.fqn]
    if item.type == WriteItemType.BYTE_IO:
        return int(entry.writer[0]) == rank
    u = entry.table.position[tuple(item.index.offset)]
    return int(entry.writer[u]) == rank
