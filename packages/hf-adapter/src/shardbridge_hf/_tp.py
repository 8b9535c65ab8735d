"""A transformers TP plan (``base_model_tp_plan`` + ``_tp_plan``) applied on the core ``tp`` mesh.

[Note: HF TP plan on the shardbridge mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.23 applies its own plan only through ``from_pretrained(tp_plan=...)``, and
then over the WHOLE world: the ``device_mesh`` argument is ignored (upstream bug 2), so TP
cannot be combined with FSDP that way. We read the plan the model declares (``model.tp_plan``
merges ``config.base_model_tp_plan`` with the class's ``_tp_plan``, FQN patterns with ``*``
for a layer index; a pattern names a module or a bare parameter) and lower each style of
transformers' ``ParallelInterface`` to a torch ``ParallelStyle`` on the 1-D ``pm["tp"]`` mesh,
so every sharded parameter is a DTensor (FSDP2, clipping, checkpoints and export see it)::

    HF style (module)        torch ParallelStyle                                  weight
    colwise                  ColwiseParallel()                                    Shard(0)
    rowwise                  RowwiseParallel()          Partial -> Replicate out  Shard(1)
    colwise_gather_output,   ColwiseParallel(output_layouts=Replicate())          Shard(0), full output
      colwise_rep
    rowwise_split_input,     RowwiseParallel(input_layouts=Replicate())           Shard(1), full input
      rowwise_rep                                       (split locally)
    embedding_rowwise        RowwiseParallel(Replicate in / out)                  Shard(0) vocab rows
    embedding_colwise        ColwiseParallel(Replicate in / out)                  Shard(1) hidden
    sequence_parallel        SequenceParallel(use_local_output=True)              Replicate
    replicated_with_grad_allreduce  Replicate params; gradient all-reduced iff partial, see
                             [Note: partial gradients over tp]
    packed_colwise, moe_tp_experts, moe_identity_expert, local_params, all_reduce,
    mla_kv_a_proj: see [Note: HF styles beyond colwise / rowwise]
    replicate                nothing: plain replicated parameters (as unplanned modules)

Each style is one entry of a table (``_LOWERINGS`` for module entries, ``_PARAM_PLACEMENTS`` for
bare-parameter entries); :data:`SUPPORTED_STYLES` is its key list.

    HF style (parameter)     placement
    colwise*                 Shard(ndim - 2)        (experts [E, out, in]: the out dim)
    rowwise*                 Shard(ndim - 1); a bias Replicate
    packed_colwise           _StridedShard(ndim - 2, sf=2)   [gate; up]: each rank a slice of each
    packed_rowwise           _StridedShard(ndim - 1, sf=2)

``grouped_gemm`` and ``ep_dispatch_experts`` belong to transformers' expert-parallel plan
(``base_model_ep_plan``), applied on the ``ep`` axis when ep > 1 ([Note: HF EP plan on the
shardbridge mesh] in ``_ep.py``); in a TP plan they are refused by name (:data:`REFUSED_STYLES`).

``colwise`` outputs stay local tensors (``use_local_output=True``): the attention reshapes
them with ``view(..., -1, head_dim)`` into the local heads, which is why heads must divide
evenly (checked by :func:`check_tp_divides`). Modules the plan does not name keep plain
replicated parameters: every TP rank computes the same values from the same batch -- unless
the module sits in a block between a local-output colwise layer and its rowwise partner (a
per-head norm): it may then see only this rank's heads, and left alone its replicas would drift
apart. :func:`resolve_tp_plan` gives such modules ``replicated_with_grad_allreduce``
(:func:`unplanned_in_tp_blocks`), whose gradients the data flow decides.

Tied input / output embeddings: ``embedding_rowwise`` and ``colwise_gather_output`` both
shard the ``[vocab, hidden]`` weight as Shard(0), so the tied weight stays ONE DTensor
parameter (re-tied after the styles ran): one gradient, one FSDP2 parameter, one checkpoint
entry. Plans that would shard the two uses differently are refused.
With FP8, the modules ``fp8.convert`` converted (``shardbridge.fp8.converted_fqn``) take the backend's
``tp_styles`` for colwise* / rowwise* (torchao tensorwise: its float8 styles; mxfp8: the core's local-shard
styles, [Note: MXFP8 under tensor parallelism]).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from shardbridge import fp8
from shardbridge.adapters import checked_args
from shardbridge.tp import check_tp_divides as check_sizes_divide
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
)

from shardbridge_hf import _styles
from shardbridge_hf._styles import ReplicatedGradParallel, install_decider

__all__ = [
    "REFUSED_STYLES",
    "SUPPORTED_STYLES",
    "apply_tp",
    "check_tp_divides",
    "installed_hf_styles",
    "resolve_tp_plan",
    "unplanned_in_tp_blocks",
]

_COLWISE = ("colwise", "colwise_gather_output", "colwise_rep")
_ROWWISE = ("rowwise", "rowwise_split_input", "rowwise_rep")

#: Styles refused by name, with why and what to do instead.
REFUSED_STYLES: dict[str, str] = {
    "grouped_gemm": "it is an expert-parallel style (transformers' base_model_ep_plan): it belongs in "
    "fsdp_config.shardbridge.ep_plan, applied with ep_size > 1 on the ep axis (shardbridge_hf._ep); a TP plan shards "
    "experts with 'moe_tp_experts' on the experts module and 'packed_colwise' / 'rowwise' on its parameters",
    "ep_dispatch_experts": "it is an expert-parallel style (transformers' base_model_ep_plan): it belongs in "
    "fsdp_config.shardbridge.ep_plan, applied with ep_size > 1 on the ep axis (shardbridge_hf._ep); a TP plan uses "
    "'moe_tp_experts' on the experts module",
}

# Styles whose module output is this rank's LOCAL shard of the features (heads).
_LOCAL_OUTPUT = ("colwise", "packed_colwise")


def installed_hf_styles() -> set[str]:
    """The style names transformers' ``ParallelInterface`` registers in the installed version."""
    try:  # transformers >= 5.21: the registry lives in transformers.distributed
        import transformers.distributed.expert_parallel  # noqa: F401  registers the EP styles
        import transformers.distributed.tensor_parallel  # noqa: F401  registers the TP styles
        from transformers.distributed.parallel_utils import ParallelInterface
    except ImportError:  # older 5.x: one module
        from transformers.integrations.tensor_parallel import ParallelInterface
    return set(ParallelInterface._global_mapping)


@checked_args(model=nn.Module, plan=(str, Mapping))
def resolve_tp_plan(model: nn.Module, plan: str | Mapping[str, Any] = "auto") -> dict[str, Any]:
    """Expand a TP plan to ``{module or parameter FQN: style}`` for ``model``.

    Args:
        model: a transformers model (or any module when ``plan`` is explicit).
        plan: "auto" = ``model.tp_plan``; or ``{pattern: style}``, patterns relative to the
            top model, ``*`` matching one FQN component, naming a module or a parameter.
            Styles are HF names or torch ``ParallelStyle`` instances.

    Unplanned modules with parameters inside a block with colwise and rowwise layers get
    ``replicated_with_grad_allreduce`` (:func:`unplanned_in_tp_blocks`).

    Raises:
        ValueError: no plan on the model, or a pattern that matches nothing.
        NotImplementedError: a style outside :data:`SUPPORTED_STYLES`.

    Example:
        >>> resolve_tp_plan(model)["model.layers.0.self_attn.q_proj"]  # doctest: +SKIP
        'colwise'
    """
    auto = isinstance(plan, str)
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"tp_plan={plan!r}: use 'auto' or a mapping {{pattern: style}}")
        plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
        if not plan:
            raise ValueError(
                f"{type(model).__name__} declares no TP plan (model.tp_plan is empty); pass an explicit "
                "tp_plan={'pattern': 'colwise'|'rowwise'|...} or set tp=1"
            )
        plan = _with_mla_query(plan)
    names = [name for name, _ in model.named_modules() if name]
    names += [name for name, _ in model.named_parameters(remove_duplicate=False)]
    out: dict[str, Any] = {}
    for pattern, style in plan.items():
        regex = re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")
        matched = [name for name in names if regex.match(name)]
        if isinstance(style, str):
            _check_style(style, pattern)
        if not matched and auto:
            continue  # the model's own plan covers layer variants this config may not build (dense / MoE)
        if not matched:
            raise ValueError(
                f"tp_plan pattern {pattern!r} matches no module or parameter of {type(model).__name__}; patterns "
                "are FQNs relative to the top model with '*' for one component, e.g. 'model.layers.*.mlp.up_proj'"
            )
        for name in matched:
            out[name] = style
    for name in unplanned_in_tp_blocks(model, out):
        # The plan leaves it out (e.g. Apertus' learnable XIELU activation): the data flow decides
        # whether its gradient is all-reduced over tp, see [Note: partial gradients over tp].
        out[name] = "replicated_with_grad_allreduce"
    if auto:
        _fix_packed_experts(out)
        _fix_dynamic_mask_attention(model, out)
    return out


def _with_mla_query(plan: dict[str, Any]) -> dict[str, Any]:
    """MLA without q-LoRA: ``q_proj`` is planned like the ``q_b_proj`` it replaces.

    MLA attention (DeepSeek-V2/V3, GLM-4-MoE-Lite, Dots, MiniCPM3) computes the query as
    ``q_b_proj(q_a_layernorm(q_a_proj(x)))``, or, when the config sets ``q_lora_rank: null``
    (DeepSeek-V2-Lite publishes it so), as one ``q_proj(x)`` with the same output heads. Some
    models' plans (GLM-4-MoE-Lite, Dots in transformers 5.24) name only ``q_b_proj``: an
    unplanned ``q_proj`` would stay replicated and produce every head while the keys and values
    hold this rank's heads (``a and b must have same reduction dim``). It gets ``q_b_proj``'s style.
    """
    out = dict(plan)
    for pattern, style in plan.items():
        head, dot, name = pattern.rpartition(".")
        if name == "q_b_proj" and style == "colwise":
            out.setdefault(f"{head}{dot}q_proj", style)
    return out


def _fix_dynamic_mask_attention(model: nn.Module, plan: dict[str, Any]) -> None:
    """Doge's dynamic-mask attention: its per-kv-head mask is computed for this rank's heads only.

    ``DogeAttention`` turns the (colwise, local) value heads into one mask value per kv head:
    ``exp(A * softplus(dt_proj(v)))``. transformers' plan makes ``dt_proj`` ``rowwise``, whose
    all-reduced output holds EVERY kv head, while the attention runs on this rank's heads
    (``size of tensor a (4) must match b (8)``). Here ``dt_proj``'s partial output is
    reduce-scattered over the kv heads (``Shard(-1)``) and ``A`` (one value per kv head) is
    sharded the same way, used as a local tensor in the forward (``local_params``).
    """
    for fqn, module in model.named_modules():
        if type(module).__name__ != "DogeAttention" or plan.get(f"{fqn}.dt_proj") != "rowwise":
            continue
        plan[f"{fqn}.dt_proj"] = _styles.RowwiseOwnOutput(output_layouts=Shard(-1))  # one instance per module
        plan[f"{fqn}.A"] = "colwise"  # 1-D: Shard(0), the kv heads
        plan[fqn] = "local_params"


def _fix_packed_experts(plan: dict[str, Any]) -> None:
    """A model plan's plain ``colwise`` on a packed ``experts.gate_up_proj`` becomes ``packed_colwise``.

    transformers' experts modules hold ``[gate; up]`` stacked along the output dim of the 3-D
    ``gate_up_proj`` and split each expert's output with ``chunk(2, dim=-1)``. Inkling /
    Inkling2 (transformers 5.23) plan it ``colwise``: a plain Shard would give one TP rank the
    gate rows and the other the up rows, whose local ``chunk`` then pairs gate with gate (step-1
    expert gradients off by 140% relative norm). Every other model plans it ``packed_colwise``.
    """
    for fqn, style in plan.items():
        owner, _, name = fqn.rpartition(".")
        if style == "colwise" and name == "gate_up_proj" and plan.get(owner) == "moe_tp_experts":
            plan[fqn] = "packed_colwise"


def _check_style(style: str, pattern: str) -> None:
    if style in REFUSED_STYLES:
        raise NotImplementedError(f"TP style {style!r} (for {pattern!r}): {REFUSED_STYLES[style]}")
    if style not in SUPPORTED_STYLES:
        raise NotImplementedError(
            f"TP style {style!r} (for {pattern!r}) is not supported by shardbridge_hf; supported: "
            f"{list(SUPPORTED_STYLES)} (or pass a torch ParallelStyle in an explicit tp_plan)"
        )


def unplanned_in_tp_blocks(model: nn.Module, plan: Mapping[str, Any]) -> list[str]:
    """Unplanned modules with parameters inside a block that has colwise (local-output) and rowwise layers.

    Such a block (an attention or MLP module) computes on this rank's heads between its colwise
    and rowwise layers; an unplanned module in it (Qwen3's ``q_norm`` when the plan omits it,
    Apertus' learnable activation, MLA's ``kv_a_layernorm``) may or may not see them. Its
    parameters get the data-flow rule of ``replicated_with_grad_allreduce`` ([Note: partial
    gradients over tp]): all-reduced over tp exactly when their gradient is partial.

    Args:
        model: the model.
        plan: ``{FQN: style}`` (resolved).

    Returns:
        The FQNs of those modules (whole unplanned subtrees: a child none of whose modules or
        parameters the plan names).
    """
    modules = dict(model.named_modules())
    planned = set(plan)
    found: list[str] = []
    for parent_name, parent in modules.items():
        children = {f"{parent_name}.{n}" if parent_name else n: c for n, c in parent.named_children()}
        if not any(isinstance(plan.get(n), str) and plan[n] in _LOCAL_OUTPUT for n in children):
            continue
        if not any(isinstance(plan.get(n), str) and plan[n] in _ROWWISE for n in children):
            continue
        for name, child in children.items():
            has_params = any(True for _ in child.parameters())
            covered = any(p == name or p.startswith(name + ".") for p in planned)
            if has_params and not covered:
                found.append(name)
    return found


@checked_args(tp=int)
def check_tp_divides(config: Any, tp: int, *, experts_split_by_ep: bool = False) -> None:
    """ValueError unless ``tp`` splits whole attention heads and MLP rows.

    With ``experts_split_by_ep`` (ep > 1) the experts are whole on their ranks: their width
    (``moe_intermediate_size``) need not divide.

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
        "moe_intermediate_size": None if experts_split_by_ep else getattr(config, "moe_intermediate_size", None),
    }
    sizes = {k: v for k, v in sizes.items() if isinstance(v, int)}
    check_sizes_divide(sizes, tp, fix="choose parallelism_config_tp_size dividing each of them")


@checked_args(model=nn.Module, tp_mesh=DeviceMesh, plan=Mapping)
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
        plan: ``{module or parameter FQN: style}`` from :func:`resolve_tp_plan`.
        float8_styles: ``{"colwise": cls, "rowwise": cls}``: the FP8 backend's ``tp_styles``, for the
            modules ``fp8.convert`` converted (``fp8.converted_fqn``); None = no FP8 styles.
        src_data_rank: rank whose weights are scattered; None = every rank keeps its own
            piece (no communication: use it when rank-0 weights are broadcast afterwards,
            and when some ranks are on meta, where a scatter would hang).

    Returns:
        The torch plan that was applied (a parameter's entry is the style applied to its module).

    Raises:
        ValueError: tied embeddings that the plan shards differently in their two uses.
    """
    tied = _tied_embeddings(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    torch_plan: dict[str, ParallelStyle] = {}
    by_owner: dict[str, dict[str, Any]] = {}
    for fqn, style in plan.items():
        if fqn in params and not isinstance(style, ParallelStyle):
            owner, _, name = fqn.rpartition(".")
            by_owner.setdefault(owner, {})[name] = _param_placement(style, fqn)
            continue
        lowered = _lower(style, fqn, model, float8_styles)
        if lowered is not None:
            torch_plan[fqn] = lowered
    for owner, placements in by_owner.items():
        style = _styles.ParamPlacement({k: v for k, v in placements.items() if v is not None})
        for name in placements:
            torch_plan[f"{owner}.{name}" if owner else name] = style
    # Parameter placements first (their module's forward style may swap them for local views).
    applied: set[int] = set()
    ordered = [f for f in torch_plan if f in params] + [f for f in torch_plan if f not in params]
    for fqn in ordered:
        style = torch_plan[fqn]
        if id(style) in applied:
            continue
        applied.add(id(style))
        style.src_data_rank = src_data_rank
        target = fqn.rpartition(".")[0] if fqn in params else fqn
        style._apply(model.get_submodule(target), tp_mesh)
    if tied is not None:
        _retie(model, *tied)
    _install_deciders(model, torch_plan)
    return torch_plan


def _install_deciders(model: nn.Module, torch_plan: Mapping[str, ParallelStyle]) -> None:
    """Each replicated-gradient module's parent block decides its cells. See [Note: partial gradients over tp]."""
    by_block: dict[str, list[Any]] = {}
    for fqn, style in torch_plan.items():
        if isinstance(style, ReplicatedGradParallel) and style.cells:
            by_block.setdefault(fqn.rpartition(".")[0], []).extend(style.cells)
    for block, cells in by_block.items():
        install_decider(model.get_submodule(block), cells)


def _tied_embeddings(model: nn.Module) -> tuple[nn.Module, nn.Module] | None:
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    embed, head = (get_in() if get_in else None), (get_out() if get_out else None)
    if embed is None or head is None or getattr(head, "weight", None) is not getattr(embed, "weight", 0):
        return None
    return embed, head


def _retie(model: nn.Module, embed: nn.Module, head: nn.Module) -> None:
    """One DTensor for the tied weight. See [Note: HF TP plan on the shardbridge mesh]."""
    e, h = embed.weight, head.weight
    if e is h:
        return
    e_pl = e.placements if isinstance(e, DTensor) else (Replicate(),)
    h_pl = h.placements if isinstance(h, DTensor) else (Replicate(),)
    if e_pl != h_pl or isinstance(e, DTensor) != isinstance(h, DTensor):
        raise ValueError(
            f"tie_word_embeddings=True: the TP plan shards the input embedding as {e_pl} and the output head as "
            f"{h_pl}; a tied weight must be one parameter: plan them as 'embedding_rowwise' and "
            "'colwise_gather_output' (both Shard(0), the model's own plan), or untie them"
        )
    head.weight = e  # the same Parameter object: one gradient, one FSDP2 parameter, one checkpoint entry


# -- lowering: one table per plan-entry kind ----------------------------------------------------

# A bare-parameter entry's placement (or ``ndim -> placement``); None = keep it plain.
_PARAM_PLACEMENTS: dict[str, Callable[[str], Any]] = {
    **dict.fromkeys(_COLWISE, lambda name: lambda ndim: Shard(max(ndim - 2, 0))),
    **dict.fromkeys(_ROWWISE, lambda name: Replicate() if name == "bias" else (lambda ndim: Shard(ndim - 1))),
    "packed_colwise": lambda name: lambda ndim: _styles.packed_placement(ndim, -2),
    "packed_rowwise": lambda name: lambda ndim: Replicate() if ndim == 1 else _styles.packed_placement(ndim, -1),
    "embedding_rowwise": lambda name: Shard(0),
    "embedding_colwise": lambda name: Shard(1),
    "replicate": lambda name: None,
}


def _param_placement(style: str, fqn: str) -> Any:
    """A placement (or ``ndim -> placement``) for a bare-parameter plan entry; None = keep it plain."""
    lowering = _PARAM_PLACEMENTS.get(style)
    if lowering is None:
        raise NotImplementedError(
            f"TP style {style!r} on the bare parameter {fqn!r}: parameter entries take colwise*, rowwise*, "
            "packed_*, embedding_* or replicate; plan the owning module instead"
        )
    return lowering(fqn.rsplit(".", 1)[-1])


@dataclass(frozen=True)
class _Target:
    """What a module-entry lowering sees: the module, its FQN, the model, and the Linear styles to use."""

    fqn: str
    module: nn.Module
    model: nn.Module
    colwise: type
    rowwise: type


def _has_children(t: _Target) -> bool:
    # An embedding module with parametrised children (Inkling's normed embedding: lookup, then
    # `embed_norm`): torch's styles would register the child's `embed_norm.weight` on the module
    # (KeyError) and all-reduce / gather only AFTER the norm, i.e. norm the partial lookups.
    # Left replicated over tp: same input on every tp rank, so same output and gradient.
    return any(True for _ in t.module.children())


def _embedding_rowwise(t: _Target) -> ParallelStyle | None:
    # Shard(0) vocab rows; Partial -> Replicate (all-reduce) of the looked-up rows.
    return None if _has_children(t) else RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _embedding_colwise(t: _Target) -> ParallelStyle | None:
    # Shard(1) hidden; Shard(-1) -> Replicate (all-gather) of the looked-up rows.
    return None if _has_children(t) else ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _mla_kv_a_proj(t: _Target) -> ParallelStyle:
    config = getattr(t.model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    rope = getattr(text, "qk_rope_head_dim", None)
    if rope is None:
        raise ValueError(
            f"TP style 'mla_kv_a_proj' on {type(t.module).__name__} needs config.qk_rope_head_dim; set it in the "
            "model config or plan the module otherwise"
        )
    return _styles.MlaKvAProjParallel(int(rope))


def _packed_rowwise(t: _Target) -> ParallelStyle:
    return _styles.ParamPlacement({"*": lambda ndim: Replicate() if ndim == 1 else _styles.packed_placement(ndim, -1)})


# A module entry's torch ParallelStyle; None = leave the module as it is (replicated).
# See [Note: HF TP plan on the shardbridge mesh] and [Note: HF styles beyond colwise / rowwise].
_LOWERINGS: dict[str, Callable[[_Target], ParallelStyle | None]] = {
    "colwise": lambda t: t.colwise(),
    "rowwise": lambda t: t.rowwise(),
    # Shard(-1) output -> Replicate: full features on every TP rank (full logits: the HF loss runs unchanged).
    **dict.fromkeys(("colwise_gather_output", "colwise_rep"), lambda t: t.colwise(output_layouts=Replicate())),
    # A full (Replicate) input is split locally to Shard(-1); Partial -> Replicate output.
    **dict.fromkeys(("rowwise_split_input", "rowwise_rep"), lambda t: t.rowwise(input_layouts=Replicate())),
    "embedding_rowwise": _embedding_rowwise,
    "embedding_colwise": _embedding_colwise,
    # Gradients all-reduced iff the data flow makes them partial: [Note: partial gradients over tp].
    "replicated_with_grad_allreduce": lambda t: ReplicatedGradParallel(t.fqn),
    "sequence_parallel": lambda t: SequenceParallel(use_local_output=True),
    "packed_colwise": lambda t: _styles.PackedColwiseParallel(),
    "packed_rowwise": _packed_rowwise,
    "moe_tp_experts": lambda t: _styles.MoeExpertsParallel(),
    "moe_identity_expert": lambda t: _styles.MoeIdentityParallel(),
    "local_params": lambda t: _styles.LocalParamsForward(),
    "all_reduce": lambda t: _styles.AllReduceOutput(),
    "mla_kv_a_proj": _mla_kv_a_proj,
    "replicate": lambda t: None,
}


def _lower(
    style: Any, fqn: str, model: nn.Module, float8_styles: Mapping[str, type] | None
) -> ParallelStyle | None:
    if isinstance(style, ParallelStyle):
        return style
    module = model.get_submodule(fqn)
    _check_style(style, type(module).__name__)
    # Exactly the modules fp8.convert converted take the backend's styles (torchao tensorwise: Float8Linear;
    # mxfp8: nn.Linear with a wrapped weight); the rest, torch's.
    is_float8 = float8_styles is not None and fp8.converted_fqn(module) is not None
    target = _Target(
        fqn=fqn,
        module=module,
        model=model,
        colwise=float8_styles["colwise"] if is_float8 else ColwiseParallel,
        rowwise=float8_styles["rowwise"] if is_float8 else _styles.RowwiseOwnOutput,
    )
    return _LOWERINGS[style](target)


#: The transformers plan styles this adapter lowers (see [Note: HF TP plan on the shardbridge mesh]).
SUPPORTED_STYLES: tuple[str, ...] = tuple(_LOWERINGS)
