"""STRUCTURAL TIER: small TE models built from configs, one per (module kind, parallel mode).

Test support only. Every builder runs TE's real constructor (``_te_structural.import_te``) on
meta inside ``cuda_construction``; parameters are float32 so FSDP2 needs no casting.
"""

from __future__ import annotations

from typing import Any

import torch
from _te_structural import cuda_construction, import_te
from torch import nn

HIDDEN = 16
OUT = 32  # divisible by tp 1, 2, 4
UNEVEN_OUT = 30  # 30 over tp=4 -> torch.chunk pieces [8, 8, 8, 6]
HEADS = 4

# (kind, parallel mode) pairs the structural tier covers. None = no TP split. TE 2.20.2
# refuses LayerNormLinear row mode ("Normalization does not support tensor-parallel
# distribution"); LayerNormMLP / DotProductAttention have no parallel_mode (split iff tp_size > 1,
# "column" below means split); LayerNorm / RMSNorm are never split.
CASES: tuple[tuple[str, str | None], ...] = (
    ("Linear", "column"),
    ("Linear", "row"),
    ("Linear", None),
    ("LayerNormLinear", "column"),
    ("LayerNormLinear", None),
    ("LayerNormMLP", "column"),
    ("LayerNormMLP", None),
    ("LayerNorm", None),
    ("RMSNorm", None),
    ("DotProductAttention", "column"),
    ("DotProductAttention", None),
    ("MultiheadAttention", "column"),
    ("MultiheadAttention", None),
    ("TransformerLayer", "column"),
    ("TransformerLayer", None),
    ("GroupedLinear", "column"),
    ("GroupedLinear", "row"),
    ("GroupedLinear", None),
)


class Holder(nn.Module):
    """Root module with one TE module ``te`` (FSDP unit) and a torch ``head`` (root-managed)."""

    def __init__(self, module: nn.Module, *, head: bool = True) -> None:
        super().__init__()
        self.te = module
        if head:
            self.head = nn.Linear(HIDDEN, 3)


def build_te_module(kind: str, mode: str | None, tp: int, **overrides: Any) -> nn.Module:
    """The TE module of ``kind`` for TP degree ``tp`` (``mode`` None -> no TP split), on meta."""
    te = import_te()
    split = mode is not None and tp > 1
    tp_size = tp if split else 1
    kw: dict[str, Any] = dict(params_dtype=torch.float32, device="meta")
    with cuda_construction("meta"), torch.device("meta"):
        if kind == "Linear":
            kw.update(overrides)
            return te.Linear(HIDDEN, OUT, bias=True, parallel_mode=mode, tp_size=tp_size, **kw)
        if kind == "LayerNormLinear":
            return te.LayerNormLinear(HIDDEN, OUT, bias=True, parallel_mode=mode, tp_size=tp_size, **kw)
        if kind == "LayerNormMLP":
            act = overrides.get("activation", "gelu")
            return te.LayerNormMLP(HIDDEN, OUT, bias=True, tp_size=tp_size, activation=act, **kw)
        if kind == "LayerNorm":
            return te.LayerNorm(HIDDEN, **kw)
        if kind == "RMSNorm":
            return te.RMSNorm(HIDDEN, **kw)
        if kind == "DotProductAttention":
            return te.DotProductAttention(HEADS, HIDDEN // HEADS, softmax_type="learnable", tp_size=tp_size)
        if kind == "MultiheadAttention":
            return te.MultiheadAttention(
                HIDDEN, HEADS, tp_size=tp_size, set_parallel_mode=split, input_layernorm=True, **kw
            )
        if kind == "TransformerLayer":
            return te.TransformerLayer(HIDDEN, OUT, HEADS, tp_size=tp_size, set_parallel_mode=split, **kw)
        if kind == "GroupedLinear":
            return te.GroupedLinear(3, HIDDEN, OUT, bias=False, parallel_mode=mode, tp_size=tp_size, **kw)
    raise ValueError(f"unknown kind {kind!r}")


def build(kind: str, mode: str | None, tp: int, **overrides: Any) -> Holder:
    """``Holder(build_te_module(...))`` with the head on meta too."""
    module = build_te_module(kind, mode, tp, **overrides)
    with torch.device("meta"):
        return Holder(module)
