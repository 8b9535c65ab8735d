"""The spread of one flattened state-dict value: its boxes on every rank, from its layout.

What the state side hands a save is a flattened state dict: DTensors (boxes as DCP describes
them), :class:`~shardbridge.checkpoint.state._chunks.LocalChunks` with an
:class:`~shardbridge.checkpoint.state._chunks.Origin` (repaired layouts, fused components,
staged copies: the layout their boxes follow from), plain tensors and other values (every rank
holds them whole). :func:`entry_spread` turns each into a :class:`Spread` ([Note: derived plans]
in ``_spread.py``); a value without a known layout (a framework's own boxes) has none, and the
save cannot be derived.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from shardbridge._fused import FusedSpec, split_local
from shardbridge.checkpoint.derived._spread import Boxes, Grid, NotDerivable, Spread
from shardbridge.checkpoint.state._chunks import LocalChunks, Origin
from shardbridge.checkpoint.state._repair import RULES, chunk_boxes, true_chunk
from shardbridge.layout import chunk_box, dcp_chunk

__all__ = ["component_spread", "entry_spread", "placement_spread"]


def entry_spread(value: Any, world_size: int, grids: dict[Any, Grid | None] | None = None) -> Spread | None:
    """The spread of one flattened state-dict value (None: not derivable).

    ``grids``: each mesh's :class:`Grid`, filled as the meshes come (one save's entries share a few
    meshes, and a ``DeviceMesh`` builds its rank tensor anew each time it is asked)."""
    grids = {} if grids is None else grids
    if isinstance(value, LocalChunks):
        return None if value.origin is None else _origin_spread(value, value.origin, world_size, grids)
    if isinstance(value, DTensor):
        if value.device_mesh.get_coordinate() is None:
            return None  # a sub-mesh this rank is not on: DCP writes nothing here
        properties = TensorProperties.create_from_tensor(value.to_local())  # as DCP describes a DTensor
        grid = _grid(value.device_mesh, world_size, grids)
        if grid is None:
            return None
        return placement_spread(tuple(value.shape), grid, tuple(value.placements), "dcp", properties=properties)
    if isinstance(value, torch.Tensor):
        return Spread.replicated(world_size, tuple(value.shape), TensorProperties.create_from_tensor(value))
    return Spread.replicated(world_size, (), None)


def _grid(mesh: Any, world_size: int, grids: dict[Any, Grid | None]) -> Grid | None:
    key = id(mesh)  # the caller's dict, for one save: every mesh in it is alive (its values hold them)
    if key not in grids:
        try:
            grids[key] = Grid.tiled(mesh.shape, mesh.mesh, world_size)
        except NotDerivable:
            grids[key] = None
    return grids[key]


def _origin_spread(chunks: LocalChunks, origin: Origin, world_size: int, grids: dict[Any, Grid | None]) -> Spread | None:
    pieces = chunks.pieces
    # what DCP records for the chunks' write items (the first piece's), else the origin's dtype
    properties = TensorProperties.create_from_tensor(pieces[0][1]) if pieces else TensorProperties(dtype=origin.dtype)
    if origin.mesh is None:
        whole = Spread.replicated(world_size, origin.shape, None)
    else:
        grid = _grid(origin.mesh, world_size, grids)
        if grid is None:
            return None
        whole = placement_spread(origin.shape, grid, origin.placements, origin.rule, multi=origin.multi)
    if origin.fused is not None:
        spec, tp_size, name = origin.fused
        return component_spread(whole, spec, tp_size, name, properties)
    return dataclasses.replace(whole, keep_empty=False, properties=properties)  # LocalChunks drop empty boxes


def placement_spread(
    shape: tuple[int, ...],
    grid: Grid,
    placements: tuple[Placement, ...],
    rule: str,
    *,
    multi: bool = False,
    properties: TensorProperties | None = None,
) -> Spread:
    """The boxes of a DTensor of ``shape`` with ``placements`` on the mesh whose ``Grid.tiled`` is
    ``grid``, read by ``rule`` ("dcp": DCP's own description, empty boxes kept; "true" / "local":
    ``state/_repair.py``'s ``RULES``, one box per range when ``multi``)."""
    mesh_shape = grid.shape[1:]
    # the grid's dim 0 numbers the copies of the mesh ([Note: derived plans]): boxes do not depend on it
    fixed = (0,) + tuple(d + 1 for d, p in enumerate(placements) if isinstance(p, Replicate))
    if rule == "dcp":
        # An entry kept as a DTensor is one whose true boxes DCP describes right on every coordinate
        # (_verdict), so the pure algebra gives DCP's box; torch's own computation (slow for
        # _StridedShard: ~3 ms a call) only where a box is empty, whose offsets are DCP's convention.
        def boxes_at(coordinate: tuple[int, ...]) -> Boxes:
            box = chunk_box(shape, true_chunk(shape, mesh_shape, placements, coordinate[1:]))
            if box is None or 0 in box[0]:
                box = dcp_chunk(shape, mesh_shape, placements, coordinate[1:])
            return [(box[1], box[0])]

    else:
        fn = RULES[rule]

        def boxes_at(coordinate: tuple[int, ...]) -> Boxes:
            chunk = fn(shape, mesh_shape, placements, coordinate[1:])
            if multi:
                return chunk_boxes(chunk)
            box = chunk_box(shape, chunk)
            return [] if box is None else [(box[1], box[0])]

    key = (rule, multi, shape, mesh_shape, tuple(repr(p) for p in placements))
    recipe = {"shape": list(shape), "placements": list(key[4]), "rule": rule, "multi": multi}
    return Spread(
        grid,
        key,
        boxes_at,
        fixed_dims=fixed,
        keep_empty=rule == "dcp",
        properties=properties,
        recipe=("placement", recipe),
    )


def component_spread(whole: Spread, spec: FusedSpec, tp_size: int, name: str, properties: TensorProperties) -> Spread:
    """The boxes of one component on every rank: the fused tensor's boxes, split as the state side splits them."""

    def boxes_at(coordinate: tuple[int, ...]) -> Boxes:
        out = []
        for offsets, sizes in whole.boxes_at(coordinate):
            if 0 in sizes:
                continue
            meta = torch.empty(sizes, device="meta")
            for piece in split_local(meta, spec, tp_size, offsets[spec.dim]):
                if piece.name == name:
                    at = list(offsets)
                    at[spec.dim] = piece.component_offset
                    out.append((tuple(at), tuple(piece.view.shape)))
        return out

    key = ("fused", name, repr(spec), tp_size, whole.key)
    recipe = None
    if whole.recipe is not None:
        fused = {"components": [list(c) for c in spec.components], "dim": spec.dim, "head_dim": spec.head_dim}
        recipe = ("fused", {"name": name, "spec": fused, "tp_size": tp_size, "whole": list(whole.recipe)})
    return Spread(whole.grid, key, boxes_at, fixed_dims=whole.fixed_dims, properties=properties, recipe=recipe)

