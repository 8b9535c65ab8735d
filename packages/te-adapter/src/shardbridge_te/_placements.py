"""Which TP placement each parameter of a TE module has: a pure table, no TE import.

[Note: TE placement table]
~~~~~~~~~~~~~~~~~~~~~~~~~~
TE modules hold their TP shard as a plain parameter and say how it was split by
``parallel_mode`` (Linear-like modules) or by ``tp_size > 1`` alone (LayerNormMLP, the
learnable softmax offset of DotProductAttention). The table (TE PR #2713's, plus GroupedLinear,
which the PR leaves out)::

    module                  param                     column     row        None / tp_size 1
    Linear, GroupedLinear   weight*, <split>_weight   Shard(0)   Shard(1)   Replicate
                            bias*,   <split>_bias     Shard(0)   Replicate  Replicate
    LayerNormLinear         weight*, bias*            as Linear  (TE 2.x refuses row mode)
                            layer_norm_weight/bias    Replicate  Shard(0)   Replicate
    LayerNormMLP            fc1_weight, fc1_bias      Shard(0) whenever tp_size > 1
                            fc2_weight                Shard(1) whenever tp_size > 1
                            fc2_bias, layer_norm_*    Replicate
    LayerNorm, RMSNorm      weight, bias              Replicate
    DotProductAttention     softmax_offset            Shard(0) whenever tp_size > 1
    MultiheadAttention,     (no own parameters: their LayerNormLinear / Linear /
    TransformerLayer         LayerNormMLP / DotProductAttention children are converted)

``sequence_parallel`` does not change placements. ``Shard(d)`` here is on the 1-D TP mesh;
FSDP2 adds the data-parallel placement in front (``_StridedShard`` for dim 0).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from shardbridge.tp import TPMode

__all__ = ["CONTAINER_KINDS", "EXPERT_ATTR", "MODULE_KINDS", "param_kind", "tp_mode", "tp_modes"]

EXPERT_ATTR = "_shardbridge_te_experts"
"""Attribute on each GroupedLinear ``shard_grouped_experts`` marked (its ``ExpertState``): experts on
the ep axis take no TP placement ([Note: GroupedLinear experts] in ``_experts.py``)."""

MODULE_KINDS: tuple[str, ...] = (
    "Linear",
    "LayerNormLinear",
    "LayerNormMLP",
    "LayerNorm",
    "RMSNorm",
    "DotProductAttention",
    "GroupedLinear",
)
"""TE module classes with parameters of their own that the table covers."""

CONTAINER_KINDS: tuple[str, ...] = ("MultiheadAttention", "TransformerLayer")
"""TE modules whose parameters all live in covered children."""

_PARALLEL_MODES = ("column", "row", None)
_WEIGHT = re.compile(r"^(?:(?:[a-z0-9]+_)*weight\d*)$")
_BIAS = re.compile(r"^(?:(?:[a-z0-9]+_)*bias\d*)$")


def param_kind(name: str) -> str:
    """``"layer_norm"``, ``"weight"``, ``"bias"`` or ``"other"`` for a TE parameter name.

    Example:
        >>> [param_kind(n) for n in ("weight3", "query_weight", "layer_norm_bias", "softmax_offset")]
        ['weight', 'weight', 'layer_norm', 'other']
    """
    if name.startswith("layer_norm_"):
        return "layer_norm"
    if _WEIGHT.match(name):
        return "weight"
    if _BIAS.match(name):
        return "bias"
    return "other"


def _check(kind: str, parallel_mode: str | None) -> None:
    if kind not in MODULE_KINDS:
        raise ValueError(
            f"module kind {kind!r} has no placement rule; supported: {list(MODULE_KINDS)} "
            f"(containers {list(CONTAINER_KINDS)} are handled through their children)"
        )
    if parallel_mode not in _PARALLEL_MODES:
        raise ValueError(f"parallel_mode={parallel_mode!r} must be one of {list(_PARALLEL_MODES)}")


def tp_mode(kind: str, parallel_mode: str | None, tp_sharded: bool, name: str) -> TPMode:
    """The TP mode of parameter ``name`` of a TE module. See [Note: TE placement table].

    Args:
        kind: the TE class name (one of :data:`MODULE_KINDS`).
        parallel_mode: the module's ``parallel_mode`` (``"column"``, ``"row"`` or None).
        tp_sharded: whether the module splits its parameters over TP (``tp_size > 1``).
        name: the parameter's name in the module (``"weight"``, ``"fc1_bias"``, ``"weight2"``).

    Raises:
        ValueError: an unknown kind, parallel mode or parameter name.

    Example:
        >>> tp_mode("Linear", "row", True, "weight"), tp_mode("Linear", "row", True, "bias")
        (<TPMode.ROW: 'row'>, <TPMode.NONE: 'none'>)
        >>> tp_mode("LayerNormMLP", None, True, "fc2_weight")
        <TPMode.ROW: 'row'>
    """
    _check(kind, parallel_mode)
    if not tp_sharded:
        return TPMode.NONE
    pk = param_kind(name)
    if kind in ("LayerNorm", "RMSNorm"):
        if pk not in ("weight", "bias"):
            raise ValueError(f"{kind} has no parameter {name!r}; expected weight or bias")
        return TPMode.NONE
    if kind == "DotProductAttention":
        if name != "softmax_offset":
            raise ValueError(f"DotProductAttention has no parameter {name!r}; expected softmax_offset")
        return TPMode.COLUMN
    if kind == "LayerNormMLP":
        table = {
            "fc1_weight": TPMode.COLUMN,
            "fc1_bias": TPMode.COLUMN,
            "fc2_weight": TPMode.ROW,
            "fc2_bias": TPMode.NONE,
            "layer_norm_weight": TPMode.NONE,
            "layer_norm_bias": TPMode.NONE,
        }
        if name not in table:
            raise ValueError(f"LayerNormMLP has no parameter {name!r}; expected one of {list(table)}")
        return table[name]
    # Linear, LayerNormLinear, GroupedLinear
    if pk == "layer_norm":
        if kind != "LayerNormLinear":
            raise ValueError(f"{kind} has no layer-norm parameter {name!r}")
        return TPMode.COLUMN if parallel_mode == "row" else TPMode.NONE
    if pk == "weight":
        return {"column": TPMode.COLUMN, "row": TPMode.ROW, None: TPMode.NONE}[parallel_mode]
    if pk == "bias":
        return TPMode.COLUMN if parallel_mode == "column" else TPMode.NONE
    raise ValueError(f"{kind} parameter {name!r} is neither a weight nor a bias; no placement rule for it")


def tp_modes(kind: str, parallel_mode: str | None, tp_sharded: bool, names: Iterable[str]) -> Mapping[str, TPMode]:
    """:func:`tp_mode` for each of ``names``, in order.

    Example:
        >>> dict(tp_modes("GroupedLinear", "column", True, ["weight0", "weight1"]))
        {'weight0': <TPMode.COLUMN: 'column'>, 'weight1': <TPMode.COLUMN: 'column'>}
    """
    return {name: tp_mode(kind, parallel_mode, tp_sharded, name) for name in names}
