"""The TE + FSDP2 call order, done for the user: meta -> set_device_mesh -> fully_shard -> materialize.

[Note: TE lifecycle]
~~~~~~~~~~~~~~~~~~~~
FP8 parameters (``quantized_model_init``) are quantized in TE's ``reset_parameters``, and the
quantizer needs the final local shard and the amax group, so the order is fixed (TE PR #2713)::

    with torch.device("meta"): model = build()      no memory, no kernels
    set_device_mesh(model, mesh)                     TP DTensors (meta), amax group, TP group
    apply_fsdp(model, mesh, policy, units)           FSDP2 shards the (meta) DTensors
    materialize(model, mesh)                         to_empty(device) -> init each local shard
                                                      -> quantize FP8 weights (weight-mesh amax)
                                                      -> FSDP2 re-reads swapped parameters

TE 2.x's own ``reset_parameters`` materializes on a hard-coded ``device="cuda"`` and takes
the amax group from a mesh axis that must be named "shard"; :func:`materialize` replaces it
(plan entry ``reset_parameters`` in ``shardbridge_te._patches``; TE's method is not called). Values are initialized on each
rank's LOCAL shard with TE's ``init_method`` (TE's behaviour), so they depend on the layout;
load a checkpoint for layout-independent values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from shardbridge import FSDPUnit, ParallelMesh, PrecisionPolicy, apply_fsdp
from shardbridge import fp8 as shardbridge_fp8
from shardbridge._compat import local_tensor, reset_sharded_params
from shardbridge.fp8 import FP8Recipe
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from shardbridge_te._apply import set_device_mesh, te_modules
from shardbridge_te._compat import te_pytorch, te_version
from shardbridge_te._experts import expert_state
from shardbridge_te._patches import gate

__all__ = ["default_units", "materialize", "parallelize"]


def default_units(model: nn.Module) -> list[nn.Module]:
    """The outermost TE modules below the root, in model order: one FSDP unit each.

    A TransformerLayer is one unit; its LayerNormLinear/LayerNormMLP are not units of their own.
    GroupedLinear experts marked by :func:`~shardbridge_te.shard_grouped_experts` are not
    listed: their experts module is already a unit over ``efsdp``.
    """
    units: list[nn.Module] = []
    unit_names: list[str] = []
    for fqn, module, _kind in te_modules(model):
        if module is model or any(fqn.startswith(f"{u}.") for u in unit_names):
            continue
        if expert_state(module) is not None:
            continue  # sharded over efsdp by shard_grouped_experts
        if any(p is not None for p in module.parameters()):
            units.append(module)
            unit_names.append(fqn)
    return units


def _meta_params(model: nn.Module) -> dict[int, set[str]]:
    """``{id(module): names of its own parameters still on meta}``: what materialize initializes."""
    out: dict[int, set[str]] = {}
    for module in model.modules():
        names = {
            name
            for name, p in module._parameters.items()
            if p is not None and (local_tensor(p) if isinstance(p, DTensor) else p).is_meta
        }
        if names:
            out[id(module)] = names
    return out


def _init_te_module(module: nn.Module, names: set[str], device: torch.device) -> bool:
    """Initialize ``names`` of one TE module in place, quantizing FP8 weights; True if any was swapped."""
    swapped = False
    for name, param in list(module.named_parameters(recurse=False)):
        meta = getattr(module, "param_init_meta", {}).get(name)
        if meta is None or name not in names:
            continue
        local = local_tensor(param) if isinstance(param, DTensor) else param
        with torch.no_grad():
            tracker = meta.get_rng_state_tracker
            if tracker is not None and device.type == "cuda":
                name_ = getattr(module, "rng_tracker_name", None)
                with tracker().fork(name_) if name_ else tracker().fork():
                    meta.init_fn(local)
            else:
                meta.init_fn(local)
        if getattr(module, "primary_weights_in_fp8", False) and meta.fp8_meta_index is not None:
            _quantize_param(module, name, param, meta.fp8_meta_index)
            swapped = True
    return swapped


def _quantize_param(module: nn.Module, name: str, param: nn.Parameter, index: int) -> None:
    """TE's reset_parameters quantization step, with the weight-mesh amax group (GPU-only path)."""
    te = te_pytorch()
    group = getattr(module, "_shardbridge_amax_group", None)
    quantizer = module.quantizers["scaling_fwd"][index]
    if quantizer is None:
        raise RuntimeError(f"{type(module).__name__}.{name}: weight quantizer not initialized (quantized_model_init?)")
    quantizer.set_usage(rowwise=True, columnwise=torch.is_grad_enabled())
    quantizer.internal = False
    current = tuple(getattr(te, n) for n in ("Float8CurrentScalingQuantizer", "NVFP4Quantizer") if hasattr(te, n))
    if group is not None and current and isinstance(quantizer, current):
        quantizer.amax_reduction_group = group  # the weight mesh, whatever its axes are named
        quantizer.with_amax_reduction = True
    local = local_tensor(param) if isinstance(param, DTensor) else param
    quantized = quantizer(local)
    if group is not None:
        quantized._shardbridge_amax_group = group  # kept through FSDP all-gathers (_patches)
        if current and isinstance(quantizer, current):
            quantized.amax_reduction_group = group
    if isinstance(param, DTensor):
        quantized = DTensor.from_local(
            quantized, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    module.module_setattr(name, nn.Parameter(quantized, requires_grad=param.requires_grad))


def _refresh_fsdp_params(model: nn.Module) -> None:
    # FSDP2 keeps a reference to each sharded parameter; after a swap it must re-read (and
    # re-pad) them, as its own _apply does (private FSDP2 API: shardbridge._compat).
    for module in model.modules():
        if isinstance(module, FSDPModule):
            reset_sharded_params(module)


def materialize(model: nn.Module, mesh: ParallelMesh, *, device: torch.device | str | None = None) -> nn.Module:
    """Allocate meta parameters on ``device`` and initialize them; FP8 weights get quantized.

    Call after :func:`set_device_mesh` and ``apply_fsdp``. See [Note: TE lifecycle]. Only
    parameters still on ``meta`` are touched: a model built on a real device (or with loaded
    weights) keeps its values, so calling this twice is harmless.

    Args:
        model: the model (any mix of TE and torch modules).
        mesh: the run's mesh (its device type is the default ``device``).
        device: where parameters live; None = ``mesh["weight"].device_type`` (``"cuda"`` ->
            the current CUDA device).

    Returns:
        ``model``.

    Example:
        >>> materialize(model, pm)  # doctest: +SKIP
    """
    # Plan entry reset_parameters: replaces TE's method by reading TE internals
    # (param_init_meta, quantizers); RuntimeError outside the TE versions it was checked against.
    gate("reset_parameters", te_version())
    if device is None:
        device = mesh["weight"].device_type
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_meta = _meta_params(model)  # only these are initialized: real (loaded) values are kept
    if on_meta:
        model.to_empty(device=device)  # FSDPModule._apply re-reads its sharded params
    base = te_pytorch().module.base.TransformerEngineBaseModule
    swapped = False
    for module in model.modules():
        names = on_meta.get(id(module))
        if not names:
            continue
        if isinstance(module, base):
            swapped |= _init_te_module(module, names, device)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()  # TE LayerNorm/RMSNorm (ops) and torch modules: in place
    if swapped:
        _refresh_fsdp_params(model)
    return model


def parallelize(
    model: nn.Module,
    mesh: ParallelMesh,
    policy: PrecisionPolicy | None = None,
    *,
    fp8: FP8Recipe | None = None,
    units: Sequence[FSDPUnit] | None = None,
    global_shapes: Mapping[str, Sequence[int]] | None = None,
    device: torch.device | str | None = None,
    reshard_after_forward: bool | Literal["default"] = "default",
    cp_comm_type: str = "p2p",
    **fsdp_kwargs: Any,
) -> nn.Module:
    """The whole lifecycle in one call: TP DTensors + amax group, cp group, FSDP2 units, materialize.

    Args:
        model: built with TE modules, ideally on ``torch.device("meta")``.
        mesh: the run's :class:`~shardbridge.ParallelMesh`.
        policy: mixed precision for FSDP2 (None = no casting).
        fp8: a TE recipe (``FP8Recipe(backend="te", ...)``; build the model in
            :func:`~shardbridge_te.model_init_context` for FP8 parameters): forward then runs under
            ``te.autocast`` with it and the ``weight`` mesh as amax group (the model is converted
            with ``shardbridge.fp8.convert``, which swaps nothing in a model of TE modules); other
            backends are refused by name. None = no FP8.
        units: FSDP units; None = :func:`default_units` (each outermost TE module).
        global_shapes: see :func:`set_device_mesh` (uneven TP pieces).
        device: see :func:`materialize`.
        reshard_after_forward: passed to :func:`shardbridge.apply_fsdp`.
        cp_comm_type: with cp > 1, TE's context-parallel communication (see
            :func:`~shardbridge_te.set_context_parallel`; call that for ``a2a+p2p``).
        **fsdp_kwargs: passed to :func:`shardbridge.apply_fsdp`.

    Returns:
        ``model``, wrapped in place.

    Example:
        >>> pm = ParallelDims(dp_shard=-1, tp=2).build_mesh("cuda")  # doctest: +SKIP
        >>> with torch.device("meta"), te.quantized_model_init(recipe=Float8CurrentScaling()):  # doctest: +SKIP
        ...     model = MyTEModel(tp_size=2)
        >>> parallelize(model, pm, PrecisionPolicy.bf16())  # doctest: +SKIP
    """
    if fp8 is not None:
        from shardbridge_te._fp8 import TEBackend

        if not isinstance(shardbridge_fp8.get_backend(fp8.backend), TEBackend):
            raise NotImplementedError(
                f"fp8={fp8}: shardbridge_te.parallelize runs TransformerEngine modules, whose FP8 is "
                "TE's: use FP8Recipe(backend='te', name=...) (build the model in "
                "shardbridge_te.model_init_context(recipe) for FP8 parameters); torchao recipes run on nn.Linear "
                "models (shardbridge.fp8.convert + apply_fsdp, or shardbridge_hf)"
            )
    set_device_mesh(model, mesh, global_shapes=global_shapes)
    if fp8 is not None:
        # The model is TE modules already: nothing to swap; this records the recipe, registers TE's
        # FP8 tensors for checkpoints and runs forward under te.autocast over the weight mesh.
        shardbridge_fp8.convert(model, fp8, mesh=mesh, module_filter=lambda module, fqn: False)
    if mesh.dims.cp > 1:
        from shardbridge_te._cp import set_context_parallel

        set_context_parallel(model, mesh, cp_comm_type=cp_comm_type)  # FSDP below: over dp_shard_cp
    apply_fsdp(
        model,
        mesh,
        policy,
        units=default_units(model) if units is None else units,
        reshard_after_forward=reshard_after_forward,
        **fsdp_kwargs,
    )
    return materialize(model, mesh, device=device)
