"""Do a tensor's chunks cover it exactly (every element once: no overlap, no gap)?

[Note: exact chunk coverage]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP's ``.metadata`` describes each tensor as boxes (offsets + sizes). Its save-time check
adds up the boxes' volumes; that passes two overlapping chunks whose volumes sum to the shape,
and such a checkpoint then loads with some elements never written (``load`` leaves them at the
model's old values, export writes zeros). So a reader checks coverage itself, by a sweep::

    dim 0 cut at every chunk's start / stop:   [0,2) [2,4) [4,5) ...
    each slab: the chunks crossing it must cover the remaining dims exactly, recursively;
    the last dim: exactly one chunk per slab (none: a gap; two or more: an overlap)

A slab whose set of crossing chunks is the same as the slab before needs no second look, so
a grid of r x c chunks (what FSDP2 x TP writes) costs about r sorts of c chunks, O(n log n),
and any other arrangement stays exact. Chunks of zero volume hold nothing and are ignored
(DCP describes an empty shard as size 0 at offset ``size[dim]``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["coverage_fault"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def coverage_fault(size: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Return None if ``boxes`` cover ``size`` exactly, else what is wrong (one phrase).

    Every box must already lie inside ``size`` (the caller checks bounds). See
    [Note: exact chunk coverage].
    """
    if math.prod(size) == 0:
        return None
    held = [box for box in boxes if math.prod(box[1]) > 0]
    return _sweep(tuple(size), held, 0, ())


def _sweep(size: tuple[int, ...], boxes: list[Box], dim: int, at: tuple[int, ...]) -> str | None:
    if dim == len(size):
        if len(boxes) == 1:
            return None
        return f"overlap ({len(boxes)} chunks hold element {at})"
    order = sorted(boxes, key=lambda box: box[0][dim])
    cuts = sorted({0, size[dim]} | {b[0][dim] for b in boxes} | {b[0][dim] + b[1][dim] for b in boxes})
    active: dict[int, Box] = {}
    nxt = 0
    for start in cuts[:-1]:
        changed = False
        for key in [k for k, b in active.items() if b[0][dim] + b[1][dim] <= start]:
            del active[key]
            changed = True
        while nxt < len(order) and order[nxt][0][dim] == start:
            active[nxt] = order[nxt]
            nxt += 1
            changed = True
        here = (*at, start)
        if not active:
            return f"leave element {here + (0,) * (len(size) - len(here))} uncovered"
        if changed and (fault := _sweep(size, list(active.values()), dim + 1, here)) is not None:
            return fault
    return None
