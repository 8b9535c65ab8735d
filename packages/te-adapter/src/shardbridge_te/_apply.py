"""``set_device_mesh``: DTensor TP parameters and the amax group for every TE module of a model.

The released-TE equivalent of TE PR #2713's per-module ``set_device_mesh(tp_mesh,
weight_mesh)``, applied to a whole model in one call. See [Note: TE placement table] for the
placements and [Note: why patch at all] for the patch list.

[Note: local forward]
~~~~~~~~~~~~~~~~~~~~~
TE's kernels take plain tensors. While a converted module's ``forward`` runs, each DTensor
parameter in ``module._parameters`` is swapped for ``local_view(param)`` (its local tensor,
``requires_grad`` kept, gradient re-wrapped as a DTensor with the parameter's placements), and
swapped back afterwards, also when forward raises::

    FSDP2 pre-forward   all-gather over dp -> module.weight = DTensor(tp)   (FSDP registers it)
    our forward         module._parameters["weight"] = local tensor         (TE sees a Tensor)
      TE forward ...
    finally             module._parameters["weight"] = DTensor(tp)
    backward            grad(local) -> DTensor grad (placements of weight) -> FSDP reduce-scatter

FSDP2's own hooks run outside ``forward`` (``__call__``), so they always see the DTensor.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from shardbridge import ParallelMesh
from shardbridge.fused import FusedSpec, register_fused
from shardbridge.tp import TPMode, local_view, to_dtensor_param
from torch import nn
from torch.distributed.tensor import DTensor

from shardbridge_te._compat import te_pytorch, te_version
from shardbridge_te._patches import apply_float8_pre_all_gather, gate, keep_instance_undo, patch_attr
from shardbridge_te._placements import CONTAINER_KINDS, EXPERT_ATTR, MODULE_KINDS, tp_modes

__all__ = ["STATE_ATTR", "TEModuleState", "module_kind", "set_device_mesh", "te_modules"]

STATE_ATTR = "_shardbridge_te"
"""Attribute on each converted TE module holding its :class:`TEModuleState`."""

GATED_ACTIVATIONS = frozenset({"geglu", "qgeglu", "reglu", "sreglu", "swiglu", "clamped_swiglu", "glu"})
"""LayerNormMLP activations whose fc1 holds two halves (TE splits fc1's output in two)."""


@dataclass(frozen=True, kw_only=True)
class TEModuleState:
    """What :func:`set_device_mesh` did to one TE module."""

    kind: str
    """TE class name the placement rule came from (see [Note: TE placement table])."""
    modes: Mapping[str, TPMode]
    """TP mode of each parameter."""
    global_shapes: Mapping[str, tuple[int, ...]]
    """Global shape of each parameter."""
    amax_group: Any
    """Process group of the ``weight`` mesh: amax reduction for per-tensor current scaling."""


def _te_classes() -> dict[str, type]:
    te = te_pytorch()
    return {name: getattr(te, name) for name in (*MODULE_KINDS, *CONTAINER_KINDS) if hasattr(te, name)}


def module_kind(module: nn.Module, classes: Mapping[str, type] | None = None) -> str | None:
    """The TE kind of ``module`` (its class or a TE base class name), or None for non-TE modules."""
    classes = _te_classes() if classes is None else classes
    for cls in type(module).__mro__:
        if cls.__name__ in classes and classes[cls.__name__] is cls:
            return cls.__name__
    return None


def te_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """``(fqn, module, kind)`` of every TE module of ``model`` (containers included), in order."""
    classes = _te_classes()
    return [(fqn, m, kind) for fqn, m in model.named_modules() if (kind := module_kind(m, classes)) is not None]


def _check_global_shapes(model: nn.Module, global_shapes: Mapping[str, Sequence[int]]) -> None:
    params = dict(model.named_parameters())
    unknown = sorted(set(global_shapes) - set(params))
    if unknown:
        raise ValueError(
            f"global_shapes names {unknown}, which are not parameters of the model; use parameter FQNs "
            f"such as {list(params)[:3]}"
        )


def _global_shape(local: nn.Parameter, mode: TPMode, tp: int, override: Sequence[int] | None) -> tuple[int, ...]:
    if override is not None:
        return tuple(int(s) for s in override)
    shape = list(local.shape)
    if mode is TPMode.COLUMN:
        shape[0] *= tp
    elif mode is TPMode.ROW:
        shape[1] *= tp
    return tuple(shape)


def _local_forward(module: nn.Module, names: Sequence[str]) -> None:
    """Wrap ``module.forward`` so TE sees local tensors. See [Note: local forward].

    Patch ``local_forward``: an instance attribute; its undo is kept on the module
    (``shardbridge_te._patches.unpatch(model)``).
    """
    if getattr(module.forward, "_shardbridge_local_forward", False):
        return
    original = module.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        saved = {}
        for name in names:
            param = module._parameters.get(name)
            if isinstance(param, DTensor):
                saved[name] = param
                # DTensor(tp) -> local tensor; grad: local -> DTensor with param.placements
                module._parameters[name] = local_view(param)
        try:
            return original(*args, **kwargs)
        finally:
            module._parameters.update(saved)

    forward._shardbridge_local_forward = True  # type: ignore[attr-defined]
    keep_instance_undo(module, "local_forward", patch_attr(module, "forward", forward))


def _register_gated_fc1(module: nn.Module, fc1_global_rows: int) -> None:
    """LayerNormMLP with a gated activation: fc1 is [act-half; linear-half] per TP rank."""
    act = str(getattr(module, "activation", "")).lower()
    if act not in GATED_ACTIVATIONS:
        return
    size = fc1_global_rows // 2  # global size of each half
    register_fused(module, "fc1_weight", FusedSpec.nway({"fc1_gate_weight": size, "fc1_up_weight": size}))
    if getattr(module, "fc1_bias", None) is not None and module.fc1_bias.numel():
        register_fused(module, "fc1_bias", FusedSpec.nway({"fc1_gate_bias": size, "fc1_up_bias": size}))


def _convert_module(
    fqn: str,
    module: nn.Module,
    kind: str,
    mesh: ParallelMesh,
    overrides: Mapping[str, Sequence[int]],
    amax_group: Any,
    local_forward: bool,
) -> TEModuleState:
    tp = mesh.dims.tp
    module_tp = int(getattr(module, "tp_size", 1) or 1)
    names = [n for n, p in module._parameters.items() if p is not None]
    tp_sharded = module_tp > 1 or bool(overrides)
    if module_tp > 1 and module_tp != tp:
        raise ValueError(
            f"{fqn or 'model'} ({kind}) was built with tp_size={module_tp} but the mesh has tp={tp}; "
            f"build TE modules with tp_size=mesh.dims.tp ({tp})"
        )
    parallel_mode = (
        getattr(module, "parallel_mode", None) if kind not in ("LayerNormMLP", "DotProductAttention") else None
    )
    modes = tp_modes(kind, parallel_mode, tp_sharded, names)
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        local = module._parameters[name]
        if isinstance(local, DTensor):
            raise ValueError(f"{fqn}.{name} is already a DTensor; call set_device_mesh once per model")
        shapes[name] = _global_shape(local, modes[name], tp, overrides.get(name))
        if tp > 1:
            # plain local shard -> DTensor on tp with the mode's placement, explicit global shape
            setattr(module, name, to_dtensor_param(local, mesh["tp"], modes[name], global_shape=shapes[name]))
    if tp_sharded and tp > 1:
        if overrides:
            module.tp_size = tp  # built with this rank's (uneven) local size and tp_size=1
        if hasattr(module, "set_tensor_parallel_group"):
            module.set_tensor_parallel_group(mesh["tp"].get_group())
    if kind == "LayerNormMLP" and tp_sharded:
        _register_gated_fc1(module, shapes["fc1_weight"][0])
    if tp > 1 and local_forward:
        _local_forward(module, names)
    module._shardbridge_amax_group = amax_group
    return TEModuleState(kind=kind, modes=modes, global_shapes=shapes, amax_group=amax_group)


def set_device_mesh(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    global_shapes: Mapping[str, Sequence[int]] | None = None,
) -> nn.Module:
    """Give every TE module of ``model`` DTensor TP parameters and the ``weight`` amax group.

    Call after constructing the model (on ``meta`` or a real device) and before
    :func:`shardbridge.apply_fsdp`. For each Linear, LayerNormLinear, LayerNormMLP, LayerNorm,
    RMSNorm, DotProductAttention and GroupedLinear (also inside MultiheadAttention and
    TransformerLayer):

    * parameters become DTensors on ``mesh["tp"]`` with placements from the module's
      ``parallel_mode`` (see [Note: TE placement table]) and an explicit global shape;
    * the module gets the TP process group, its forward sees local tensors
      (see [Note: local forward]);
    * ``mesh["weight"]`` (every rank holding a different piece of a weight; no axis needs a
      particular name) becomes the amax-reduction group for FP8 current scaling;
    * ``_extra_state`` becomes DCP-loadable (TE #1860), see ``shardbridge_te._checkpoint``.

    GroupedLinear experts marked by :func:`~shardbridge_te.shard_grouped_experts` are left
    alone (they are on the ``ep`` axis, not tensor-parallel).

    With ``mesh.dims.tp == 1`` parameters stay plain tensors (FSDP2 shards them as they are).

    Args:
        model: a model containing TE modules built with ``tp_size=mesh.dims.tp`` (or 1).
        mesh: the run's :class:`~shardbridge.ParallelMesh`.
        global_shapes: ``{param_fqn: global_shape}`` for modules built with this rank's own,
            possibly uneven, ``torch.chunk`` size and ``tp_size=1`` (TE 2.x itself refuses
            sizes not divisible by tp). Such a module is treated as split by its
            ``parallel_mode`` and given ``tp_size=mesh.dims.tp`` and the TP group.

    Returns:
        ``model``, changed in place.

    Raises:
        ValueError: a module built for another tp size, unknown ``global_shapes`` names, a
            local shape that is not this rank's piece of its global shape, or a second call.

    Example:
        >>> pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cuda")  # doctest: +SKIP
        >>> with torch.device("meta"):  # doctest: +SKIP
        ...     layer = te.TransformerLayer(1024, 4096, 16, tp_size=2, set_parallel_mode=True)
        >>> set_device_mesh(layer, pm)  # doctest: +SKIP
        >>> layer.layernorm_mlp.fc1_weight.placements  # doctest: +SKIP
        (Shard(dim=0),)
    """
    version = te_version()
    # Every patch site asks its gate (shardbridge_te._patches): error or warn + skip outside
    # the TE versions it was checked against.
    if not gate("dtensor_params", version):
        raise NotImplementedError(
            f"TransformerEngine {'.'.join(map(str, version))} makes TP parameters DTensors itself; "
            "use TE's own set_device_mesh (TE PR #2713) instead of shardbridge_te.set_device_mesh"
        )
    local_forward = gate("local_forward", version)
    float8_amax_group = gate("float8_pre_all_gather_amax_group", version)
    portable_extra_state = gate("portable_extra_state", version)
    global_shapes = dict(global_shapes or {})
    _check_global_shapes(model, global_shapes)
    from shardbridge_te._checkpoint import install_portable_extra_state, register_te_fp8_types

    register_te_fp8_types()
    te = te_pytorch()
    if float8_amax_group and hasattr(te, "Float8Tensor"):
        apply_float8_pre_all_gather(te.Float8Tensor)  # undo kept: shardbridge_te.unpatch()
    amax_group = mesh["weight"].get_group() if dist.is_initialized() else None
    base = getattr(te_pytorch().module.base, "TransformerEngineBaseModule", None)
    for fqn, module, kind in te_modules(model):
        if kind in CONTAINER_KINDS or getattr(module, EXPERT_ATTR, None) is not None:
            continue  # experts on the ep axis are not tensor-parallel: [Note: GroupedLinear experts]
        prefix = f"{fqn}." if fqn else ""
        overrides = {
            k[len(prefix) :]: v
            for k, v in global_shapes.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        state = _convert_module(fqn, module, kind, mesh, overrides, amax_group, local_forward)
        setattr(module, STATE_ATTR, state)
        if portable_extra_state and base is not None and isinstance(module, base):
            install_portable_extra_state(module)
    return model
