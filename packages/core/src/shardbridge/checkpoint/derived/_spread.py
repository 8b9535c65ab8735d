"""Which rank holds which box of every checkpoint entry, derived from the mesh instead of gathered.

[Note: derived plans]
~~~~~~~~~~~~~~~~~~~~~
DCP plans a save by gathering every rank's local plan on rank 0, which deduplicates the boxes
held by several ranks (HSDP replicas, replicated tensors) and builds ``.metadata``: rank 0
receives and plans over world x items. But in an SPMD job every rank's boxes are a function of
its mesh coordinate, the placements and the global shape (the layout algebra,
``shardbridge.layout``), so every rank can compute every other rank's boxes itself. A
:class:`Spread` is that function for one state-dict entry::

    Spread(grid, key, boxes_at)      grid: the global rank at every mesh coordinate
                                     key:  what boxes_at depends on (shape, placements, rule)
                                     boxes_at(coordinate) -> [(offsets, sizes), ...]

:func:`spread_table` evaluates it on every coordinate once per distinct ``(key, grid)`` (the
126 ``q_proj`` of a Llama share one table): the distinct boxes and, for each, the ranks that
hold it (coordinates that differ only along the mesh dims the boxes do not depend on, e.g. the
``dp_replicate`` axis of HSDP). Each box is written by ONE of its holders, chosen by a rule every
rank evaluates alike (:func:`writers`: the entry's ordinal modulo the number of holders, which
spreads replicated entries over the replicas; bytes items by the first holder, rank 0). So the
save needs no plan round: each rank filters its own local plan by the rule, and rank 0 knows
every rank's items without being sent them. That every rank has the same LAYOUT is checked, not
assumed: every rank hashes its entries' spreads into one digest (:func:`spreads_digest`,
compared in the save's argument round, or the asynchronous writer's first round) and checks that its own local plan is what its spreads
say for its coordinate (:func:`matches_plan`); a rank where either fails makes the save fall
back to ``dcp.save``. Entries without a spread (a framework's own boxes, through a
``StateDictProvider``) fall back the same way. That the replicas of a box hold the same DATA is
assumed, exactly as DCP's own deduplication assumes it (it keeps one holder's copy); a tensor
whose ranks hold different data under one name must be taken over by a provider
(``mark_rank_local`` refuses it otherwise: [Note: rank-local tensors]).
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

__all__ = [
    "Grid",
    "NotDerivable",
    "Spread",
    "SpreadTable",
    "matches_plan",
    "spread_table",
    "spreads_digest",
    "table_key",
    "writers",
]

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]
"""``(offsets, sizes)`` per box, in the order the rank's local tensor lists them."""


class NotDerivable(Exception):
    """An entry whose boxes are not a regular function of the mesh coordinate (fall back to gathering)."""


class Grid:
    """The global rank at every coordinate of a mesh (row-major), with a digest every rank agrees on."""

    __slots__ = ("digest", "ranks", "shape")

    def __init__(self, shape: Sequence[int], ranks: torch.Tensor) -> None:
        self.shape = tuple(int(s) for s in shape)
        self.ranks = ranks.reshape(-1).to(torch.int64).contiguous()
        assert self.ranks.numel() == math.prod(self.shape), (self.shape, self.ranks.numel())
        h = hashlib.blake2b(repr(self.shape).encode(), digest_size=16)
        h.update(self.ranks.numpy().tobytes())
        self.digest = h.hexdigest()

    @classmethod
    def tiled(cls, shape: Sequence[int], ranks: torch.Tensor, world_size: int) -> Grid:
        """A mesh of ``ranks`` and its copies: the grid ``(copies, *shape)`` of every rank of the job.

        In an SPMD job a DTensor on a sub-mesh (FSDP's ``dp_shard`` mesh of a TP-replicated norm)
        is held by every copy of that sub-mesh: the other tp ranks hold the same tensor on their
        own sub-mesh. The copies are the translates of this mesh's rank pattern that tile
        ``range(world_size)``, each starting at the lowest rank no earlier copy took. Every rank
        derives the same grid from its own copy.

        Raises:
            NotDerivable: the translates do not tile the job's ranks, or ``ranks`` is not one of them.
        """
        flat = ranks.reshape(-1).to(torch.int64)
        pattern = flat - int(flat.min())
        key = (tuple(int(s) for s in shape), pattern.numpy().tobytes(), world_size)
        grid = _TILED.get(key)
        if grid is None:
            taken = torch.zeros(world_size, dtype=torch.bool)
            bases = []
            for base in range(world_size):
                if taken[base]:
                    continue
                members = pattern + base
                if int(members.max()) >= world_size or bool(taken[members].any()):
                    raise NotDerivable(
                        f"mesh {tuple(shape)} with ranks {flat.tolist()[:8]}... does not tile {world_size} ranks"
                    )
                taken[members] = True
                bases.append(base)
            table = torch.tensor(bases, dtype=torch.int64)[:, None] + pattern[None, :]
            grid = cls((len(bases), *key[0]), table)
            if len(_TILED) > 256:
                _TILED.clear()
            _TILED[key] = grid
        if int(flat.min()) not in set(grid.ranks.view(grid.shape[0], -1)[:, 0].tolist()):
            raise NotDerivable(f"ranks {flat.tolist()[:8]}... are not one copy of the mesh")
        return grid

    @classmethod
    def everywhere(cls, world_size: int) -> Grid:
        """Every rank of the job, one mesh dim (what a replicated plain tensor lives on)."""
        grid = _EVERYWHERE.get(world_size)
        if grid is None:
            grid = _EVERYWHERE[world_size] = cls((world_size,), torch.arange(world_size))
        return grid


_EVERYWHERE: dict[int, Grid] = {}
_TILED: dict[tuple[Any, ...], Grid] = {}


@dataclass(frozen=True, eq=False)
class Spread:
    """The boxes of one entry on every coordinate of its mesh. See [Note: derived plans].

    Args:
        grid: the entry's mesh.
        key: everything ``boxes_at`` depends on (hashable; equal keys on equal grids give equal boxes).
        boxes_at: coordinate -> the ``(offsets, sizes)`` boxes held there, in local order.
        fixed_dims: mesh dims along which the boxes do not change (Replicate placements).
        keep_empty: DCP's own description of a DTensor writes a box of size 0 for an empty
            local shard; explicit boxes (``LocalChunks``) drop them.
        properties: the entry's tensor properties (dtype ...); None for a bytes item.
    """

    grid: Grid
    key: tuple[Any, ...]
    boxes_at: Callable[[tuple[int, ...]], Boxes]
    fixed_dims: tuple[int, ...] = ()
    keep_empty: bool = False
    properties: TensorProperties | None = None
    recipe: tuple[str, dict[str, Any]] | None = None
    """How to build this spread again from JSON values and its grid (``_recipes.py``; None:
    it cannot be, and a load of the checkpoint reads ``.metadata``). See [Note: derived loads]."""

    @classmethod
    def replicated(cls, world_size: int, shape: Sequence[int], properties: TensorProperties | None) -> Spread:
        """A plain tensor (or, with ``properties=None``, a bytes item) every rank holds whole."""
        size = tuple(int(s) for s in shape)
        box = [((0,) * len(size), size)]
        return cls(
            Grid.everywhere(world_size),
            ("replicated", size),
            lambda _coordinate: box,
            fixed_dims=(0,),
            keep_empty=True,
            properties=properties,
            recipe=("replicated", {"shape": list(size)}),
        )

    def signature(self) -> str:
        """A digest of what this spread says (its key, its grid and its properties)."""
        props = None if self.properties is None else (str(self.properties.dtype), self.properties.requires_grad)
        text = repr((self.key, self.grid.digest, self.fixed_dims, self.keep_empty, props))
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class SpreadTable:
    """The distinct boxes of a spread and the ranks holding each (``holders[u]`` ascending)."""

    offsets: tuple[tuple[int, ...], ...]
    sizes: tuple[tuple[int, ...], ...]
    holders: torch.Tensor
    """``[boxes, replicas]`` int64 global ranks."""
    position: dict[tuple[int, ...], int]
    """offsets -> index of the box."""
    at: dict[tuple[int, ...], tuple[int, ...]]
    """A coordinate (its fixed dims at 0) -> the indices of the boxes held there, in local order."""
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    """What the records derived from this table compute once (columns, chunk lists, lengths per dtype)."""

    def boxes_at(self, spread: Spread, coordinate: Sequence[int]) -> Boxes:
        """The boxes ``spread`` puts at ``coordinate`` (empty ones dropped unless ``keep_empty``)."""
        free = tuple(0 if d in spread.fixed_dims else c for d, c in enumerate(coordinate))
        return [(self.offsets[u], self.sizes[u]) for u in self.at.get(free, ())]


_TABLES: dict[tuple[Any, ...], SpreadTable] = {}
_MAX_TABLES = 4096


def table_key(spread: Spread) -> tuple[Any, ...]:
    """What a spread's table depends on: equal keys, equal tables."""
    return (spread.key, spread.grid.digest, spread.fixed_dims, spread.keep_empty)


def spread_table(spread: Spread, *, limit: int | None = None) -> SpreadTable:
    """Every distinct box of ``spread`` and its holders, computed once per :func:`table_key`.

    Raises:
        NotDerivable: two coordinates describe different boxes at the same offsets, the boxes
            do not have the same number of holders, or there are more than ``limit`` of them.
    """
    cache_key = table_key(spread)
    table = _TABLES.get(cache_key)
    if table is None:
        table = _build_table(spread, limit)
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        _TABLES[cache_key] = table
    return table


def _build_table(spread: Spread, limit: int | None) -> SpreadTable:
    shape = spread.grid.shape
    free_dims = [d for d in range(len(shape)) if d not in spread.fixed_dims]
    fixed_dims = [d for d in range(len(shape)) if d in spread.fixed_dims]
    # row i: the ranks of the i-th free coordinate (row-major) over every fixed coordinate
    by_free = (
        spread.grid.ranks.view(shape)
        .permute(*free_dims, *fixed_dims)
        .reshape(math.prod(shape[d] for d in free_dims), -1)
    )
    offsets: list[tuple[int, ...]] = []
    sizes: list[tuple[int, ...]] = []
    rows: list[list[int]] = []  # per box, the free coordinates (rows of by_free) that hold it
    position: dict[tuple[int, ...], int] = {}
    at: dict[tuple[int, ...], tuple[int, ...]] = {}
    for row, free in enumerate(itertools.product(*(range(shape[d]) for d in free_dims))):
        coordinate = [0] * len(shape)
        for d, c in zip(free_dims, free):
            coordinate[d] = c
        held = []
        for box_offsets, box_sizes in spread.boxes_at(tuple(coordinate)):
            if not spread.keep_empty and 0 in box_sizes:
                continue
            u = position.get(box_offsets)
            if u is None:
                u = position[box_offsets] = len(offsets)
                offsets.append(box_offsets)
                sizes.append(box_sizes)
                rows.append([row])
            elif sizes[u] != box_sizes:
                raise NotDerivable(f"{spread.key}: boxes {sizes[u]} and {box_sizes} both at offsets {box_offsets}")
            else:
                rows[u].append(row)
            held.append(u)
        at[tuple(coordinate)] = tuple(held)
        if limit is not None and len(offsets) > limit:
            raise NotDerivable(f"{spread.key}: more than {limit} boxes")
    counts = {len(r) for r in rows}
    if len(counts) > 1:
        raise NotDerivable(f"{spread.key}: boxes held by different numbers of ranks")
    if rows and len(rows[0]) == 1:
        holders = by_free[torch.tensor([r[0] for r in rows], dtype=torch.int64)]
    else:
        holders = (
            torch.stack([by_free[torch.tensor(r, dtype=torch.int64)].reshape(-1) for r in rows])
            if rows
            else by_free[:0]
        )
    holders = torch.sort(holders, dim=1).values if holders.numel() else holders.reshape(len(rows), -1)
    return SpreadTable(tuple(offsets), tuple(sizes), holders.contiguous(), position, at)


def writers(table: SpreadTable, ordinal: int, *, bytes_item: bool = False) -> torch.Tensor:
    """The rank that writes each box of an entry: holder ``ordinal % replicas`` (a bytes item: the first)."""
    replicas = table.holders.shape[1]
    if replicas == 0:
        return torch.empty(0, dtype=torch.int64)
    return table.holders[:, 0 if bytes_item else ordinal % replicas]


def spreads_digest(spreads: Sequence[tuple[str, Spread | None]]) -> int:
    """One 62-bit digest of every entry's name and spread; 0 if any entry has none."""
    h = hashlib.blake2b(digest_size=8)
    for fqn, spread in spreads:
        if spread is None:
            return 0
        h.update(f"{fqn}\0{spread.signature()}\0".encode())
    return (int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)) or 1


def matches_plan(
    plan: SavePlan, spreads: dict[str, Spread], coordinate_of: Callable[[Spread], tuple[int, ...] | None]
) -> bool:
    """Whether this rank's local plan lists exactly the boxes (and properties) its spreads give its coordinate."""
    mine: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    props: dict[str, Any] = {}
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            mine.setdefault(item.index.fqn, [])
            continue
        assert item.tensor_data is not None
        chunk = item.tensor_data.chunk
        mine.setdefault(item.index.fqn, []).append((tuple(chunk.offsets), tuple(chunk.sizes)))
        props.setdefault(item.index.fqn, item.tensor_data.properties)
    if set(mine) - set(spreads):
        return False
    for fqn, spread in spreads.items():
        coordinate = coordinate_of(spread)
        if coordinate is None:
            return False
        if spread.properties is None:
            if mine.get(fqn) != []:
                return False
            continue
        if mine.get(fqn, []) != spread_table(spread).boxes_at(spread, coordinate):
            return False
        if fqn in props and props[fqn] != spread.properties:
            return False
    return True
