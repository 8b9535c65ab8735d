"""Spreads as JSON values, and back: what a derived load rebuilds from the manifest.

[Note: spread recipes]
~~~~~~~~~~~~~~~~~~~~~~
A :class:`~shardbridge.checkpoint.derived._spread.Spread` is a function (coordinate -> boxes), so
it cannot be stored; its *recipe* can: the constructor that built it and that constructor's
arguments, as JSON values (``Spread.recipe``, set by every constructor that can be rebuilt):

    ("replicated", {"shape"})                               Spread.replicated
    ("placement",  {"shape", "placements", "rule", "multi"}) placement_spread (DTensors)
    ("fused",      {"name", "spec", "tp_size", "whole"})     component_spread (fused components)

plus the grid (:func:`encode_grid`: its shape and its ranks as arithmetic runs, a few numbers
for any mesh of an SPMD job) and the two fields that are not the constructor's
(``keep_empty``, ``properties``). :func:`rebuild` calls the same constructor again. Everything
read back is checked (types, ranges, the grid a permutation of the job's ranks, split factors and
fused sizes within the shape) and a rebuilt spread is only used when the digest of every rebuilt
spread equals the digest the saving ranks agreed on (``spreads_digest``: the same inputs) and the
``.metadata`` rendered from the records derived from them is the saved ``.metadata``, byte for byte
(the same outputs: another version of shardbridge's layout algebra or of torch could give the same
inputs other boxes; [Note: derived loads] in ``_records.py``). Anything else is refused with :class:`NotDerivable` and the load reads ``.metadata``. Nothing here runs code from the checkpoint: JSON
values select one of three constructors and give them integers and strings.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorProperties

from shardbridge._fused import FusedSpec
from shardbridge.checkpoint.derived._layouts import component_spread, placement_spread
from shardbridge.checkpoint.derived._spread import Grid, NotDerivable, Spread
from shardbridge.checkpoint.state._repair import RULES
from shardbridge.layout import parse_placements

__all__ = ["decode_grid", "decode_properties", "encode_grid", "encode_properties", "rebuild"]

_MAX_DIMS = 16
_MAX_DEPTH = 4  # fused recipes nest one "whole"
_MAX_COMPONENTS = 64
_DTYPES = {str(t): t for t in vars(torch).values() if isinstance(t, torch.dtype)}


def encode_grid(grid: Grid) -> dict[str, Any]:
    """``{"shape": [...], "ranks": [[start, step, count], ...]}``: the ranks as arithmetic runs."""
    ranks, runs, i = grid.ranks.tolist(), [], 0
    while i < len(ranks):
        step, j = (ranks[i + 1] - ranks[i] if i + 1 < len(ranks) else 1), i + 1
        while j < len(ranks) and ranks[j] - ranks[j - 1] == step:
            j += 1
        runs.append([ranks[i], step, j - i])
        i = j
    return {"shape": list(grid.shape), "ranks": runs}


def decode_grid(record: Any, world_size: int) -> Grid:
    """The grid :func:`encode_grid` wrote; NotDerivable unless it is a permutation of the job's ranks."""
    if not isinstance(record, dict) or set(record) != {"shape", "ranks"}:
        raise NotDerivable(f"grid {record!r:.80} is not {{'shape', 'ranks'}}")
    shape = _ints(record["shape"], "grid shape", minimum=1)
    if not 1 <= len(shape) <= _MAX_DIMS or math.prod(shape) != world_size:
        raise NotDerivable(f"grid shape {shape} does not hold the job's {world_size} ranks")
    runs = record["ranks"]
    if not isinstance(runs, list) or not runs or len(runs) > world_size:
        raise NotDerivable("grid ranks are not a list of runs")
    parts, total = [], 0
    for run in runs:
        start, step, count = _ints(run, "grid run", minimum=None)
        if count < 1 or start < 0:
            raise NotDerivable(f"grid run {run} is empty or negative")
        total += count
        if total > world_size:
            raise NotDerivable(f"grid runs hold more than the job's {world_size} ranks")
        parts.append(torch.arange(count, dtype=torch.int64) * step + start)
    ranks = torch.cat(parts)
    if ranks.numel() != world_size or not torch.equal(torch.sort(ranks).values, torch.arange(world_size)):
        raise NotDerivable(f"grid ranks are not a permutation of range({world_size})")
    return Grid(shape, ranks)


def encode_properties(properties: TensorProperties | None) -> list[Any] | None:
    """``[dtype, requires_grad]``; None for a bytes item. NotDerivable for a layout or memory
    format other than the defaults a save writes. ``pin_memory`` is not kept: an asynchronous
    save stages into pinned host memory, and nothing a load does depends on it."""
    if properties is None:
        return None
    default = TensorProperties(dtype=properties.dtype)
    if (properties.layout, properties.memory_format) != (default.layout, default.memory_format):
        raise NotDerivable(f"tensor properties {properties} are not the defaults")
    return [str(properties.dtype), bool(properties.requires_grad)]


def decode_properties(record: Any) -> TensorProperties | None:
    """What :func:`encode_properties` wrote."""
    if record is None:
        return None
    if not isinstance(record, list) or len(record) != 2 or record[0] not in _DTYPES or not isinstance(record[1], bool):
        raise NotDerivable(f"tensor properties {record!r:.80} are not [dtype, requires_grad]")
    return TensorProperties(dtype=_DTYPES[record[0]], requires_grad=record[1])


def rebuild(
    recipe: Any, grid: Grid, *, keep_empty: bool | None, properties: TensorProperties | None, depth: int = 0
) -> Spread:
    """The spread ``recipe`` describes on ``grid`` (see [Note: spread recipes]); NotDerivable if it cannot be.

    ``keep_empty``: the saved spread's (None: as its constructor builds it)."""
    if depth > _MAX_DEPTH or not isinstance(recipe, list) or len(recipe) != 2 or not isinstance(recipe[1], dict):
        raise NotDerivable(f"recipe {recipe!r:.80} is not [kind, arguments]")
    kind, args = recipe
    try:
        if kind == "replicated" and set(args) == {"shape"}:
            spread = Spread.replicated(math.prod(grid.shape), _ints(args["shape"], "shape", minimum=0), properties)
            if spread.grid.digest != grid.digest:
                raise NotDerivable("a replicated entry's grid is not every rank in order")
        elif kind == "placement" and set(args) == {"shape", "placements", "rule", "multi"}:
            shape = _ints(args["shape"], "shape", minimum=0)
            placements = args["placements"]
            if (
                not isinstance(placements, list)
                or len(placements) != len(grid.shape) - 1
                or not all(isinstance(p, str) and len(p) < 64 for p in placements)
            ):
                raise NotDerivable(f"placements {placements!r:.80} do not fit the grid {grid.shape}")
            parsed = tuple(parse_placements(", ".join(placements))) if placements else ()
            if len(parsed) != len(placements) or any(getattr(p, "dim", 0) >= max(1, len(shape)) for p in parsed):
                raise NotDerivable(f"placements {placements} do not fit the shape {shape}")
            # a split factor beyond the dim's size means nothing, and costs a loop of that length per coordinate
            if any(getattr(p, "split_factor", 1) > max(1, shape[p.dim]) for p in parsed if hasattr(p, "dim")):
                raise NotDerivable(f"placements {placements}: a split factor larger than its dim of {shape}")
            # a coordinate holds up to their product of boxes; no layout of the job's ranks has more
            if math.prod(getattr(p, "split_factor", 1) for p in parsed) > math.prod(grid.shape):
                raise NotDerivable(f"placements {placements}: split factors beyond the job's {math.prod(grid.shape)} ranks")
            rule, multi = args["rule"], args["multi"]
            if rule not in ("dcp", *RULES) or not isinstance(multi, bool):
                raise NotDerivable(f"rule {rule!r} / multi {multi!r}")
            spread = placement_spread(tuple(shape), grid, parsed, rule, multi=multi, properties=properties)
        elif kind == "fused" and set(args) == {"name", "spec", "tp_size", "whole"}:
            spec_args, name, tp_size = args["spec"], args["name"], args["tp_size"]
            if not isinstance(spec_args, dict) or set(spec_args) != {"components", "dim", "head_dim"}:
                raise NotDerivable(f"fused spec {spec_args!r:.80}")
            components = spec_args["components"]
            if (
                not isinstance(components, list)
                or not 1 <= len(components) <= _MAX_COMPONENTS
                or not all(isinstance(c, list) and len(c) == 2 and isinstance(c[0], str) for c in components)
            ):
                raise NotDerivable(f"fused components {components!r:.80}")
            spec = FusedSpec(
                components=tuple((c[0], c[1]) for c in components), dim=spec_args["dim"], head_dim=spec_args["head_dim"]
            )
            _ints([tp_size], "tp_size", minimum=1)
            if not isinstance(name, str) or name not in spec.names or properties is None:
                raise NotDerivable(f"fused component {name!r} of {spec.names} (a tensor)")
            if tp_size > math.prod(grid.shape):  # TP over more ranks than the job has
                raise NotDerivable(f"fused tp_size {tp_size} on a job of {math.prod(grid.shape)} ranks")
            whole = rebuild(args["whole"], grid, keep_empty=None, properties=None, depth=depth + 1)
            whole_shape = whole.recipe[1].get("shape", []) if whole.recipe else []
            if spec.dim >= len(whole_shape) or any(size > whole_shape[spec.dim] for _, size in spec.components):
                raise NotDerivable(f"fused components {spec.components} do not fit the fused shape {whole_shape}")
            spread = component_spread(whole, spec, tp_size, name, properties)
        else:
            raise NotDerivable(f"recipe kind {kind!r} with arguments {sorted(args)}")
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RuntimeError) as exc:
        raise NotDerivable(f"recipe {kind!r}: {exc}") from None
    if keep_empty is not None and spread.keep_empty != keep_empty:
        spread = dataclasses.replace(spread, keep_empty=keep_empty)
    return spread


def _ints(value: Any, what: str, *, minimum: int | None) -> list[int]:
    if (
        not isinstance(value, list)
        or len(value) > _MAX_DIMS * 4
        or not all(
            isinstance(v, int) and not isinstance(v, bool) and abs(v) < 1 << 62 and (minimum is None or v >= minimum)
            for v in value
        )
    ):
        raise NotDerivable(
            f"{what} {value!r:.80} is not a list of ints" + ("" if minimum is None else f" >= {minimum}")
        )
    return list(value)
