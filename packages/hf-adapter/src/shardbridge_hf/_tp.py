"""A transformers TP plan (``base_model_tp_plan`` + ``_tp_plan``) applied on the core ``tp`` mesh.

[Note: HF TP plan on the shardbridge mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.23 applies its own plan only through ``from_pretrained(tp_plan=...)``, and
then over the WHOLE world: the ``device_mesh`` argument is ignored (upstream bug 2), so TP
cannot be combined with FSDP that way. We read the plan the model declares (``model.tp_plan``
merges ``config.base_model_tp_plan`` with the class's ``_tp_plan``, FQN patterns with ``*``
for a layer index) and lower each style to torch's ``parallelize_module`` on the 1-D
``pm["tp"]`` mesh::

    HF style               torch ParallelStyle                                  weight
    colwise                ColwiseParallel()                                    Shard(0)
    rowwise                RowwiseParallel()          Partial -> Replicate out  Shard(1)
    colwise_gather_output  ColwiseParallel(output_layouts=Replicate())          Shard(0), full logits
    embedding_rowwise      RowwiseParallel(input_layouts=Replicate(),           Shard(0) vocab rows
                                           output_layouts=Replicate())

``colwise`` outputs stay local tensors (``use_local_output=True``): the attention reshapes
them with ``view(..., -1, head_dim)`` into the local heads, which is why heads must divide
evenly (checked by :func:`check_tp_divides`). Modules the plan does not name (norms) keep
plain replicated parameters: every TP rank computes the same values from the same batch.
With FP8 (torchao), Linears converted to ``Float8Linear`` take torchao's float8 styles.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from shardbridge import check_tp_divides as check_sizes_divide
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["SUPPORTED_STYLES", "apply_tp", "check_tp_divides", "resolve_tp_plan"]

#: The transformers plan styles this adapter lowers (others raise NotImplementedError).
SUPPORTED_STYLES: tuple[str, ...] = ("colwise", "rowwise", "colwise_gather_output", "embedding_rowwise")


def resolve_tp_plan(model: nn.Module, plan: str | Mapping[str, Any] = "auto") -> dict[str, Any]:
    """Expand a TP plan to ``{module FQN: style}`` for the modules of ``model``.

    Args:
        model: a transformers model (or any module when ``plan`` is explicit).
        plan: "auto" = ``model.tp_plan``; or ``{pattern: style}``, patterns relative to the
            top model, ``*`` matching one FQN component. Styles are HF names or torch
            ``ParallelStyle`` instances.

    Raises:
        ValueError: no plan on the model, or a pattern that matches no module.
        NotImplementedError: a style outside :data:`SUPPORTED_STYLES`.

    Example:
        >>> resolve_tp_plan(model)["model.layers.0.self_attn.q_proj"]  # doctest: +SKIP
        'colwise'
    """
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"tp_plan={plan!r}: use 'auto' or a mapping {{pattern: style}}")
        plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
        if not plan:
            raise ValueError(
                f"{type(model).__name__} declares no TP plan (model.tp_plan is empty); pass an explicit "
                "tp_plan={'pattern': 'colwise'|'rowwise'|...} or set tp=1"
            )
    names = [name for name, _ in model.named_modules() if name]
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        if isinstance(style, str) and style not in SUPPORTED_STYLES:
            raise NotImplementedError(
                f"TP style {style!r} (for {pattern!r}) is not supported by shardbridge_hf; supported: "
                f"{list(SUPPORTED_STYLES)} (or pass a torch ParallelStyle in an explicit tp_plan)"
            )
        regex = re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")
        matched = [name for name in names if regex.match(name)]
        if not matched:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}; patterns are FQNs "
                "relative to the top model with '*' for one component, e.g. 'model.layers.*.mlp.up_proj'"
            )
        for name in matched:
            out[name] = style
    return out


def check_tp_divides(config: Any, tp: int) -> None:
    """ValueError unless ``tp`` splits whole attention heads and MLP rows.

    Example:
        >>> check_tp_divides(LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 4)  # doctest: +SKIP
        Traceback (most recent call last):
        ValueError: num_key_value_heads(2) is not divisible by tp(4); ...
    """
    if tp == 1:
        return
    heads = getattr(config, "num_attention_heads", None)
    sizes = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "intermediate_size": getattr(config, "intermediate_size", None),
    }
    check_sizes_divide(sizes, tp, fix="choose parallelism_config_tp_size dividing each of them")
    if getattr(config, "tie_word_embeddings", False):
        raise NotImplementedError(
            "tie_word_embeddings=True with tp > 1: the embedding and lm_head are sharded on different dims; "
            "build the model with tie_word_embeddings=False or set tp=1"
        )


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: Mapping[str, Any],
    *,
    float8_styles: Mapping[str, type] | None = None,
    src_data_rank: int | None = 0,
) -> dict[str, ParallelStyle]:
    """Shard ``model`` over ``tp_mesh`` as in [Note: HF TP plan on the shardbridge mesh].

    Args:
        model: the model (parameters identical on every TP rank, or on meta).
        tp_mesh: the 1-D ``pm["tp"]`` mesh.
        plan: ``{module FQN: style}`` from :func:`resolve_tp_plan`.
        float8_styles: ``{"colwise": cls, "rowwise": cls}`` for torchao ``Float8Linear``
            modules (``shardbridge_hf._fp8.tp_styles()``); None = no FP8.
        src_data_rank: rank whose weights are scattered; None = every rank keeps its own
            piece (no communication: use it when rank-0 weights are broadcast afterwards,
            and when some ranks are on meta, where a scatter would hang).

    Returns:
        The torch plan that was applied.
    """
    torch_plan: dict[str, ParallelStyle] = {}
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        torch_plan[fqn] = _lower(style, module, float8_styles)
    parallelize_module(model, tp_mesh, torch_plan, src_data_rank=src_data_rank)
    return torch_plan


def _lower(style: Any, module: nn.Module, float8_styles: Mapping[str, type] | None) -> ParallelStyle:
    if isinstance(style, ParallelStyle):
        return style
    is_float8 = float8_styles is not None and type(module).__name__ == "Float8Linear"
    if style == "colwise":
        return float8_styles["colwise"]() if is_float8 else ColwiseParallel()
    if style == "rowwise":
        return float8_styles["rowwise"]() if is_float8 else RowwiseParallel()
    if style == "colwise_gather_output":
        # Shard(-1) logits -> Replicate: full-vocab logits on every TP rank, so the HF loss runs unchanged.
        cls = float8_styles["colwise"] if is_float8 else ColwiseParallel
        return cls(output_layouts=Replicate())
    if style == "embedding_rowwise":
        # Shard(0) vocab rows; Partial -> Replicate (all-reduce) of the looked-up rows.
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    raise NotImplementedError(f"TP style {style!r}; supported: {list(SUPPORTED_STYLES)}")
