"""Text for the layout algebra: the who-holds-what picture and the CLI's placement syntax.

The algebra is ``_algebra.py`` (see [Note: strided sharding order] there), the diagnosis
``_mismatch.py``.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from shardbridge.layout._algebra import DimIntervals, _check_layout, dcp_chunk
from shardbridge.layout._mismatch import (
    _MAX_MESSAGES,
    ActualLayout,
    _axis_label,
    _axis_names,
    _fmt_intervals,
    _rank,
    _resolve_actual,
    find_dcp_mismatches,
)

__all__ = ["parse_mesh", "parse_placements", "render_layout"]


# --------------------------------------------------------------------------- rendering


def _bar(intervals: DimIntervals, size: int, width: int) -> str:
    """One character per bucket of ``size / width`` indices: '#' held, '.' not."""
    cells = min(size, width)
    out = []
    for cell in range(cells):
        lo, hi = cell * size // cells, (cell + 1) * size // cells
        out.append("#" if any(a < hi and lo < b for a, b in intervals) else ".")
    return "".join(out)


def render_layout(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    dim: int = 0,
    actual: ActualLayout = None,
    width: int = 64,
) -> str:
    """Draw who holds what along one tensor dim, and what DCP describes, in ASCII.

    Two parts: one row per run of indices of ``dim`` with the same owners, and one row per rank
    with its coordinate, a bar of the indices it holds, its intervals, DCP's box and a ``!``
    where they differ (see :func:`find_dcp_mismatches`).

    Args:
        global_shape: Shape of the global tensor.
        mesh_shape: Size of each mesh axis.
        placements: One placement per mesh axis.
        mesh_dim_names: Names of the mesh axes for the header.
        dim: Tensor dim to draw.
        actual: What the local tensors hold, as in :func:`find_dcp_mismatches`.
        width: Most characters in a bar; longer dims are drawn in buckets.

    Returns:
        The picture, lines joined with newlines.

    Example:
        >>> print(render_layout((6, 4), (2,), [Shard(0)], mesh_dim_names=("dp_shard",)))
        tensor (6, 4) on mesh dp_shard=2
        placements [Shard(dim=0)]; held by: FSDP2
        <BLANKLINE>
        dim 0 (size 6): owners of each index range
          [0, 3)  (0,)
          [3, 6)  (1,)
        <BLANKLINE>
        rank  coordinate    held    intervals / DCP box
           0  (0,)          ###...  [0, 3) / size 3 at 0
           1  (1,)          ...###  [3, 6) / size 3 at 3
    """
    placements = _check_layout(global_shape, mesh_shape, placements)
    if not 0 <= dim < len(global_shape):
        raise ValueError(f"dim={dim} is not a dim of {tuple(global_shape)}; use 0 <= dim < {len(global_shape)}")
    names = _axis_names(mesh_shape, placements, mesh_dim_names)
    held, holder = _resolve_actual(global_shape, mesh_shape, placements, actual)
    bad = {
        m.coordinate: m
        for m in find_dcp_mismatches(global_shape, mesh_shape, placements, actual=actual, mesh_dim_names=mesh_dim_names)
    }
    coords = list(itertools.product(*(range(s) for s in mesh_shape)))
    chunks = {c: held(c) for c in coords}
    size = global_shape[dim]

    if names[0].startswith("mesh dim"):
        mesh_text = str(tuple(mesh_shape))
    else:
        mesh_text = " x ".join(_axis_label(names, mesh_shape, m) for m in range(len(mesh_shape)))
    lines = [
        f"tensor {tuple(global_shape)} on mesh {mesh_text}",
        f"placements {list(placements)}; held by: {holder}",
        "",
        f"dim {dim} (size {size}): owners of each index range",
    ]
    cuts = sorted({0, size} | {x for c in coords for iv in chunks[c][dim] for x in iv})
    runs: list[tuple[int, int, str]] = []
    for lo, hi in zip(cuts, cuts[1:]):
        owners = " ".join(
            str(c).replace(" ", "") for c in coords if any(a <= lo and hi <= b for a, b in chunks[c][dim])
        )
        if runs and runs[-1][2] == owners and runs[-1][1] == lo:
            runs[-1] = (runs[-1][0], hi, owners)
        else:
            runs.append((lo, hi, owners))
    span = max((len(f"[{lo}, {hi})") for lo, hi, _ in runs), default=6)
    lines += [f"  {f'[{lo}, {hi})':<{span}}  {owners or '(nobody)'}" for lo, hi, owners in runs]

    bar_width = min(size, width)
    header = f"{'rank':>4}  {'coordinate':<12}  {'held':<{max(bar_width, 4)}}  intervals / DCP box"
    lines += ["", header]
    for c in coords:
        rank = _rank(mesh_shape, c)
        mark = "!" if c in bad else " "
        box = dcp_chunk(global_shape, mesh_shape, placements, c)
        lines.append(
            f"{rank:>4}{mark} {str(c).replace(' ', ''):<12}  {_bar(chunks[c][dim], size, width):<{max(bar_width, 4)}}  "
            f"{_fmt_intervals(chunks[c][dim])} / size {box[0][dim]} at {box[1][dim]}"
        )
    if bad:
        shown = list(bad.values())[:_MAX_MESSAGES]
        lines += ["", "! = DCP describes a different box than the data held:"]
        lines += [f"  {m.message}" for m in shown]
        if len(bad) > len(shown):
            lines.append(f"  ... and {len(bad) - len(shown)} more (see find_dcp_mismatches)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- parsing

_PLACEMENT_SYNTAX = (
    "R | Replicate() | S(d) | Shard(d) | Shard(dim=d) | SS(d,sf) | _S(d,sf) | "
    "_StridedShard(d,sf=n) | _StridedShard(dim=d,split_factor=n), comma-separated, "
    "e.g. 'SS(0,2),S(0)'"
)
_PLACEMENT_RE = re.compile(r"^([A-Za-z_]+)\s*(?:\((.*)\))?$")


def _split_top_level(text: str) -> list[str]:
    tokens, depth, current = [], 0, []
    for ch in text:
        if ch == "," and depth == 0:
            tokens.append("".join(current).strip())
            current = []
            continue
        depth += {"(": 1, ")": -1}.get(ch, 0)
        current.append(ch)
    tokens.append("".join(current).strip())
    return tokens


def _strip_brackets(text: str) -> str:
    """Drop one pair of brackets around the whole list: ``[...]`` or ``(...)``."""
    if text[:1] == "[" and text[-1:] == "]":
        return text[1:-1]
    if text[:1] == "(" and text[-1:] == ")":
        depth = 0
        for i, ch in enumerate(text):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                return text[1:-1] if i == len(text) - 1 else text
    return text


def _parse_args(token: str, args_text: str, names: Sequence[str]) -> dict[str, int]:
    """Parse ``'0, sf=2'`` against positional ``names`` (aliases: dim, sf/split_factor)."""
    values: dict[str, int] = {}
    args = [a.strip() for a in args_text.split(",")] if args_text.strip() else []
    for position, arg in enumerate(args):
        key, _, value = arg.rpartition("=")
        key = key.strip() or (names[position] if position < len(names) else "?")
        key = {"split_factor": "sf"}.get(key, key)
        if key not in names or key in values or not re.fullmatch(r"-?\d+", value.strip()):
            raise ValueError(
                f"bad placement token {token!r}: cannot read argument {arg!r}; syntax: {_PLACEMENT_SYNTAX}"
            )
        values[key] = int(value)
    if set(values) != set(names):
        raise ValueError(f"bad placement token {token!r}: needs {', '.join(names)}; syntax: {_PLACEMENT_SYNTAX}")
    return values


def parse_placements(text: str) -> list[Placement]:
    """Parse a placement list as written on the command line or printed by torch.

    Args:
        text: Comma-separated placements, optionally wrapped in ``()`` or ``[]``:
            ``R``/``Replicate()``, ``S(d)``/``Shard(d)``/``Shard(dim=d)``, and
            ``SS(d,sf)``/``_S(d, sf)``/``_StridedShard(d, sf=n)``/``_StridedShard(dim=d,
            split_factor=n)``.

    Returns:
        The placements, one per mesh axis.

    Raises:
        ValueError: Naming the bad token and showing the valid syntax.

    Example:
        >>> parse_placements("SS(0,2),S(0)")
        [_StridedShard(dim=0, sf=2), Shard(dim=0)]
        >>> parse_placements("(Replicate(), Shard(dim=1))")
        [Replicate(), Shard(dim=1)]
    """
    body = _strip_brackets(text.strip())
    tokens = _split_top_level(body)
    if len(tokens) > 1 and tokens[-1] == "":  # a 1-tuple's trailing comma: "(Replicate(),)"
        tokens.pop()
    out: list[Placement] = []
    for token in tokens:
        match = _PLACEMENT_RE.match(token)
        kind = match.group(1) if match else None
        args = match.group(2) if match and match.group(2) is not None else ""
        if kind in ("R", "Replicate") and not args.strip():
            out.append(Replicate())
        elif kind in ("S", "Shard"):
            out.append(Shard(_parse_args(token, args, ("dim",))["dim"]))
        elif kind in ("SS", "_S", "_StridedShard", "StridedShard"):
            values = _parse_args(token, args, ("dim", "sf"))
            if values["sf"] < 1:
                raise ValueError(
                    f"bad placement token {token!r}: split factor must be >= 1; syntax: {_PLACEMENT_SYNTAX}"
                )
            out.append(_StridedShard(values["dim"], split_factor=values["sf"]))
        else:
            raise ValueError(f"bad placement token {token!r} in {text!r}; syntax: {_PLACEMENT_SYNTAX}")
    return out


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...] | None]:
    """Parse a mesh as ``name=size`` pairs or bare sizes.

    Args:
        text: ``"dp_shard=4,tp=2"`` (named) or ``"4,2"`` / ``"4x2"`` (unnamed); items are
            separated by ``,`` or ``x``.

    Returns:
        ``(shape, names)``; ``names`` is None for bare sizes.

    Raises:
        ValueError: Naming the bad token and showing the valid syntax.

    Example:
        >>> parse_mesh("dp_shard=4,tp=2")
        ((4, 2), ('dp_shard', 'tp'))
        >>> parse_mesh("4x2")
        ((4, 2), None)
    """
    syntax = "name=size pairs like 'dp_shard=4,tp=2', or sizes like '4,2' or '4x2'"
    items = [t.strip() for t in re.split(r",|\s+x\s+|(?<=\d)x(?=\d)", text.strip())]
    shape: list[int] = []
    names: list[str] = []
    for item in items:
        match = re.fullmatch(r"(?:([A-Za-z_]\w*)\s*=\s*)?(\d+)", item)
        if match is None or int(match.group(2)) < 1:
            raise ValueError(f"bad mesh token {item!r} in {text!r}; use {syntax} (sizes >= 1)")
        if match.group(1):
            names.append(match.group(1))
        shape.append(int(match.group(2)))
    if names and len(names) != len(shape):
        raise ValueError(f"mesh {text!r} mixes named and bare sizes; use {syntax}")
    if len(set(names)) != len(names):
        raise ValueError(f"mesh {text!r} repeats an axis name; use {syntax} with distinct names")
    return tuple(shape), (tuple(names) if names else None)
