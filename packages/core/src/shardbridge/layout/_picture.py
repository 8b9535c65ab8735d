"""The who-holds-what picture as an image: one panel per rank, the blocks of the tensor it holds.

The ASCII picture (``_text.py``) draws one tensor dim; this one draws two (rows and columns of a
2-D weight; a 1-D tensor is one row), so every placement kind shows as blocks: ``Shard`` as
bands, ``_StridedShard`` as interleaved bands, ``Replicate`` as the same blocks on several
ranks, uneven shards as unequal (or empty) panels. DCP's box for each rank is drawn as a dashed
outline, red where it differs from the data held (:func:`~shardbridge.layout.find_dcp_mismatches`).

The geometry (:func:`layout_blocks`) is pure algebra; drawing needs matplotlib (the ``plot``
extra), imported only by :func:`draw_layout` / :func:`save_layout_png`.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.tensor.placement_types import Placement

from shardbridge.layout._algebra import _check_layout, dcp_chunk
from shardbridge.layout._mismatch import (
    ActualLayout,
    _axis_label,
    _axis_names,
    _fmt_intervals,
    _rank,
    _resolve_actual,
    find_dcp_mismatches,
)

__all__ = ["Block", "draw_layout", "layout_blocks", "rank_color", "save_layout_png"]

MAX_PANELS = 64
"""Most ranks one picture draws (one panel each)."""

# tab20, reordered so that neighbouring ranks get contrasting colours (RGB in [0, 1]).
_PALETTE = (
    (0.122, 0.467, 0.706),
    (1.000, 0.498, 0.055),
    (0.173, 0.627, 0.173),
    (0.839, 0.153, 0.157),
    (0.580, 0.404, 0.741),
    (0.549, 0.337, 0.294),
    (0.890, 0.467, 0.761),
    (0.498, 0.498, 0.498),
    (0.737, 0.741, 0.133),
    (0.090, 0.745, 0.812),
    (0.682, 0.780, 0.910),
    (1.000, 0.733, 0.471),
    (0.596, 0.875, 0.541),
    (1.000, 0.596, 0.588),
    (0.773, 0.690, 0.835),
    (0.769, 0.612, 0.580),
    (0.969, 0.714, 0.824),
    (0.780, 0.780, 0.780),
    (0.859, 0.859, 0.553),
    (0.620, 0.855, 0.898),
)
BACKGROUND = (1.0, 1.0, 1.0)
"""The colour of indices a rank does not hold."""


def rank_color(rank: int) -> tuple[float, float, float]:
    """The fill colour of ``rank``'s blocks (RGB in [0, 1]; repeats after 20 ranks)."""
    return _PALETTE[rank % len(_PALETTE)]


@dataclass(frozen=True, kw_only=True)
class Block:
    """One rectangle of the global tensor that one rank holds (drawn dims only)."""

    rank: int
    """The rank (row-major flattening of the coordinate)."""
    coordinate: tuple[int, ...]
    """The mesh coordinate."""
    rows: tuple[int, int]
    """Global index range ``[start, stop)`` along the first drawn dim."""
    cols: tuple[int, int]
    """Global index range ``[start, stop)`` along the second drawn dim (``(0, 1)`` for a 1-D tensor)."""


def _drawn_dims(global_shape: Sequence[int], dims: tuple[int, int] | None) -> tuple[int, int | None]:
    ndim = len(global_shape)
    if ndim == 0:
        raise ValueError("a 0-d tensor has no blocks to draw; pass a shape with at least one dim")
    if dims is None:
        return (0, 1) if ndim >= 2 else (0, None)
    if len(dims) != 2 or not all(0 <= d < ndim for d in dims) or dims[0] == dims[1]:
        raise ValueError(f"dims={dims!r}: give two different dims of {tuple(global_shape)}, e.g. (0, 1)")
    return dims[0], dims[1]


def layout_blocks(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    actual: ActualLayout = None,
    dims: tuple[int, int] | None = None,
) -> list[Block]:
    """The rectangles each rank holds, in the two drawn dims, from the layout algebra.

    A rank's holding is a product of index intervals per dim (:func:`~shardbridge.layout.local_chunk`,
    or FSDP2's :func:`~shardbridge.layout.fsdp_chunk` for FSDP2 placements; ``actual`` as in
    :func:`~shardbridge.layout.find_dcp_mismatches`), so it is drawn as the blocks
    ``rows_interval x cols_interval``. A rank holding nothing has no block.

    Args:
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis.
        placements: One placement per mesh axis.
        actual: What the local tensors hold: None (FSDP2's layout for FSDP2 placements, else
            the DTensor's), ``"fsdp"``, ``"dtensor"`` or a function coordinate -> intervals.
        dims: The two tensor dims drawn as rows and columns; None = (0, 1), or dim 0 alone for
            a 1-D tensor (columns ``(0, 1)``).

    Returns:
        Every block, ranks in order.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> [(b.rank, b.rows, b.cols) for b in layout_blocks((4, 6), (2,), [Shard(1)])]
        [(0, (0, 4), (0, 3)), (1, (0, 4), (3, 6))]
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    row_dim, col_dim = _drawn_dims(global_shape, dims)
    held, _ = _resolve_actual(global_shape, mesh_shape, placements, actual)
    out = []
    for coordinate in itertools.product(*(range(s) for s in mesh_shape)):
        chunk = held(coordinate)
        if any(not intervals for intervals in chunk):  # holds nothing at all
            continue
        col_intervals = chunk[col_dim] if col_dim is not None else ((0, 1),)
        for rows, cols in itertools.product(chunk[row_dim], col_intervals):
            out.append(Block(rank=_rank(mesh_shape, coordinate), coordinate=coordinate, rows=rows, cols=cols))
    return out


def _require_matplotlib() -> Any:
    from shardbridge._compat import require_module
    from shardbridge._extras import install_hint

    matplotlib = require_module("matplotlib", hint=f"the layout picture needs matplotlib: {install_hint('plot')}")
    matplotlib.use("Agg")  # files only; never a window
    return require_module("matplotlib.pyplot", hint=install_hint("plot"))


def _frame(ax: Any, n_rows: int, n_cols: int) -> None:
    ax.set_xlim(0, n_cols)
    ax.set_ylim(n_rows, 0)  # row 0 at the top, as the tensor prints
    ax.set_facecolor(BACKGROUND)
    ax.tick_params(labelsize=6)


def _draw_overview(ax: Any, blocks: list[Block], n_rows: int, n_cols: int, rectangle: Any) -> None:
    """Every block of every rank; a block held by several ranks is split into one stripe per rank."""
    _frame(ax, n_rows, n_cols)
    ax.set_title("all ranks (a block held by several ranks has a stripe of each)", fontsize=8)
    owners: dict[tuple[tuple[int, int], tuple[int, int]], list[int]] = {}
    row_cuts = sorted({0, n_rows} | {x for b in blocks for x in b.rows})
    col_cuts = sorted({0, n_cols} | {x for b in blocks for x in b.cols})
    for r0, r1 in zip(row_cuts, row_cuts[1:]):
        for c0, c1 in zip(col_cuts, col_cuts[1:]):
            ranks = sorted(
                {b.rank for b in blocks if b.rows[0] <= r0 and r1 <= b.rows[1] and b.cols[0] <= c0 and c1 <= b.cols[1]}
            )
            if ranks:
                owners[((r0, r1), (c0, c1))] = ranks
    for ((r0, r1), (c0, c1)), ranks in owners.items():
        width = (c1 - c0) / len(ranks)
        for i, rank in enumerate(ranks):
            ax.add_patch(rectangle((c0 + i * width, r0), width, r1 - r0, facecolor=rank_color(rank), lw=0))
        ax.add_patch(rectangle((c0, r0), c1 - c0, r1 - r0, fill=False, edgecolor="black", lw=0.6))
        if len(owners) <= 64:
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, ",".join(map(str, ranks)), ha="center", va="center", fontsize=6)


def draw_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    actual: ActualLayout = None,
    dims: tuple[int, int] | None = None,
    title: str | None = None,
) -> tuple[Any, dict[tuple[int, ...], Any]]:
    """Draw :func:`layout_blocks` with matplotlib: one panel per rank.

    An overview panel (every rank's blocks in the rank's colour, a block several ranks hold
    striped with each of their colours and labelled with their ranks), then one panel per rank:
    the whole global tensor (row index down, column index across), the rank's blocks filled with
    its colour, and DCP's box for the rank as a dashed outline (red where DCP describes a
    different box than the data held).

    Args:
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis (at most :data:`MAX_PANELS` ranks).
        placements: One placement per mesh axis.
        mesh_dim_names: Names of the mesh axes for the titles.
        actual: What the local tensors hold, as in :func:`layout_blocks`.
        dims: The two tensor dims drawn, as in :func:`layout_blocks`.
        title: The figure's title; None = shape, mesh and placements.

    Returns:
        ``(figure, {coordinate: axes})``; the axes' data coordinates are the tensor's
        ``(column, row)`` indices.

    Raises:
        ValueError: more than :data:`MAX_PANELS` ranks, or a bad layout.
        ImportError: matplotlib is missing (the message names the ``plot`` extra).
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    world = math.prod(mesh_shape)
    if world > MAX_PANELS:
        raise ValueError(
            f"mesh {tuple(mesh_shape)} has {world} ranks; the picture draws one panel per rank and handles up to "
            f"{MAX_PANELS}: draw a smaller mesh with the same pattern (e.g. fewer dp ranks)"
        )
    row_dim, col_dim = _drawn_dims(global_shape, dims)
    blocks = layout_blocks(global_shape, mesh_shape, placements, actual=actual, dims=dims)
    names = _axis_names(mesh_shape, placements, mesh_dim_names)
    _, holder = _resolve_actual(global_shape, mesh_shape, placements, actual)
    held, _ = _resolve_actual(global_shape, mesh_shape, placements, actual)
    bad = {m.coordinate for m in find_dcp_mismatches(global_shape, mesh_shape, placements, actual=actual)}
    n_rows = global_shape[row_dim]
    n_cols = global_shape[col_dim] if col_dim is not None else 1
    plt = _require_matplotlib()
    from matplotlib.patches import Rectangle

    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    # Rank panels in a grid (the last mesh axis across: tp is usually last), under one overview
    # panel of the whole tensor in which each block has the colours of every rank holding it.
    across = mesh_shape[-1] if len(mesh_shape) > 1 else min(world, 4)
    down = math.ceil(world / across)
    panel_w = 2.4
    panel_h = min(max(panel_w * n_rows / max(n_cols, 1), 0.6), 4.0)
    fig = plt.figure(figsize=(panel_w * across + 0.6, (panel_h + 0.8) * (down + 1) + 1.0))
    grid = fig.add_gridspec(down + 1, across)
    overview = fig.add_subplot(grid[0, :])
    _draw_overview(overview, blocks, n_rows, n_cols, Rectangle)
    by_coord: dict[tuple[int, ...], Any] = {}
    for index, coordinate in enumerate(coords):
        ax = fig.add_subplot(grid[1 + index // across, index % across])
        rank = _rank(mesh_shape, coordinate)
        by_coord[coordinate] = ax
        _frame(ax, n_rows, n_cols)
        for block in (b for b in blocks if b.coordinate == coordinate):
            (r0, r1), (c0, c1) = block.rows, block.cols
            ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=rank_color(rank), edgecolor="black", lw=0.6))
        sizes, offsets = dcp_chunk(global_shape, mesh_shape, placements, coordinate)
        box_cols = (offsets[col_dim], sizes[col_dim]) if col_dim is not None else (0, 1)
        ax.add_patch(
            Rectangle(
                (box_cols[0], offsets[row_dim]),
                box_cols[1],
                sizes[row_dim],
                fill=False,
                edgecolor="red" if coordinate in bad else "black",
                lw=1.6 if coordinate in bad else 0.8,
                linestyle="--",
            )
        )
        chunk = held(coordinate)
        label = f"rank {rank} {str(coordinate).replace(' ', '')}" + ("  DCP box wrong" if coordinate in bad else "")
        ax.set_title(label, fontsize=8, color="red" if coordinate in bad else "black")
        ax.set_xlabel(
            f"rows {_fmt_intervals(chunk[row_dim])}"
            + (f"\ncols {_fmt_intervals(chunk[col_dim])}" if col_dim is not None else ""),
            fontsize=7,
        )
    if names[0].startswith("mesh dim"):
        mesh_text = str(tuple(mesh_shape))
    else:
        mesh_text = " x ".join(_axis_label(names, mesh_shape, m) for m in range(len(mesh_shape)))
    drawn = f"rows = dim {row_dim}, columns = dim {col_dim}" if col_dim is not None else "dim 0 across"
    fig.suptitle(
        title
        or f"tensor {tuple(global_shape)} on mesh {mesh_text}\n{', '.join(map(str, placements))}\n"
        f"held by {holder}; {drawn}; dashed: the box DCP records",
        fontsize=8,
    )
    fig.tight_layout()
    return fig, by_coord


def save_layout_png(
    path: str | os.PathLike[str],
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    actual: ActualLayout = None,
    dims: tuple[int, int] | None = None,
    title: str | None = None,
    dpi: int = 100,
) -> Path:
    """Write :func:`draw_layout`'s picture to a PNG file.

    Args:
        path: The PNG file to write (its folder must exist).
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis.
        placements: One placement per mesh axis.
        mesh_dim_names: Names of the mesh axes.
        actual: What the local tensors hold, as in :func:`layout_blocks`.
        dims: The two tensor dims drawn, as in :func:`layout_blocks`.
        title: The figure's title; None = shape, mesh and placements.
        dpi: Pixels per inch.

    Returns:
        The path written.

    Example:
        >>> save_layout_png("layout.png", (9, 16), (4, 2), parse_placements("SS(0,2),S(0)"))  # doctest: +SKIP
    """
    fig, _ = draw_layout(
        global_shape, mesh_shape, placements, mesh_dim_names=mesh_dim_names, actual=actual, dims=dims, title=title
    )
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=dpi, format="png")
    finally:
        plt.close(fig)
    return Path(path)
