"""Layouts DCP would describe wrongly: checked on every mesh coordinate, repaired with true boxes.

[Note: DCP layout repair]
~~~~~~~~~~~~~~~~~~~~~~~~~
DCP describes a DTensor's local tensor with one box computed from its placements
(``_compute_local_shape_and_global_offset``). For FSDP2 x TP with uneven TP pieces that box
is not what the rank holds (dim 0 = 9, mesh (dp_shard=4, tp=2), see [Note: strided
sharding order] in ``shardbridge/layout/_algebra.py``)::

    coordinate   holds (FSDP2)   DCP describes
    (3, 0)       nothing         row 8          <- save writes 0 rows under a 1-row box
    (3, 1)       row 8           nothing        <- row 8 is never written

``dcp.save`` succeeds; the checkpoint does not load. Before saving, every DTensor is checked
with the layout algebra for EVERY mesh coordinate (pure, so all ranks agree without
communicating). Where the rank's true box differs from DCP's, the entry is replaced by a
:class:`~shardbridge.checkpoint.state._chunks.LocalChunks` holding the true box and a view of the
local tensor ("repair"), or ``on_bad_layout="error"`` raises. Entries DCP describes right stay
DTensors. Data that is not one box (several ranges along a dim, e.g. a packed ``[gate; up]``
weight under ``_StridedShard`` TP) is written as one box per range when the algebra explains
the local tensor's order (``_multi_box_pieces``; ``on_bad_layout="error"`` raises instead),
and raises otherwise. The same objects serve loading (views into the live local
tensors), so a checkpoint saved by any layout loads into any other.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from shardbridge._compat import local_tensor
from shardbridge.checkpoint.state._chunks import LocalChunks, Origin
from shardbridge.layout import Chunk, chunk_box, dcp_chunk, find_dcp_mismatches, fsdp_chunk, local_chunk

__all__ = [
    "Box",
    "OnBadLayout",
    "box_rule",
    "boxed_pieces",
    "check_dtensor",
    "RULES",
    "chunk_boxes",
    "describe",
    "dtensor_origin",
    "local_box",
    "true_chunk",
]

logger = logging.getLogger("shardbridge.checkpoint")

OnBadLayout = Literal["repair", "error"]
_LOGGED_REPAIRS: set[tuple[str, tuple[int, ...], tuple[Placement, ...]]] = set()

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (sizes, offsets)


def true_chunk(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...], coordinate: Sequence[int]
) -> Chunk:
    """What the local tensor at ``coordinate`` holds: FSDP2's layout for placements
    ``fully_shard`` builds, else the DTensor's own (left-to-right) reading."""
    try:
        return fsdp_chunk(shape, mesh_shape, placements, coordinate)
    except ValueError:
        return local_chunk(shape, mesh_shape, placements, coordinate)


@dataclass(frozen=True)
class _LayoutVerdict:
    bad: bool
    """Some coordinate's true data differs from DCP's box."""
    non_contiguous: bool
    """Some coordinate's true data is not one box."""
    detail: str
    """A mismatch message with a fix, or ""."""


@functools.lru_cache(maxsize=4096)
def _verdict(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    names: tuple[str, ...] | None,
) -> _LayoutVerdict:
    """Compare the truth with DCP's box on every coordinate (pure: every rank agrees)."""
    bad = non_contiguous = False
    # Coordinates along Replicate axes hold the same data: checking index 0 suffices.
    axes = [range(1) if isinstance(p, Replicate) else range(s) for s, p in zip(mesh_shape, placements)]
    for coordinate in itertools.product(*axes):
        box = chunk_box(shape, true_chunk(shape, mesh_shape, placements, coordinate))
        if box is None:
            bad = non_contiguous = True
            break
        dcp = dcp_chunk(shape, mesh_shape, placements, coordinate)
        if box != dcp and not (0 in box[0] and 0 in dcp[0]):  # both empty: nothing written, offsets do not matter
            bad = True
    detail = ""
    if bad:
        mismatches = [
            m
            for m in find_dcp_mismatches(shape, mesh_shape, placements, mesh_dim_names=names)
            if m.kind != "empty_shard"
        ]
        if mismatches:
            detail = mismatches[0].reason
    return _LayoutVerdict(bad=bad, non_contiguous=non_contiguous, detail=detail)


def describe(fqn: str, t: DTensor) -> str:
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    mesh_text = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f"{fqn!r} (shape {tuple(t.shape)}, placements {tuple(t.placements)}, mesh ({mesh_text}))"


RULES = {"true": true_chunk, "local": local_chunk}
"""How a rank's data is read from the placements: FSDP2's layout where it applies, or DTensor's own."""


def local_box(fqn: str, t: DTensor) -> Box:
    """The true (sizes, offsets) of this rank's local tensor; ValueError if not one box."""
    return box_rule(fqn, t)[0]


def box_rule(fqn: str, t: DTensor) -> tuple[Box, str]:
    """:func:`local_box` and the rule of :data:`RULES` that explains it."""
    shape, mesh_shape, placements = tuple(t.shape), tuple(t.device_mesh.shape), tuple(t.placements)
    coordinate = t.device_mesh.get_coordinate()
    assert coordinate is not None, "rank is not part of the DTensor's mesh"
    local_shape = tuple(local_tensor(t).shape)
    candidates = [(rule, fn(shape, mesh_shape, placements, coordinate)) for rule, fn in RULES.items()]
    for rule, chunk in candidates:
        box = chunk_box(shape, chunk)
        if box is None:
            continue
        if box[0] == local_shape:
            return box, rule
    if all(chunk_box(shape, c) is None for _, c in candidates):
        raise ValueError(
            f"{describe(fqn, t)}: this rank's data is several separate ranges along a dim, which DCP "
            "cannot describe with one box per rank; redistribute it to Shard/Replicate placements "
            "before saving (e.g. dtensor.redistribute(mesh, [Shard(0), ...])) or choose dims divisible "
            "by the mesh axes that shard them"
        )
    raise ValueError(
        f"{describe(fqn, t)}: the local tensor has shape {local_shape}, which the layout algebra "
        f"does not explain (it expects {[chunk_box(shape, c) for _, c in candidates]}); shardbridge cannot "
        "save it safely. Please report this layout"
    )


def _multi_box_pieces(t: DTensor) -> tuple[list[tuple[tuple[int, ...], torch.Tensor]], str] | None:
    """This rank's local tensor as one view per box of its (several-range) chunk; None if unexplained.

    The local tensor holds the chunk's ranges of each dim in increasing global order (how
    ``_StridedShard`` and FSDP2 lay them out), so box ``(r_0, r_1, ...)`` is the local slice at
    the summed lengths of the ranges before it.
    """
    shape, mesh_shape, placements = tuple(t.shape), tuple(t.device_mesh.shape), tuple(t.placements)
    coordinate = t.device_mesh.get_coordinate()
    local = local_tensor(t).detach()
    for rule, fn in RULES.items():
        chunk = fn(shape, mesh_shape, placements, coordinate)
        if tuple(sum(b - a for a, b in dim) for dim in chunk) != tuple(local.shape):
            continue
        pieces = []
        for ranges in itertools.product(*(list(enumerate(dim)) for dim in chunk)):
            view, offsets = local, []
            for d, (i, (start, stop)) in enumerate(ranges):
                before = sum(b - a for a, b in chunk[d][:i])
                view = view.narrow(d, before, stop - start)
                offsets.append(start)
            pieces.append((tuple(offsets), view))
        return pieces, rule
    return None


def dtensor_origin(t: DTensor, rule: str, *, multi: bool = False) -> Origin:
    """The :class:`Origin` of a DTensor's boxes read by ``rule`` (see :data:`RULES`)."""
    return Origin(tuple(t.shape), t.dtype, t.device_mesh, tuple(t.placements), rule, multi)


def chunk_boxes(chunk: Chunk) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """One ``(offsets, sizes)`` box per product of ranges, in the order ``_multi_box_pieces`` views them."""
    return [
        (tuple(start for start, _ in ranges), tuple(stop - start for start, stop in ranges))
        for ranges in itertools.product(*chunk)
    ]


def boxed_pieces(local: torch.Tensor, box: Box) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    sizes, offsets = box
    return [(offsets, local)] if 0 not in sizes else []


def check_dtensor(fqn: str, t: DTensor, on_bad_layout: OnBadLayout, log: bool) -> LocalChunks | None:
    """None when DCP describes ``t`` right, else the repaired chunk object (or raise)."""
    mesh = t.device_mesh
    verdict = _verdict(tuple(t.shape), tuple(mesh.shape), tuple(t.placements), mesh.mesh_dim_names)
    if verdict.non_contiguous:
        # e.g. a packed [gate; up] weight under _StridedShard TP: each rank holds one range of each
        # half. Written as several boxes (one per range), which DCP describes right.
        found = _multi_box_pieces(t)
        if found is None or on_bad_layout == "error":
            raise ValueError(
                f"{describe(fqn, t)}: some rank holds several separate ranges of a dim, which DCP cannot "
                f"describe with one box per rank ({verdict.detail or 'non-contiguous shard'}); redistribute it "
                "to Shard/Replicate placements before saving"
                + ("" if found is None else ", or save with on_bad_layout='repair' to write one box per range")
            )
        pieces, rule = found
        return LocalChunks(t.shape, pieces, origin=dtensor_origin(t, rule, multi=True))
    if not verdict.bad:
        return None
    if on_bad_layout == "error":
        raise ValueError(
            f"{describe(fqn, t)}: DCP would describe some ranks' shards wrongly and the checkpoint would "
            f"not load ({verdict.detail}); save with on_bad_layout='repair' (the default) to write explicit "
            "chunk boxes"
        )
    key = (fqn, tuple(t.shape), tuple(t.placements))
    if log and key not in _LOGGED_REPAIRS:
        _LOGGED_REPAIRS.add(key)
        logger.warning(
            "shardbridge.checkpoint: %s: DCP's own description of this layout is wrong (%s); writing "
            "explicit chunk boxes instead (see [Note: DCP layout repair])",
            describe(fqn, t),
            verdict.detail,
        )
    box, rule = box_rule(fqn, t)
    return LocalChunks(t.shape, boxed_pieces(local_tensor(t).detach(), box), origin=dtensor_origin(t, rule))
