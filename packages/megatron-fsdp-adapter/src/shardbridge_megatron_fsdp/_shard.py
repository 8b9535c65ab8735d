"""``shard_model``: Megatron-FSDP over a shardbridge ParallelMesh, with upstream traps removed.

[Note: what shard_model handles]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``megatron_fsdp.fully_shard(module, optimizer, ...)`` in 0.6.1 has side effects users trip on;
``shard_model`` removes them or refuses the configuration up front::

    upstream behaviour                                   shard_model
    fully_shard_optimizer runs optimizer.step() on      runs it with lr=0, weight_decay=0 and resets
                                                          "step" to 0:
      zero grads (AdamW: weight decay moves the           weights, moments and bias correction are
      weights, Adam's step becomes 1)                     those of a fresh optimizer
    fully_shard rebuilds param_groups as ONE group       rebuilds the user's groups (hyperparameters
      (custom groups, e.g. no weight decay, lost)         per group) over the distributed params
    compute dtype = the module's dtype at wrap time      casts to policy.param_dtype, then writes the
      (main weights start from bf16-rounded values)       full-precision originals into the main weights
    after dcp.load, model.load_state_dict is needed      shardbridge_megatron_fsdp.load does it
    average_in_collective=True without an expert mesh    ValueError (upstream: crash dividing by the
                                                          size of a None group)
    TP DTensor params with Shard(1) (row-parallel):      the TP patch (_tp_patch.py): local slices
      local slices viewed as (-1, *global_shape[1:]);     viewed with the TP-local shape; gradients
      no_shard x TP: "Mismatch between param shape";      redistributed to the parameter's placements
      vocab-parallel embedding: Replicate gradient        (see [Note: TP DTensor parameters in
      copied into a TP-local slot (size mismatch)         Megatron-FSDP])
    gloo has no PREMUL_SUM                               gradient_reduce_div_fusion=False on gloo
    optim_grads_params without FSDP units:               ValueError naming unit_modules
      ZeroDivisionError in fully_shard_model
    auto-sync: a 2nd backward before zero_grad re-       RuntimeError in the configurations where
      reduces reduced gradients in place (HSDP or         it is wrong; microbatches(model, n) for
      strategy "optim": silently wrong gradients)         accumulation (exact)
    HSDP outer_strategy="optim": the inner-DP gradient   copies the main gradient buffer's 1/dp
      helper buffer is built without the 1/dp scaling     factor onto the helper buffer (see
      factor, so gradients are SUMMED over dp (x dp)      [Note: HFSDP gradient scaling])
    CUDA-only calls                                      the CPU patch (_cpu_patch.py), CPU only
    fully_shard_model has no fp8_param_gather argument   the model's FP8 recipe (TE FP8 parameters,
                                                          GPU) goes into its DistributedDataParallelConfig
                                                          (see [Note: FP8 under Megatron-FSDP])

Meshes: the ParallelMesh's full 4-D mesh is handed over with ``dp_shard_dim="dp_shard"``,
``tp_dim="tp"`` and, for HSDP, ``dp_outer_dim="dp_replicate"`` plus the flattened ``dp`` group
as ``hybrid_fsdp_group``. With cp > 1 Megatron-FSDP shards over the flattened
``dp_shard_cp`` (its documented DP x CP use, ``dp_shard_dim``), the HSDP group is ``dp_cp``, and
the model's attention spans ``cp`` (``model.set_context_parallel(pm["cp"])``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from shardbridge import ParallelMesh, PrecisionPolicy, fp8, param_group_fqns, rebind_param_groups
from torch import distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardbridge_megatron_fsdp import _tp_patch
from shardbridge_megatron_fsdp._accumulate import accumulation_is_wrong, install_guard
from shardbridge_megatron_fsdp._compat import (
    STRATEGIES,
    disable_grad_div_fusion,
    fully_shard_model,
    install_distributed_params,
    is_fp8_parameter,
    parameter_groups,
    raw_parameters,
    require_megatron_fsdp,
)
from shardbridge_megatron_fsdp._optimizer import zero_step

__all__ = ["OUTER_STRATEGIES", "STRATEGIES", "shard_model"]

OUTER_STRATEGIES: tuple[str, ...] = ("no_shard", "optim")
"""HSDP strategies over ``dp_replicate``: replicate, or also shard the optimizer state."""


def _strategy(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(allowed):
        return allowed[value]
    if value in allowed:
        return str(value)
    raise ValueError(
        f"{name}={value!r} is not a Megatron-FSDP strategy; choose one of {list(allowed)} (or 0..{len(allowed) - 1})"
    )


def _validate(
    model: nn.Module, pm: ParallelMesh, strategy: str, outer_strategy: str | None, average_in_collective: bool
) -> str | None:
    if not isinstance(pm, ParallelMesh):
        raise ValueError(
            f"mesh must be a shardbridge.ParallelMesh (ParallelDims(...).build_mesh(device)), got {type(pm).__name__}"
        )
    dims = pm.dims
    if dims.cp > 1 and not callable(getattr(model, "set_context_parallel", None)):
        raise NotImplementedError(
            f"cp={dims.cp}: {type(model).__name__} has no set_context_parallel(cp_mesh), so its attention cannot "
            "span the cp axis (shardbridge.models.Llama has one, over shardbridge.cp.cp_attention); use cp=1"
        )
    if average_in_collective:
        raise ValueError(
            "average_in_collective=True needs an expert-parallel mesh in megatron-fsdp 0.6.1 (it divides by "
            "the expert data-parallel group size, which is None without one, and crashes); set "
            "average_in_collective=False: gradients are then scaled by 1/dp before a SUM reduction (same result)"
        )
    if dims.dp_replicate == 1:
        if outer_strategy is not None:
            raise ValueError(
                f"outer_strategy={outer_strategy!r} needs HSDP (dp_replicate > 1), but dp_replicate=1; "
                "set outer_strategy=None or build the mesh with dp_replicate > 1"
            )
    else:
        outer_strategy = _strategy("outer_strategy", outer_strategy or "no_shard", OUTER_STRATEGIES)
        if outer_strategy == "optim" and strategy != "optim_grads_params":
            raise ValueError(
                f"outer_strategy='optim' shards the optimizer over dp_replicate and needs "
                f"strategy='optim_grads_params' over dp_shard, got strategy={strategy!r}; set "
                "strategy='optim_grads_params' or outer_strategy='no_shard'"
            )
    for fqn, param in model.named_parameters():
        stride = getattr(param, "partition_stride", 1)
        if _tp_patch.megatron_partition_dim(param) is not None and stride != 1:
            raise NotImplementedError(
                f"parameter {fqn!r} is a Megatron-style TP parameter with partition_stride={stride}; "
                "Megatron-FSDP describes TP pieces as contiguous (partition_stride=1) only"
            )
        if not isinstance(param, DTensor):
            continue
        if param.device_mesh.mesh_dim_names != ("tp",):
            raise ValueError(
                f"parameter {fqn!r} is a DTensor on mesh {param.device_mesh.mesh_dim_names}; before shard_model "
                "parameters may only be tensor-parallel, on mesh['tp'] of the same ParallelMesh"
            )
        (placement,) = param.placements
        if type(placement) not in (Shard, Replicate):
            raise NotImplementedError(
                f"parameter {fqn!r} is a TP DTensor with placement {placement!r}; shard_model takes TP parameters "
                "placed Shard(d) (column-parallel d=0, row-parallel d=1) or Replicate() on mesh['tp']"
            )
    return outer_strategy


@contextlib.contextmanager
def _quiet_device_warning(active: bool) -> Iterator[None]:
    # MegatronFSDP.__init__ warns that "cpu" is not "cuda:<current_device>" on every rank; on a
    # CPU run that is the intent, not a misconfiguration.
    logger = logging.getLogger("megatron_fsdp.megatron_fsdp")
    old = logger.level
    if active:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _fix_hfsdp_gradient_scaling(wrapped: nn.Module) -> int:
    """Give every HFSDP gradient helper buffer its main gradient buffer's scaling factor.

    [Note: HFSDP gradient scaling]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    With ``outer_dp_sharding_strategy="optim"`` (HFSDP), megatron-fsdp 0.6.1 reduces gradients
    through ``ParamGroup.hfsdp_helper_gbuf``, created by ``_create_hfsdp_helper_buffer`` from
    the main gradient buffer, which copies everything except ``gradient_scaling_factor``
    (None). ``gradient_reduce_preprocessing`` then skips the 1/dp pre-scale and the inner
    reduce-scatter and the outer reduce-scatter both SUM: every gradient the optimizer sees
    is dp_replicate * dp_shard times the mean (exactly 4.0 on 2 x 2, measured per parameter).
    Adam hides it (scale-invariant up to eps); SGD, gradient clipping and anything
    gradient-norm based do not. Plain HSDP (outer "no_shard") reduces through the main
    gradient buffer and is right. Setting the helper's factor to the main buffer's
    (1/dp world size, or None with per-token loss) makes the inner reduce-scatter pre-scale,
    as every other path does; the outer reduction is already a plain SUM (AVG only with
    average_in_collective, which shard_model refuses).

    Returns:
        How many helper buffers were fixed (0 without HFSDP, or once upstream copies it).
    """
    fixed = 0
    for group in parameter_groups(wrapped):
        helper = getattr(group, "hfsdp_helper_gbuf", None)
        main = group.main_grad_buffer
        if helper is None or main is None or helper.gradient_scaling_factor == main.gradient_scaling_factor:
            continue
        helper.gradient_scaling_factor = main.gradient_scaling_factor
        fixed += 1
    return fixed


def _full_values(model: nn.Module, pm: ParallelMesh) -> dict[str, torch.Tensor]:
    """Full-precision global values by FQN (item coordinates for TP DTensors).

    Megatron-style TP parameters (plain local tensors with ``partition_dim``) are all-gathered
    over ``tp``: a collective, run for the same parameters in the same order on every rank.
    """
    out = {}
    with torch.no_grad():
        for fqn, p in model.named_parameters():
            dim = _tp_patch.megatron_partition_dim(p)
            if isinstance(p, DTensor):
                out[fqn] = p.full_tensor().clone()
            elif dim is not None and pm.dims.tp > 1:
                # plain TP-local piece -> Shard(dim) on tp -> global (Megatron's even split)
                out[fqn] = DTensor.from_local(p.detach(), pm["tp"], [Shard(dim)], run_check=False).full_tensor()
            else:
                out[fqn] = p.detach().clone()
    return out


def shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    mesh: ParallelMesh,
    policy: PrecisionPolicy | None = None,
    *,
    strategy: str | int = "optim_grads_params",
    outer_strategy: str | int | None = None,
    unit_modules: Sequence[type[nn.Module]] | None = None,
    average_in_collective: bool = False,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Shard ``model`` (and its optimizer) with Megatron-FSDP over a shardbridge mesh.

    Call on every rank with the same arguments, on a model whose parameters are equal on
    every rank (tensor-parallel ones already DTensors on ``mesh["tp"]``: ``Shard(0)``
    column-parallel, ``Shard(1)`` row-parallel, or ``Replicate()``) and
    an optimizer built over ``model.parameters()`` (any param groups). See
    [Note: what shard_model handles] for what differs from ``megatron_fsdp.fully_shard``.

    Args:
        model: the module to shard (in ``policy.main_params_dtype``, usually fp32).
        optimizer: its optimizer, or None (then only the model is sharded).
        mesh: the run's :class:`~shardbridge.ParallelMesh`; with cp > 1 the model needs
            ``set_context_parallel`` (called here).
        policy: mixed precision (see ``_precision.py``); None = fp32. FP8 is the model's
            conversion (``shardbridge.fp8.convert(model, recipe, mesh=mesh)`` before this call):
            on a GPU, TE FP8 parameters (``FP8Recipe(backend="te", fp8_params=True)``, TE modules
            built under ``shardbridge_te.model_init_context``, ``param_dtype=None``), all-gathered
            with ``fp8_param_gather``; see [Note: FP8 under Megatron-FSDP].
        strategy: what is sharded over ``dp_shard``: one of :data:`STRATEGIES` or 0..3.
        outer_strategy: HSDP over ``dp_replicate`` (dp_replicate > 1 only): "no_shard"
            (default) or "optim" (needs strategy "optim_grads_params"). None = no HSDP.
        unit_modules: module classes that become FSDP units; None = the classes of
            ``model.layers`` entries when the model has ``layers``, else none (one unit).
        average_in_collective: must be False (see the error it raises).

    Returns:
        ``(MegatronFSDP module, optimizer)``; the optimizer is the same object, now over the
        distributed parameters. Train with ``loss.backward(); optimizer.step();
        optimizer.zero_grad()``. Gradients are reduced and attached after every backward
        (``sync_model_each_microbatch=True``). For several backwards per step run each in a
        context of :func:`~shardbridge_megatron_fsdp.microbatches`; where the plain loop
        would give wrong gradients (HSDP, or strategy "optim") a second backward
        before ``optimizer.zero_grad()`` raises a RuntimeError saying so
        (see [Note: accumulation under auto-sync]).

    Raises:
        ValueError / NotImplementedError: configurations megatron-fsdp 0.6.1 cannot run
            (named with the fix), among them an FP8 model on CPU or with ``fp8_params=False``
            (every torchao recipe).

    Example:
        >>> pm = ParallelDims(dp_shard=-1).build_mesh("cpu")  # doctest: +SKIP
        >>> model = Llama(LlamaConfig.tiny())  # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> model, opt = shard_model(model, opt, pm, PrecisionPolicy.bf16())  # doctest: +SKIP
    """
    from shardbridge_megatron_fsdp import _cpu_patch
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from shardbridge_megatron_fsdp._precision import fp8_ddp_kwargs, to_megatron_policy

    policy = PrecisionPolicy.fp32() if policy is None else policy
    strategy = _strategy("strategy", strategy, STRATEGIES)
    outer_strategy = _validate(model, mesh, strategy, outer_strategy, average_in_collective)
    # FP8: the model's conversion, as DistributedDataParallelConfig keywords (GPU only; refused by name otherwise).
    ddp_kwargs = fp8_ddp_kwargs(fp8.recipe_of(model), device_type=mesh.mesh.device_type)
    if ddp_kwargs:
        _check_fp8_model(model, policy)
    unit_modules = _unit_modules(model, unit_modules, strategy)
    if mesh.dims.cp > 1:
        model.set_context_parallel(mesh["cp"])  # attention over cp; params replicated over cp
    on_cpu = mesh.mesh.device_type == "cpu"
    patched = _cpu_patch.install(pin=True) if on_cpu else False
    if any(_tp_patch.is_tp_dtensor(p) for p in model.parameters()):
        # Row-parallel, no_shard x TP: see [Note: TP DTensor parameters in Megatron-FSDP]. Only
        # for TP DTensor models: the gate then refuses unchecked megatron-fsdp versions.
        _tp_patch.install(require_megatron_fsdp())
    # 1. Remember the optimizer's groups by FQN (fully_shard would merge them into one).
    group_fqns = None if optimizer is None else param_group_fqns(model, optimizer, when="shard_model")
    # 2. Compute dtype: Megatron-FSDP computes in the module's dtype at wrap time.
    originals = None
    if policy.param_dtype is not None:
        originals = _full_values(model, mesh)
        model.to(policy.param_dtype)
    # 3. Wrap, and fix what megatron-fsdp 0.6.1 gets wrong after wrapping.
    with _quiet_device_warning(patched):
        mp_policy = to_megatron_policy(policy)
        wrapped = _wrap(model, mesh, mp_policy, strategy, outer_strategy, unit_modules, on_cpu, ddp_kwargs)
    _after_wrap(wrapped, mesh, strategy, outer_strategy)
    params = dist_params(wrapped)
    # 4. Main weights from the full-precision originals (see [Note: Megatron-FSDP precision]).
    if originals is not None:
        _main_weights_from(wrapped, params, originals)
        del originals  # full copies: freed before the optimizer allocates its states
    if optimizer is None:
        return wrapped, None
    # 5. The user's param groups over the distributed params; the zero-gradient step with lr=0.
    # (torch keeps "params" the first key of each group, which fully_shard_optimizer relies on.)
    rebind_param_groups(optimizer, group_fqns, {dp.fqn: dp.param for dp in params})
    _shard_optimizer(optimizer)
    return wrapped, optimizer


def _unit_modules(
    model: nn.Module, unit_modules: Sequence[type[nn.Module]] | None, strategy: str
) -> list[type[nn.Module]]:
    """The FSDP unit classes: as given, else the classes of ``model.layers``; checked to match."""
    given = unit_modules is not None
    if unit_modules is None:
        layers = getattr(model, "layers", None)
        unit_modules = sorted({type(m) for m in layers}, key=lambda t: t.__qualname__) if layers is not None else []
    unit_modules = list(unit_modules)
    if strategy == "optim_grads_params" and not any(isinstance(m, tuple(unit_modules)) for m in model.modules()):
        # megatron-fsdp 0.6.1 sizes its communication units as (elements in units) // (number
        # of units): ZeroDivisionError in fully_shard_model without a unit.
        raise ValueError(
            f"unit_modules={[t.__name__ for t in unit_modules]} matches no submodule of the "
            f"{type(model).__name__}{'' if given else ' (default: the classes of model.layers, which it lacks)'}; "
            "strategy='optim_grads_params' needs at least one FSDP unit (megatron-fsdp 0.6.1 divides by "
            "their count). Pass unit_modules=[YourBlock] (the repeated layer class) or use "
            "strategy='optim_grads'"
        )
    return unit_modules


def _check_fp8_model(model: nn.Module, policy: PrecisionPolicy) -> None:
    """ValueError unless the FP8-converted ``model`` holds FP8 parameters and ``policy`` does not cast them."""
    recipe = fp8.recipe_of(model)
    if not any(is_fp8_parameter(p) for p in model.parameters()):
        raise ValueError(
            f"the model was converted for {recipe} but no parameter of the {type(model).__name__} is a "
            "TransformerEngine FP8 tensor, so fp8_param_gather would gather nothing in FP8; build the TE modules "
            "inside shardbridge_te.model_init_context(recipe) (te.quantized_model_init), or do not convert the model"
        )
    if policy.param_dtype is not None:
        raise ValueError(
            f"policy.param_dtype={policy.param_dtype} with FP8 parameters: shard_model would cast the model, FP8 "
            "parameters included, to it; build the TE modules in the compute dtype (params_dtype=...) and set "
            "param_dtype=None (Megatron-FSDP keeps its main weights in main_params_dtype)"
        )


def _wrap(
    model: nn.Module,
    mesh: ParallelMesh,
    mp_policy: object,
    strategy: str,
    outer_strategy: str | None,
    unit_modules: list[type[nn.Module]],
    on_cpu: bool,
    ddp_kwargs: Mapping[str, Any] | None = None,
) -> nn.Module:
    """``megatron_fsdp.fully_shard_model`` over the shardbridge mesh (HSDP over dp_replicate).

    ``ddp_kwargs`` (e.g. ``{"fp8_param_gather": True}`` from ``fp8_ddp_kwargs``) become fields
    of the ``DistributedDataParallelConfig`` it builds (``wrapped.ddp_config``).
    """
    mfsdp = require_megatron_fsdp()
    hsdp = {}
    if outer_strategy is not None:
        hsdp = {
            "dp_outer_dim": "dp_replicate",
            "hybrid_fsdp_group": mesh["dp_cp" if mesh.dims.cp > 1 else "dp"].get_group(),
            "outer_dp_sharding_strategy": outer_strategy,
        }
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())
    return fully_shard_model(
        mfsdp,
        dict(ddp_kwargs or {}),
        module=model,
        device_mesh=mesh.mesh,
        dp_shard_dim="dp_shard_cp" if mesh.dims.cp > 1 else "dp_shard",  # cp folded into sharding
        tp_dim="tp",
        fsdp_unit_modules=unit_modules,
        zero_dp_strategy=strategy,
        device=device,
        mixed_precision_policy=mp_policy,
        sync_model_each_microbatch=True,
        **hsdp,
    )


def _after_wrap(wrapped: nn.Module, mesh: ParallelMesh, strategy: str, outer_strategy: str | None) -> None:
    """gloo's missing PREMUL_SUM, the HFSDP scaling bug, the accumulation guard; DTensor params."""
    if "nccl" not in dist.get_backend(mesh["dp_shard"].get_group()):
        # gloo has no PREMUL_SUM: scale, then SUM (Megatron-FSDP's own fallback path).
        disable_grad_div_fusion(wrapped)
    # Upstream bug, any device: see [Note: HFSDP gradient scaling].
    _fix_hfsdp_gradient_scaling(wrapped)
    if accumulation_is_wrong(strategy, outer_strategy):
        install_guard(wrapped, strategy, outer_strategy)
    # After wrapping: module.to() inside MegatronFSDP.__init__ swaps DTensor params (hooks lost).
    _tp_patch.align_tp_grads(raw_parameters(wrapped))
    install_distributed_params(wrapped)


def _main_weights_from(wrapped: nn.Module, params: list, originals: dict[str, torch.Tensor]) -> None:
    """Each rank's main-weight shard copied from the full-precision original, then the compute weights."""
    with torch.no_grad():
        for dp in params:
            if dp.local.numel():
                box = tuple(slice(o, o + s) for o, s in zip(dp.offsets, dp.local.shape))
                dp.local.copy_(originals[dp.fqn][box])
    wrapped.install_optimized_model_weights()


def _shard_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``fully_shard_optimizer`` without its side effects on the weights and Adam's step count (see ``_optimizer``)."""
    fully_shard_optimizer = require_megatron_fsdp().fully_shard_optimizer
    zero_step(optimizer, lambda: fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=True))
