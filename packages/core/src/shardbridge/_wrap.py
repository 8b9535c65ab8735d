"""Which modules become FSDP2 units, and how they are wrapped.

Public: :class:`SupportsFSDPUnits`, :data:`FSDPUnit`, :func:`apply_fsdp`, :func:`fsdp_unit_params`,
and for FSDP2 units made by hand, :func:`use_uint8_all_gather` (:class:`Uint8AllGather`, :data:`FP8_DTYPES`).

Quantization is not this module's business: an FP8 model is converted before it is wrapped
(``shardbridge.fp8.convert``), its weights bring their own FSDP2 all-gather hooks, and nothing
here asks which recipe, if any, the model runs.

[Note: FSDP units]
~~~~~~~~~~~~~~~~~~
One ``fully_shard`` call = one unit = one all-gather and one reduce-scatter per step. For a
decoder-only transformer (forward order, top to bottom)::

    unit 0        tok_embeddings            reshard after forward: yes
    unit 1..L     layers[i], one each       reshard after forward: yes
    unit L+1      [norm, output]  (grouped) reshard after forward: NO, backward starts here
    root          the model                 manages what is left (rope buffers; ideally no params)

``[norm, output]`` are grouped because they run back to back; wrapping ``norm`` with the
root would all-gather it with the embeddings at the start of forward (torchtune's question,
answered by ``fully_shard(list)``). The last unit is kept unsharded after forward because
backward needs it first: resharding it only to re-all-gather it at once wastes a collective.
The root is wrapped last and should manage as little as possible: everything it manages is
all-gathered at the start of forward and kept until backward ends. With tied embeddings the
embedding shares its weight with ``output`` and joins that last unit instead.

[Note: FSDP over a degree-1 data-parallel axis]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
When no axis is data-parallel (``dp_cp`` has size 1: a world of only TP, or one process),
there is nothing to shard or reduce. :func:`apply_fsdp` then skips ``fully_shard`` unless the
policy asks for casting (``param_dtype`` or ``output_dtype``) or ``cpu_offload`` is on: FSDP2
over a size-1 mesh still copies every parameter in and out each step (measured 6% slower at
tp=4 by ``tools/bench/bench_step.py``), and torchtitan likewise applies FSDP only when
dp_shard or cp > 1. With casting requested it shards over the size-1 mesh, which is how the
policy takes effect. Checkpoints do not care: they load across both representations.

[Note: float8 all-gather on gloo]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FSDP2 packs the all-gather inputs of one parameter group into one flat buffer. When every input
is float8 (FP8 weights whose ``fsdp_pre_all_gather`` sends float8 data, e.g. torchao's tensorwise
recipe) the buffer is float8, and gloo rejects it ("Invalid scalar type"); NCCL takes it. The
bytes are what matter, so :class:`Uint8AllGather` views float8 buffers as uint8 (same size, no
copy) and all-gathers those; any other buffer goes through exactly the call FSDP2's default
makes (``all_gather_single``, torch 2.11-2.14). :func:`apply_fsdp` gives it to every unit it
makes on gloo, whatever the model holds: a gloo fact about dtypes, not a choice of recipe.
Mixed groups already use a uint8 buffer and are unaffected.
[Note: custom gradient divide factor]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``FSDPModule.set_gradient_divide_factor(f)`` alone makes FSDP2 reduce-scatter with
``ReduceOp.PREMUL_SUM(1/f)``, which gloo does not have; ``set_force_sum_reduction_for_comms(True)``
turns it into SUM + a division afterwards. But with a shard group of ONE rank, FSDP2 (torch
2.13, ``foreach_reduce``) skips the reduce-scatter, copies ``grad / f`` and then still applies
the forced-sum post-division: the gradient is divided by ``f`` twice (found by ``test_moe.py``:
experts at ep = dp_shard = 4 have efsdp = 1 and trained with 1/4 of their gradient). So the
forced SUM is set only for shard groups of more than one rank; a one-rank group never issues a
reduce-scatter, so no PREMUL_SUM reaches gloo, and an HSDP all-reduce after it is a SUM.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Literal, Protocol, Union, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from shardbridge._checks import checked_args
from shardbridge._compat import (
    AllGather,
    all_gather_single,
    fsdp_params,
    fsdp_shard_process_group,
    fsdp_unit_key,
    fsdp_unit_modules,
)
from shardbridge._mesh import ParallelMesh
from shardbridge._precision import PrecisionPolicy

__all__ = [
    "FP8_DTYPES",
    "FSDPUnit",
    "SupportsFSDPUnits",
    "Uint8AllGather",
    "apply_fsdp",
    "fsdp_unit_params",
    "use_uint8_all_gather",
]

FSDPUnit = Union[nn.Module, Sequence[nn.Module]]
"""One FSDP unit: a module, or several modules grouped into one ``fully_shard`` call."""


@runtime_checkable
class SupportsFSDPUnits(Protocol):
    """A model that names its FSDP units.

    ``fsdp_units()`` returns the units in forward order, the root excluded: each entry a
    module or a list of modules grouped in one unit. A unit nested inside another must come
    before it (``fully_shard`` runs bottom-up). See [Note: FSDP units].

    Example:
        >>> class Net(nn.Module):
        ...     def fsdp_units(self):
        ...         return [self.embed, *self.blocks, [self.norm, self.head]]
    """

    def fsdp_units(self) -> Sequence[FSDPUnit]: ...


@checked_args(model=nn.Module, mesh=ParallelMesh, policy=(PrecisionPolicy, None))
def apply_fsdp(
    model: nn.Module,
    mesh: ParallelMesh,
    policy: PrecisionPolicy | None = None,
    *,
    units: Sequence[FSDPUnit] | None = None,
    reshard_after_forward: bool | Literal["default"] = "default",
    cpu_offload: bool = False,
    gradient_divide_factor: float | None = None,
) -> nn.Module:
    """Wrap ``model`` in FSDP2 units over the data-parallel part of ``mesh``; root last.

    The FSDP mesh is ``mesh.fsdp_mesh``: ``dp_shard_cp``, or ``(dp_replicate, dp_shard_cp)``
    for HSDP. With cp > 1 the cp axis is folded into the FLATTENED shard axis (a 2-D
    ``(dp_shard, cp)`` mesh would mean HSDP to ``fully_shard``), so FSDP's default gradient
    average divides by ``dp_replicate * dp_shard * cp``, as ``shardbridge.cp.cp_cross_entropy``
    expects (see [Note: loss over dp_cp] in ``shardbridge._cp``). Parameters already tensor-parallel (DTensors on ``mesh["tp"]``) become 2-D/3-D
    DTensors, e.g. ``(_StridedShard(0, sf=tp), Shard(0))``. See [Note: FSDP units] and
    [Note: FSDP over a degree-1 data-parallel axis].

    Args:
        model: the model, in ``policy.main_params_dtype``, after tensor parallelism.
        mesh: the :class:`~shardbridge.ParallelMesh` of the run.
        policy: mixed precision. None = torch defaults (no casting, reduce in the params' dtype).
        units: the units in forward order (see :class:`SupportsFSDPUnits`). None = ask
            ``model.fsdp_units()``.
        reshard_after_forward: "default" = every unit but the last reshards (the last is
            needed first in backward); True = all units reshard; False = none do (more
            memory, no all-gather in backward). The root never reshards.
        cpu_offload: keep sharded params, grads and optimizer states on CPU
            (``CPUOffloadPolicy``; memory is pinned only when the mesh is not on CPU).
        gradient_divide_factor: divide summed gradients by this instead of the data-parallel
            size (1.0 = sum). None = FSDP's default average. Forces sum-only collectives
            (gloo has no PREMUL_SUM).

    Returns:
        ``model``, wrapped in place: an ``FSDPModule``, or unchanged when no axis is
        data-parallel and nothing is cast (see [Note: FSDP over a degree-1 data-parallel axis]).

    Raises:
        ValueError: bad units, a parameter not in ``policy.main_params_dtype``, or a bad
            ``reshard_after_forward``; the message says what to change.

    Example:
        >>> pm = ParallelDims(dp_shard=-1).build_mesh("cpu")  # doctest: +SKIP
        >>> apply_fsdp(model, pm, PrecisionPolicy.bf16())  # doctest: +SKIP
    """
    if reshard_after_forward != "default" and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward={reshard_after_forward!r} must be True, False or 'default'")
    unit_list = _resolve_units(model, units)
    _check_no_empty_tp_pieces(model)
    needs_cast = policy is not None and (policy.param_dtype is not None or policy.output_dtype is not None)
    if mesh.dims.degree("dp_cp") == 1 and not needs_cast and not cpu_offload:
        if policy is not None:
            policy.check_model_dtype(model)
        return model  # See [Note: FSDP over a degree-1 data-parallel axis]
    if policy is not None:
        policy.check_model_dtype(model)
        mp_policy = policy.to_fsdp2()
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

        mp_policy = TorchMixedPrecisionPolicy()
    fsdp_mesh = mesh.fsdp_mesh
    assert "cp" not in (fsdp_mesh.mesh_dim_names or ()), "cp must be folded into dp_shard_cp"
    offload: OffloadPolicy = OffloadPolicy()
    if cpu_offload:
        offload = CPUOffloadPolicy(pin_memory=fsdp_mesh.device_type != "cpu")
    common = dict(mesh=fsdp_mesh, mp_policy=mp_policy, offload_policy=offload)

    for index, unit in enumerate(unit_list):
        is_last = index == len(unit_list) - 1
        reshard = reshard_after_forward if isinstance(reshard_after_forward, bool) else not is_last
        fully_shard(list(unit) if len(unit) > 1 else unit[0], reshard_after_forward=reshard, **common)
    # Root: reshard_after_forward=None lets FSDP keep it unsharded (it is needed first in backward).
    fully_shard(model, **common)
    _warn_if_root_manages_params(model, unit_list)
    use_uint8_all_gather(model)  # See [Note: float8 all-gather on gloo]

    if gradient_divide_factor is not None:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                set_gradient_divide_factor(module, gradient_divide_factor)
    return model


def set_gradient_divide_factor(module: FSDPModule, factor: float) -> None:
    """Divide ``module``'s summed gradients by ``factor``, on gloo and NCCL alike.

    See [Note: custom gradient divide factor]. Not public: ``apply_fsdp(gradient_divide_factor=)``
    and the expert units of ``parallelize_moe`` call it.
    """
    from shardbridge._compat import fsdp_shard_process_group

    group = fsdp_shard_process_group(module)
    if group is not None and group.size() > 1:
        module.set_force_sum_reduction_for_comms(True)
    module.set_gradient_divide_factor(factor)


@checked_args(model=nn.Module)
def fsdp_unit_params(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Which parameters each FSDP unit of ``model`` manages, by FQN.

    Keys name a unit by its modules' FQNs joined with "+" ("" is the root), in the order the
    units were created; values are the FQNs of the parameters that unit all-gathers. Units
    managing no parameters map to ``()``.

    Example:
        >>> fsdp_unit_params(model)  # doctest: +SKIP
        {'tok_embeddings': ('tok_embeddings.weight',), ..., 'norm+output': ('norm.weight', 'output.weight'), '': ()}
    """
    names = {module: name for name, module in model.named_modules()}
    param_names = {id(param): name for name, param in model.named_parameters()}  # first name of a tied param
    out: dict[str, tuple[str, ...]] = {}
    seen: set[int] = set()
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        # FSDP2 (2.13) has no public accessor for a unit's modules and parameters.
        unit = fsdp_unit_key(module)
        if unit in seen:
            continue
        seen.add(unit)
        key = "+".join(names[m] for m in fsdp_unit_modules(module))
        out[key] = tuple(param_names[id(p.sharded_param)] for p in fsdp_params(module))
    return out


def _resolve_units(model: nn.Module, units: Sequence[FSDPUnit] | None) -> list[tuple[nn.Module, ...]]:
    if units is None:
        if not isinstance(model, SupportsFSDPUnits):
            raise ValueError(
                f"{type(model).__name__} does not name its FSDP units; pass units=[...] (modules or lists "
                "of modules, in forward order) or give the model a fsdp_units() method"
            )
        units = model.fsdp_units()
    names = {module: name for name, module in model.named_modules()}
    resolved: list[tuple[nn.Module, ...]] = []
    owner: dict[nn.Module, int] = {}
    for index, unit in enumerate(units):
        modules = (unit,) if isinstance(unit, nn.Module) else tuple(unit)
        if not modules:
            raise ValueError(f"units[{index}] is empty; give each unit at least one module")
        for module in modules:
            if not isinstance(module, nn.Module):
                raise ValueError(f"units[{index}] contains {type(module).__name__}, not an nn.Module")
            if module is model:
                raise ValueError(f"units[{index}] is the model itself; the root is wrapped last, leave it out")
            if module not in names:
                raise ValueError(
                    f"units[{index}] contains a {type(module).__name__} that is not a submodule of the model"
                )
            if module in owner:
                raise ValueError(
                    f"module {names[module]!r} appears in units[{owner[module]}] and units[{index}]; "
                    "put each module in one unit"
                )
            owner[module] = index
        resolved.append(modules)
    # fully_shard claims every not-yet-claimed param below a module: inner units go first.
    for index, modules in enumerate(resolved):
        for module in modules:
            for _, sub in module.named_modules():
                later = owner.get(sub)
                if sub is not module and later is not None and later > index:
                    raise ValueError(
                        f"units[{index}] ({names[module]!r}) contains units[{later}] "
                        f"({names[sub]!r}) but comes first; list nested units before the units containing them"
                    )
    return resolved


def _warn_if_root_manages_params(model: nn.Module, units: list[tuple[nn.Module, ...]]) -> None:
    claimed = {id(p) for unit in units for module in unit for p in module.parameters()}
    left = [name for name, p in model.named_parameters() if id(p) not in claimed]
    if left:
        warnings.warn(
            f"the FSDP root manages {len(left)} parameter(s) no unit claims ({left[:3]}...): they are "
            "all-gathered at the start of forward and kept until backward ends; add their modules to a unit",
            UserWarning,
            stacklevel=3,
        )


def _check_no_empty_tp_pieces(model: nn.Module) -> None:
    """Refuse TP parameters some rank holds nothing of: FSDP2's backward crashes on them.

    Pure layout algebra over every mesh coordinate, so all ranks raise together (no hang).
    """
    import itertools

    from torch.distributed.tensor import DTensor

    from shardbridge.layout import local_chunk

    for fqn, param in model.named_parameters():
        if not isinstance(param, DTensor) or param.numel() == 0:
            continue
        mesh_shape = tuple(param.device_mesh.shape)
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            chunk = local_chunk(tuple(param.shape), mesh_shape, tuple(param.placements), coordinate)
            if any(not intervals for intervals in chunk):
                raise ValueError(
                    f"parameter {fqn!r} of shape {tuple(param.shape)} with placements "
                    f"{tuple(param.placements)} leaves mesh coordinate {coordinate} an empty tensor-parallel "
                    "piece, which crashes FSDP2's backward (_chunk_cat expects non-empty tensor); make the "
                    "sharded dim at least as large as the TP degree times the chunk size (e.g. divisible by tp) "
                    "or lower tp"
                )


FP8_DTYPES: frozenset[torch.dtype] = frozenset(
    d
    for d in (
        getattr(torch, name, None)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    )
    if d is not None
)
"""The float8 dtypes of this torch (gloo all-gathers none of them)."""


class Uint8AllGather(AllGather):
    """FSDP2 all-gather that sends float8 buffers as uint8. See [Note: float8 all-gather on gloo]."""

    def allocate(self, size: Iterable[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> dist.Work | None:
        if output_tensor.dtype in FP8_DTYPES:
            output_tensor = output_tensor.view(torch.uint8)
            input_tensor = input_tensor.view(torch.uint8)
        return all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def _backend(module: FSDPModule) -> str:
    pg = fsdp_shard_process_group(module)
    return "" if pg is None else dist.get_backend(pg)


@checked_args(model=nn.Module)
def use_uint8_all_gather(model: nn.Module, *, backends: tuple[str, ...] = ("gloo",)) -> int:
    """Give every FSDP2 unit of ``model`` on one of ``backends`` the :class:`Uint8AllGather`.

    :func:`apply_fsdp` calls it; call it yourself after ``fully_shard`` by hand. Units on other
    backends (NCCL takes float8) are left alone. See [Note: float8 all-gather on gloo].

    Returns:
        The number of FSDP units changed.

    Example:
        >>> fully_shard(model, mesh=pm.fsdp_mesh)  # doctest: +SKIP
        >>> use_uint8_all_gather(model)  # doctest: +SKIP
        1
    """
    changed = 0
    for module in model.modules():
        if isinstance(module, FSDPModule) and _backend(module) in backends:
            module.set_custom_all_gather(Uint8AllGather())
            changed += 1
    return changed
