"""shardbridge.layout: the layout algebra, the oracle the rest of shardbridge is checked against.

Pure functions of (global shape, mesh shape, placements, coordinate); no process group:

- what is held: :func:`local_chunk` (a DTensor's placements read left to right, as
  ``distribute_tensor`` does), :func:`fsdp_tp_chunk` / :func:`fsdp_chunk` (what FSDP2 x TP
  stores), :func:`fsdp_placements` (the placements ``fully_shard`` gives a TP parameter);
- what DCP writes down: :func:`dcp_chunk`, :func:`chunk_box`;
- where that is wrong: :func:`find_dcp_mismatches` -> :class:`LayoutMismatch`;
- the picture and the CLI syntax: :func:`render_layout` (ASCII), :func:`save_layout_png` /
  :func:`draw_layout` (an image: one panel per rank, the blocks it holds; needs the ``plot``
  extra) over :func:`layout_blocks` (the rectangles, pure algebra), :func:`parse_placements`,
  :func:`parse_mesh`.

Example::

    from shardbridge.layout import find_dcp_mismatches, fsdp_placements
    find_dcp_mismatches((9, 16), (4, 2), fsdp_placements(tp_dim=0, tp_size=2))   # 2 mismatches

The notes behind it: [Note: strided sharding order] and [Note: what DCP describes] in
``_algebra.py``. These names were importable from ``shardbridge`` directly before 0.2; that
still works for one release, with a DeprecationWarning.
"""

from shardbridge.layout._algebra import (
    Chunk,
    DimIntervals,
    Interval,
    chunk_box,
    dcp_chunk,
    fsdp_chunk,
    fsdp_placements,
    fsdp_tp_chunk,
    local_chunk,
)
from shardbridge.layout._mismatch import LayoutMismatch, find_dcp_mismatches
from shardbridge.layout._picture import Block, draw_layout, layout_blocks, rank_color, save_layout_png
from shardbridge.layout._text import parse_mesh, parse_placements, render_layout

__all__ = [
    # what is held
    "Chunk",
    "DimIntervals",
    "Interval",
    "fsdp_chunk",
    "fsdp_placements",
    "fsdp_tp_chunk",
    "local_chunk",
    # what DCP writes, and where it is wrong
    "LayoutMismatch",
    "chunk_box",
    "dcp_chunk",
    "find_dcp_mismatches",
    # text
    "parse_mesh",
    "parse_placements",
    "render_layout",
    # picture (matplotlib: the plot extra)
    "Block",
    "draw_layout",
    "layout_blocks",
    "rank_color",
    "save_layout_png",
]
