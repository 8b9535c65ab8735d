"""Layout algebra, the interval part: which global index ranges each mesh coordinate holds.

Pure functions of (global shape, mesh shape, placements, coordinate); no process group. This
module is the oracle the rest of shardbridge is checked against. It answers three questions:

- what a DTensor with these placements holds (:func:`local_chunk`, torch's ``distribute_tensor``
  split, placement by placement);
- what FSDP2 x TP actually stores (:func:`fsdp_tp_chunk`, :func:`fsdp_chunk`);
- what DCP writes down for it (:func:`dcp_chunk`); where that description is wrong is
  ``_mismatch.py`` (:func:`find_dcp_mismatches`), the picture ``_text.py`` (:func:`render_layout`).

Intervals are global index ranges ``(start, stop)`` per tensor dim, in local-tensor order,
adjacent ranges merged; a dim on which a coordinate holds nothing has no intervals ``()``.
Ranks are the row-major flattening of mesh coordinates (``init_device_mesh``'s default).

[Note: strided sharding order]

FSDP2 x TP shards right to left: TP first cuts the global tensor, then FSDP2 cuts dim 0 of the
TP-local tensor with ``torch.chunk`` (``_fsdp_param.py``, ``_chunk_with_empty``). Colwise TP
(``Shard(0)``) on mesh (dp_shard=4, tp=2), dim 0 of size 9::

    TP pieces:  tp0 = rows [0, 5)    tp1 = rows [5, 9)
    FSDP chunk: tp0 -> [0,2) [2,4) [4,5) -       tp1 -> [5,6) [6,7) [7,8) [8,9)
    coordinate (3, 0) holds nothing, (3, 1) holds row 8

FSDP2 records this as ``(_StridedShard(0, sf=2), Shard(0))``. DTensor reads placements left to
right: ``_StridedShard._split_tensor`` gives dp rank i the pieces ``chunk(chunk(x, sf)[j], dp)[i]``
for every j, concatenated, and the next ``Shard(0)`` cuts that concatenation with ``torch.chunk``
again. That equals FSDP2's layout only when the pieces concatenated for a dp rank have equal
sizes, which holds whenever dim 0 is divisible by tp. For dim 0 = 9 above the concatenation on
dp rank 3 is just row 8, so the left-to-right reading puts row 8 on (3, 0) and nothing on
(3, 1): the opposite of what FSDP2 stores. torch 2.13 is not consistent with itself here:
``distribute_tensor`` and ``_compute_local_shape_and_global_offset`` (hence DCP) follow the
left-to-right reading, while ``DTensor.full_tensor()`` reassembles FSDP2's layout correctly and
raises on the left-to-right one. :func:`local_chunk` is the left-to-right reading;
:func:`fsdp_chunk` is what FSDP2 holds and is the truth for FSDP2 parameters.

[Note: what DCP describes]

DCP writes one box per local tensor: sizes and the FIRST global offset per dim
(``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``). A local tensor
whose data is not one contiguous box in global coordinates, or whose box is not the one torch
computes, is saved under a wrong description: ``dcp.save`` succeeds and the checkpoint cannot be
read back, or is read back scrambled. An empty shard is described with size 0 at offset
``global_shape[dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardbridge._compat import compute_local_shape_and_global_offset

__all__ = [
    "Chunk",
    "DimIntervals",
    "Interval",
    "chunk_box",
    "dcp_chunk",
    "fsdp_chunk",
    "fsdp_placements",
    "fsdp_tp_chunk",
    "local_chunk",
]

Interval = tuple[int, int]
"""A global index range ``(start, stop)`` along one tensor dim."""

DimIntervals = tuple[Interval, ...]
"""The ordered, merged intervals a local tensor holds along one dim."""

Chunk = tuple[DimIntervals, ...]
"""Per tensor dim, the intervals a local tensor holds."""



# --------------------------------------------------------------------------- intervals


def _chunk_bounds(size: int, num_chunks: int, index: int) -> Interval:
    """Local positions ``[lo, hi)`` of ``torch.chunk(x, num_chunks)[index]``, empty-filled."""
    chunk_size = -(-size // num_chunks)
    lo = min(chunk_size * index, size)
    return lo, min(lo + chunk_size, size)


def _length(intervals: DimIntervals) -> int:
    return sum(stop - start for start, stop in intervals)


def _append(out: list[Interval], start: int, stop: int) -> None:
    if start >= stop:
        return
    if out and out[-1][1] == start:
        out[-1] = (out[-1][0], stop)
    else:
        out.append((start, stop))


def _take(intervals: DimIntervals, lo: int, hi: int) -> DimIntervals:
    """The global intervals at local positions ``[lo, hi)`` of ``intervals``."""
    out: list[Interval] = []
    pos = 0
    for start, stop in intervals:
        length = stop - start
        a, b = max(lo - pos, 0), min(hi - pos, length)
        if a < b:
            _append(out, start + a, start + b)
        pos += length
    return tuple(out)


def _concat(pieces: Sequence[DimIntervals]) -> DimIntervals:
    out: list[Interval] = []
    for piece in pieces:
        for start, stop in piece:
            _append(out, start, stop)
    return tuple(out)


def _chunk_dim(intervals: DimIntervals, num_chunks: int, index: int) -> DimIntervals:
    return _take(intervals, *_chunk_bounds(_length(intervals), num_chunks, index))


# --------------------------------------------------------------------------- validation


def _check_layout(
    global_shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement]
) -> tuple[Placement, ...]:
    """Validate the inputs; return placements with non-negative dims."""
    if any(int(s) < 0 for s in global_shape):
        raise ValueError(f"global_shape {tuple(global_shape)} has a negative size; sizes must be >= 0")
    if not mesh_shape or any(int(s) < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape {tuple(mesh_shape)} must be non-empty with every axis size >= 1, e.g. (4, 2)")
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"len(placements)={len(placements)} != len(mesh_shape)={len(mesh_shape)} for "
            f"placements {tuple(placements)} and mesh_shape {tuple(mesh_shape)}; give one "
            "placement per mesh axis"
        )
    ndim = len(global_shape)
    out: list[Placement] = []
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            out.append(p)
            continue
        if isinstance(p, Partial):
            raise ValueError(
                f"placements[{mesh_dim}]={p!r} is a pending reduction, not a storage layout; "
                "use Shard, _StridedShard or Replicate"
            )
        if not isinstance(p, (Shard, _StridedShard)):
            raise ValueError(f"placements[{mesh_dim}]={p!r} is not supported; use Shard, _StridedShard or Replicate")
        dim = p.dim + ndim if p.dim < 0 else p.dim
        if not 0 <= dim < ndim:
            raise ValueError(
                f"placements[{mesh_dim}]={p!r} shards dim {p.dim} of a {ndim}-d tensor "
                f"{tuple(global_shape)}; use a dim in [0, {ndim})"
            )
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            if sf < 1:
                raise ValueError(f"placements[{mesh_dim}]={p!r} has split_factor {sf}; it must be >= 1")
            out.append(_StridedShard(dim, split_factor=sf))
        else:
            out.append(Shard(dim))
    return tuple(out)


def _check_coordinate(mesh_shape: Sequence[int], coordinate: Sequence[int]) -> tuple[int, ...]:
    coordinate = tuple(int(c) for c in coordinate)
    if len(coordinate) != len(mesh_shape) or not all(0 <= c < s for c, s in zip(coordinate, mesh_shape)):
        raise ValueError(
            f"coordinate {coordinate} is not in mesh_shape {tuple(mesh_shape)}; give one index "
            "per mesh axis with 0 <= index < axis size"
        )
    return coordinate


# --------------------------------------------------------------------------- what is held


def _local_chunk(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Chunk:
    held: list[DimIntervals] = [((0, s),) if s else () for s in global_shape]
    for num_chunks, p, index in zip(mesh_shape, placements, coordinate):
        if isinstance(p, _StridedShard):
            # Replicate -> _StridedShard: chunk into split_factor pieces, chunk each piece
            # over the mesh axis, keep piece index `index` of each. See [Note: strided sharding order]
            pieces = [_chunk_dim(held[p.dim], int(p.split_factor), j) for j in range(int(p.split_factor))]
            held[p.dim] = _concat([_chunk_dim(piece, num_chunks, index) for piece in pieces])
        elif isinstance(p, Shard):
            held[p.dim] = _chunk_dim(held[p.dim], num_chunks, index)
    return tuple(held)


def local_chunk(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Chunk:
    """Return the global intervals a DTensor's local tensor holds at ``coordinate``.

    This is torch 2.13's ``distribute_tensor`` split, read left to right: ``Shard(d)`` cuts the
    current local tensor with ``torch.chunk`` (trailing chunks may be short or empty) and
    ``_StridedShard(d, split_factor=sf)`` follows ``_StridedShard._split_tensor``. For uneven
    shapes this is NOT what FSDP2 x TP stores under the same placements; use :func:`fsdp_chunk`
    for FSDP2 parameters. See [Note: strided sharding order].

    Args:
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis.
        placements: One ``Shard``, ``_StridedShard`` or ``Replicate`` per mesh axis.
        coordinate: Index of the local tensor on each mesh axis.

    Returns:
        Per tensor dim, the ordered ``(start, stop)`` intervals held, adjacent ones merged;
        ``()`` where the local tensor is empty along that dim.

    Raises:
        ValueError: If the placements do not fit the shapes, or the coordinate is off the mesh.

    Example:
        >>> local_chunk((9, 4), (2,), [Shard(0)], (1,))
        (((5, 9),), ((0, 4),))
        >>> local_chunk((8,), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)], (1, 0))
        (((2, 4),),)
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    coordinate = _check_coordinate(mesh_shape, coordinate)
    return _local_chunk(global_shape, mesh_shape, placements, coordinate)


def fsdp_tp_chunk(
    global_shape: Sequence[int],
    *,
    tp_dim: int | None,
    tp_size: int,
    tp_rank: int,
    dp_size: int,
    dp_rank: int,
) -> Chunk:
    """Return the global intervals FSDP2 x TP stores on one rank.

    TP takes ``torch.chunk(x, tp_size, dim=tp_dim)[tp_rank]`` (``tp_dim=None``: TP replicates
    the parameter); ``fully_shard`` then takes ``torch.chunk(tp_local, dp_size, dim=0)[dp_rank]``
    (``_chunk_with_empty`` in ``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``). This is
    the truth for FSDP2 parameters where :func:`local_chunk` disagrees.
    See [Note: strided sharding order].

    Args:
        global_shape: Shape of the global parameter.
        tp_dim: Tensor dim TP shards (0 = colwise, 1 = rowwise), or None for replicated.
        tp_size: Size of the tp axis.
        tp_rank: Index on the tp axis.
        dp_size: Size of the FSDP sharding axis (dp_shard, or dp_shard_cp).
        dp_rank: Index on the FSDP sharding axis.

    Returns:
        Per tensor dim, the intervals held, as in :func:`local_chunk`.

    Raises:
        ValueError: If a size, rank or dim is out of range.

    Example:
        >>> fsdp_tp_chunk((9, 16), tp_dim=0, tp_size=2, tp_rank=1, dp_size=4, dp_rank=3)
        (((8, 9),), ((0, 16),))
    """
    ndim = len(global_shape)
    if ndim == 0 or (tp_dim is not None and not 0 <= tp_dim < ndim):
        raise ValueError(
            f"tp_dim={tp_dim} is not a dim of {tuple(global_shape)}; use a dim in [0, {ndim}) "
            "or None for a TP-replicated parameter"
        )
    for name, size, rank in (("tp", tp_size, tp_rank), ("dp", dp_size, dp_rank)):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(
                f"{name}_size={size}, {name}_rank={rank}: need {name}_size >= 1 and 0 <= {name}_rank < {name}_size"
            )
    held: list[DimIntervals] = [((0, s),) if s else () for s in global_shape]
    if tp_dim is not None:
        held[tp_dim] = _chunk_dim(held[tp_dim], tp_size, tp_rank)  # Replicate -> Shard(tp_dim)
    held[0] = _chunk_dim(held[0], dp_size, dp_rank)  # FSDP: torch.chunk of the TP-local dim 0
    return tuple(held)


@dataclass(frozen=True, kw_only=True)
class _FsdpAxes:
    """Mesh axes of an FSDP2 x TP placement list, as ``fully_shard`` builds it."""

    dp_mesh_dim: int
    tp_mesh_dim: int | None
    tp_dim: int | None


def _fsdp_axes(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> _FsdpAxes | None:
    """Recognise the placements FSDP2 builds (``_init_sharding_spec_tp``); None otherwise.

    ``(Shard(0),)``; ``(dp, tp)``; HSDP ``(Replicate(), dp, tp)``; where tp is ``Replicate()``
    or ``Shard(d)`` and dp is ``_StridedShard(0, sf=tp_size)`` when tp is ``Shard(0)`` over more
    than one rank, else ``Shard(0)``. ``(Replicate(), Shard(0))`` reads as HSDP without TP (DDP
    with colwise TP stores the same).
    """
    ps = tuple(placements)
    if ps == (Shard(0),):
        return _FsdpAxes(dp_mesh_dim=0, tp_mesh_dim=None, tp_dim=None)
    if ps == (Replicate(), Shard(0)):
        return _FsdpAxes(dp_mesh_dim=1, tp_mesh_dim=None, tp_dim=None)
    if len(ps) == 3 and isinstance(ps[0], Replicate):
        offset, ps = 1, ps[1:]
    elif len(ps) == 2:
        offset = 0
    else:
        return None
    dp, tp = ps
    tp_size = mesh_shape[offset + 1]
    if isinstance(tp, Replicate):
        tp_dim = None
    elif isinstance(tp, Shard) and not isinstance(tp, _StridedShard):
        tp_dim = tp.dim
    else:
        return None
    if tp_dim == 0 and tp_size > 1:
        expected: Placement = _StridedShard(0, split_factor=tp_size)
    else:
        expected = Shard(0)
    if dp != expected:
        return None
    return _FsdpAxes(dp_mesh_dim=offset, tp_mesh_dim=offset + 1, tp_dim=tp_dim)


def fsdp_placements(*, tp_dim: int | None, tp_size: int, dp_replicate: bool = False) -> tuple[Placement, ...]:
    """Return the placements ``fully_shard`` gives a TP parameter.

    Args:
        tp_dim: Tensor dim TP shards (0 = colwise, 1 = rowwise), or None for replicated.
        tp_size: Size of the tp axis.
        dp_replicate: Prepend ``Replicate()`` for HSDP.

    Returns:
        ``(dp_shard, tp)`` placements, or ``(dp_replicate, dp_shard, tp)`` for HSDP.

    Example:
        >>> fsdp_placements(tp_dim=0, tp_size=2)
        (_StridedShard(dim=0, sf=2), Shard(dim=0))
    """
    tp: Placement = Replicate() if tp_dim is None else Shard(tp_dim)
    dp: Placement = _StridedShard(0, split_factor=tp_size) if tp_dim == 0 and tp_size > 1 else Shard(0)
    return ((Replicate(),) if dp_replicate else ()) + (dp, tp)


def fsdp_chunk(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Chunk:
    """Return the global intervals FSDP2 stores at ``coordinate`` for FSDP2's own placements.

    Reads the placements ``fully_shard`` builds (see :func:`fsdp_placements`; plain FSDP
    ``(Shard(0),)`` and HSDP without TP ``(Replicate(), Shard(0))`` too) and applies
    :func:`fsdp_tp_chunk`. Agrees with :func:`local_chunk` whenever the TP pieces are equal
    (dim 0 divisible by tp for colwise); differs for uneven colwise shapes.
    See [Note: strided sharding order].

    Args:
        global_shape: Shape of the global parameter.
        mesh_shape: Size of each mesh axis, e.g. ``(dp_shard, tp)``.
        placements: The parameter's placements.
        coordinate: Index of the rank on each mesh axis.

    Returns:
        Per tensor dim, the intervals held, as in :func:`local_chunk`.

    Raises:
        ValueError: If the placements are not ones FSDP2 builds.

    Example:
        >>> fsdp_chunk((9, 16), (4, 2), fsdp_placements(tp_dim=0, tp_size=2), (3, 0))
        ((), ((0, 16),))
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    coordinate = _check_coordinate(mesh_shape, coordinate)
    return _fsdp_chunk(global_shape, mesh_shape, _require_fsdp_axes(mesh_shape, placements), coordinate)


def _require_fsdp_axes(mesh_shape: Sequence[int], placements: Sequence[Placement]) -> _FsdpAxes:
    axes = _fsdp_axes(mesh_shape, placements)
    if axes is None:
        raise ValueError(
            f"placements {tuple(placements)} on mesh_shape {tuple(mesh_shape)} are not ones "
            "fully_shard builds; expected e.g. (_StridedShard(0, sf=tp), Shard(0)) colwise, "
            "(Shard(0), Shard(1)) rowwise, (Shard(0), Replicate()), or HSDP (Replicate(), ...); "
            "use local_chunk for other DTensors"
        )
    return axes


def _fsdp_chunk(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    axes: _FsdpAxes,
    coordinate: Sequence[int],
) -> Chunk:
    tp = axes.tp_mesh_dim
    return fsdp_tp_chunk(
        global_shape,
        tp_dim=axes.tp_dim,
        tp_size=1 if tp is None else mesh_shape[tp],
        tp_rank=0 if tp is None else coordinate[tp],
        dp_size=mesh_shape[axes.dp_mesh_dim],
        dp_rank=coordinate[axes.dp_mesh_dim],
    )


# --------------------------------------------------------------------------- what DCP writes


def dcp_chunk(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Return the box DCP writes for ``coordinate``: ``(sizes, offsets)``.

    A thin wrapper over torch's private
    ``torch.distributed.tensor._utils._compute_local_shape_and_global_offset``, which
    ``DTensor.__create_write_items__`` uses. See [Note: what DCP describes].

    Args:
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis.
        placements: One placement per mesh axis.
        coordinate: Index on each mesh axis.

    Returns:
        The local sizes and the first global offset per tensor dim.

    Example:
        >>> dcp_chunk((9, 16), (4, 2), fsdp_placements(tp_dim=0, tp_size=2), (3, 0))
        ((1, 16), (8, 0))
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    coordinate = _check_coordinate(mesh_shape, coordinate)
    sizes, offsets = compute_local_shape_and_global_offset(
        tuple(global_shape), tuple(mesh_shape), list(coordinate), list(placements)
    )
    return tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)


def chunk_box(global_shape: Sequence[int], chunk: Chunk) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Return ``(sizes, offsets)`` of ``chunk`` if it is one box, else None.

    Uses DCP's conventions: an empty dim has size 0 at offset ``global_shape[dim]``.

    Example:
        >>> chunk_box((9, 16), (((2, 4),), ((0, 16),)))
        ((2, 16), (2, 0))
        >>> chunk_box((9,), (((0, 2), (5, 6)),)) is None
        True
    """
    if any(len(iv) > 1 for iv in chunk):
        return None
    sizes = tuple(iv[0][1] - iv[0][0] if iv else 0 for iv in chunk)
    offsets = tuple(iv[0][0] if iv else size for iv, size in zip(chunk, global_shape))
    return sizes, offsets
