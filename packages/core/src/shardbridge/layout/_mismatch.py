"""Where DCP describes a layout wrongly: :func:`find_dcp_mismatches` and its messages.

Compares, for every mesh coordinate, what is held (``_algebra.py``: FSDP2's layout, the
DTensor's, or a caller's function) with the one box DCP writes (:func:`dcp_chunk`); see
[Note: what DCP describes] in ``_algebra.py``. Each bad coordinate becomes a
:class:`LayoutMismatch` whose message says why and what to change.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardbridge._compat import compute_local_shape_and_global_offset
from shardbridge.layout._algebra import (
    Chunk,
    DimIntervals,
    _check_layout,
    _chunk_bounds,
    _fsdp_axes,
    _fsdp_chunk,
    _length,
    _local_chunk,
    _require_fsdp_axes,
    chunk_box,
)

__all__ = ["ActualLayout", "LayoutMismatch", "MismatchKind", "find_dcp_mismatches"]

MismatchKind = Literal["empty_shard", "non_contiguous", "offset_mismatch"]
ActualLayout = Literal["dtensor", "fsdp"] | Callable[[tuple[int, ...]], Chunk] | None

_MAX_MESSAGES = 3  # render_layout (in _text.py): mismatch messages shown in full
_FSDP_AXIS_NAMES = {2: ("dp_shard", "tp"), 3: ("dp_replicate", "dp_shard", "tp")}

# --------------------------------------------------------------------------- mismatches


@dataclass(frozen=True, kw_only=True)
class LayoutMismatch:
    """One mesh coordinate whose checkpoint description or TP shard is wrong.

    Attributes:
        coordinate: The mesh coordinate.
        rank: The row-major rank of ``coordinate``.
        kind: ``"empty_shard"``: the TP-local piece is empty (FSDP2 backward crashes);
            ``"non_contiguous"``: the local data is several ranges, which one DCP box cannot
            describe; ``"offset_mismatch"``: one box, but not the one DCP describes.
        actual: Per tensor dim, the intervals the coordinate holds.
        described: ``(sizes, offsets)`` that DCP writes for it.
        reason: Why, without the fix (for callers that apply their own fix).
        message: Why, and what to change.
    """

    coordinate: tuple[int, ...]
    rank: int
    kind: MismatchKind
    actual: Chunk
    described: tuple[tuple[int, ...], tuple[int, ...]]
    reason: str
    message: str

    def __str__(self) -> str:
        return self.message


def _resolve_actual(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: tuple[Placement, ...],
    actual: ActualLayout,
) -> tuple[Callable[[tuple[int, ...]], Chunk], str]:
    """Return the function coordinate -> held intervals, and who holds them (for messages)."""
    if callable(actual):
        return actual, "the local tensor"
    axes = _fsdp_axes(mesh_shape, placements)
    if actual == "fsdp" or (actual is None and axes is not None):
        axes = _require_fsdp_axes(mesh_shape, placements)
        return (lambda c: _fsdp_chunk(global_shape, mesh_shape, axes, c)), "FSDP2"
    if actual in (None, "dtensor"):
        return (lambda c: _local_chunk(global_shape, mesh_shape, placements, c)), "the DTensor"
    raise ValueError(
        f"actual={actual!r} is not a layout; use None (FSDP2's layout for FSDP2 placements, "
        "else the DTensor's), 'fsdp', 'dtensor' or a function coordinate -> intervals"
    )


def _tp_mesh_dims(
    mesh_shape: Sequence[int], placements: Sequence[Placement], mesh_dim_names: Sequence[str] | None
) -> list[int]:
    if mesh_dim_names is not None:
        return [i for i, name in enumerate(mesh_dim_names) if name == "tp"]
    axes = _fsdp_axes(mesh_shape, placements)
    return [axes.tp_mesh_dim] if axes is not None and axes.tp_mesh_dim is not None else []


def _raw_mismatches(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: tuple[Placement, ...],
    held: Callable[[tuple[int, ...]], Chunk],
    tp_mesh_dims: Sequence[int],
) -> list[tuple[tuple[int, ...], MismatchKind, Chunk, tuple[tuple[int, ...], tuple[int, ...]], int]]:
    """(coordinate, kind, actual, described, tensor dim) for each bad coordinate, no messages."""
    out = []
    for coordinate in itertools.product(*(range(s) for s in mesh_shape)):
        actual = held(coordinate)
        sizes, offsets = compute_local_shape_and_global_offset(
            tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements)
        )
        described = (tuple(int(s) for s in sizes), tuple(int(o) for o in offsets))
        box = chunk_box(global_shape, actual)
        # TP cuts the global tensor before FSDP2 does: the TP piece is a torch.chunk of it
        empty_dims = [
            p.dim
            for m in tp_mesh_dims
            if isinstance(p := placements[m], Shard)
            and len(set(_chunk_bounds(global_shape[p.dim], mesh_shape[m], coordinate[m]))) == 1
        ]
        if empty_dims:
            out.append((coordinate, "empty_shard", actual, described, empty_dims[0]))
        elif box is None:
            dim = next(d for d, iv in enumerate(actual) if len(iv) > 1)
            out.append((coordinate, "non_contiguous", actual, described, dim))
        elif not _same_box(box, described):
            dim = next(d for d in range(len(global_shape)) if _dim_box(box, d) != _dim_box(described, d))
            out.append((coordinate, "offset_mismatch", actual, described, dim))
    return out


def _dim_box(box: tuple[tuple[int, ...], tuple[int, ...]], dim: int) -> tuple[int, int]:
    return box[0][dim], box[1][dim]


def _same_box(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    # Zero-volume boxes carry no data; their offsets do not matter to DCP.
    if a[0] == b[0] and 0 in a[0]:
        return True
    return a == b


def find_dcp_mismatches(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    actual: ActualLayout = None,
    mesh_dim_names: Sequence[str] | None = None,
) -> list[LayoutMismatch]:
    """Return every coordinate whose data DCP would describe wrongly, or whose TP piece is empty.

    For each coordinate, compares the intervals held (built here, see ``actual``) with the box
    torch's ``_compute_local_shape_and_global_offset`` gives DCP. Reports, at most once per
    coordinate and in this order of precedence: an empty TP piece along a dim a ``tp`` axis
    shards (FSDP2 backward crashes on it), data that is not one contiguous box, and a box that
    differs from DCP's. An empty list means ``dcp.save`` writes a checkpoint that reads back.
    See [Note: what DCP describes].

    Args:
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis.
        placements: One placement per mesh axis.
        actual: What the local tensors hold. None: FSDP2's layout (:func:`fsdp_chunk`) when the
            placements are ones ``fully_shard`` builds, else the DTensor's
            (:func:`local_chunk`). ``"fsdp"`` / ``"dtensor"`` force one; a function
            coordinate -> intervals supplies any other.
        mesh_dim_names: Names of the mesh axes, for messages; the axis named ``"tp"`` is the
            one checked for empty pieces. None: FSDP2 placements read as ``(dp_shard, tp)`` or
            ``(dp_replicate, dp_shard, tp)``; other placements have no tp axis.

    Returns:
        One :class:`LayoutMismatch` per bad coordinate, in row-major order.

    Example:
        >>> bad = find_dcp_mismatches((9, 16), (4, 2), [_StridedShard(0, split_factor=2), Shard(0)])
        >>> [(m.coordinate, m.kind) for m in bad]
        [((3, 0), 'offset_mismatch'), ((3, 1), 'offset_mismatch')]
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    names = _axis_names(mesh_shape, placements, mesh_dim_names)
    held, holder = _resolve_actual(global_shape, mesh_shape, placements, actual)
    tp_dims = _tp_mesh_dims(mesh_shape, placements, mesh_dim_names)
    raw = _raw_mismatches(global_shape, mesh_shape, placements, held, tp_dims)
    fixes: dict[tuple[MismatchKind, int], str] = {}
    out = []
    for coordinate, kind, chunk, described, dim in raw:
        if (kind, dim) not in fixes:
            fixes[(kind, dim)] = _fix_hint(global_shape, mesh_shape, placements, names, actual, kind, dim)
        where = f"coordinate {coordinate} (rank {_rank(mesh_shape, coordinate)})"
        if kind == "empty_shard":
            why = f"{where}: its TP piece of dim {dim} is empty"
        elif kind == "non_contiguous":
            why = (
                f"{where}: {holder} holds dim {dim} indices {_fmt_intervals(chunk[dim])}, "
                f"{len(chunk[dim])} separate ranges, but DCP keeps one offset per dim and "
                f"describes {_fmt_box(described)}"
            )
        else:
            shape = tuple(_length(iv) for iv in chunk)
            held_text = f"dim {dim} indices {_fmt_intervals(chunk[dim])}" if chunk[dim] else f"nothing of dim {dim}"
            why = f"{where}: {holder} holds {held_text} (local shape {shape}) but DCP describes {_fmt_box(described)}"
        out.append(
            LayoutMismatch(
                coordinate=coordinate,
                rank=_rank(mesh_shape, coordinate),
                kind=kind,
                actual=chunk,
                described=described,
                reason=why,
                message=f"{why}; {fixes[(kind, dim)]}",
            )
        )
    return out


def _fix_hint(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: tuple[Placement, ...],
    names: Sequence[str],
    actual: ActualLayout,
    kind: MismatchKind,
    dim: int,
) -> str:
    """What to change, proven by rebuilding the layout with the suggested size."""
    size = global_shape[dim]
    sharding = [m for m, p in enumerate(placements) if not isinstance(p, Replicate) and p.dim == dim]
    axes_text = " x ".join(_axis_label(names, mesh_shape, m) for m in sharding)
    if kind == "empty_shard":
        tp = [m for m in sharding if names[m] == "tp"] or sharding
        num = mesh_shape[tp[0]]
        return (
            f"dim {dim} of size {size} over {_axis_label(names, mesh_shape, tp[0])} gives an empty "
            f"TP piece, which crashes FSDP2 backward (_chunk_cat expects non-empty tensor); "
            f"make dim {dim} divisible by {num} or use a smaller tp"
        )
    repair = "save with shardbridge.checkpoint, which repairs it"
    if callable(actual):
        return f"make each local tensor the box dcp_chunk gives its coordinate, or {repair}"
    found = _proven_divisor(global_shape, mesh_shape, placements, names, actual, dim)
    if found is None:
        return (
            f"dim {dim} over {axes_text} interleaves pieces for every size of dim {dim}; "
            f"redistribute to Shard/Replicate placements before saving, or {repair}"
        )
    divisor, label = found
    lower, upper = size // divisor * divisor, (size // divisor + 1) * divisor
    examples = f"{lower} or {upper}" if lower else f"{upper}"
    held_by = "FSDP shards of uneven TP pieces" if _fsdp_axes(mesh_shape, placements) else "uneven pieces"
    return (
        f"dim {dim} of size {size} over {axes_text} gives {held_by}; make dim {dim} divisible "
        f"by {label} (e.g. {examples}) or {repair}"
    )


def _proven_divisor(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: tuple[Placement, ...],
    names: Sequence[str],
    actual: Literal["dtensor", "fsdp"] | None,
    dim: int,
) -> tuple[int, str] | None:
    """First candidate d such that sizes d, 2d, 3d of ``dim`` give no mismatch on it; and its label.

    Candidates: the tp size when FSDP2's TP shards ``dim``, the product of the mesh axes
    sharding ``dim``, and that product times the split factors.
    """
    sharding = [m for m, p in enumerate(placements) if not isinstance(p, Replicate) and p.dim == dim]
    split = math.prod(int(placements[m].split_factor) for m in sharding if isinstance(placements[m], _StridedShard))
    product = math.prod(mesh_shape[m] for m in sharding)
    named = not any(names[m].startswith("mesh dim") for m in sharding)
    label = "*".join(names[m] for m in sharding) + f"={product}" if named else f"{product}"
    candidates = [(product, label), (product * split, f"{product * split}")]
    axes = _fsdp_axes(mesh_shape, placements)
    if axes is not None and axes.tp_dim == dim and axes.tp_mesh_dim is not None:
        tp = mesh_shape[axes.tp_mesh_dim]
        candidates.insert(0, (tp, f"{names[axes.tp_mesh_dim]}={tp}"))
    for divisor, label in candidates:
        ok = True
        for k in (1, 2, 3):
            shape = list(global_shape)
            shape[dim] = divisor * k
            held, _ = _resolve_actual(shape, mesh_shape, placements, actual)
            bad = _raw_mismatches(shape, mesh_shape, placements, held, [])
            ok = ok and not any(d == dim for *_, d in bad)
        if ok:
            return divisor, label
    return None


# --------------------------------------------------------------------------- formatting (messages)


def _rank(mesh_shape: Sequence[int], coordinate: Sequence[int]) -> int:
    rank = 0
    for size, index in zip(mesh_shape, coordinate):
        rank = rank * size + index
    return rank


def _axis_names(
    mesh_shape: Sequence[int], placements: Sequence[Placement], mesh_dim_names: Sequence[str] | None
) -> tuple[str, ...]:
    if mesh_dim_names is not None:
        if len(mesh_dim_names) != len(mesh_shape):
            raise ValueError(
                f"mesh_dim_names {tuple(mesh_dim_names)} has {len(mesh_dim_names)} names for "
                f"mesh_shape {tuple(mesh_shape)}; give one name per mesh axis"
            )
        return tuple(mesh_dim_names)
    if _fsdp_axes(mesh_shape, placements) is not None and len(mesh_shape) in _FSDP_AXIS_NAMES:
        return _FSDP_AXIS_NAMES[len(mesh_shape)]
    return tuple(f"mesh dim {i}" for i in range(len(mesh_shape)))


def _axis_label(names: Sequence[str], mesh_shape: Sequence[int], mesh_dim: int) -> str:
    name = names[mesh_dim]
    if name.startswith("mesh dim"):
        return f"{name} (size {mesh_shape[mesh_dim]})"
    return f"{name}={mesh_shape[mesh_dim]}"


def _fmt_intervals(intervals: DimIntervals) -> str:
    return " ".join(f"[{a}, {b})" for a, b in intervals) if intervals else "-"


def _fmt_box(box: tuple[tuple[int, ...], tuple[int, ...]] | None) -> str:
    if box is None:
        return "several boxes"
    sizes, offsets = box
    return f"size {sizes} at offset {offsets}"
