"""Megatron-FSDP models and optimizers through shardbridge checkpoints (the core's format), for both hosts.

One provider, :class:`MegatronFSDPStateDicts`, for a model either entry point wrapped: the
standalone ``MegatronFSDP`` (``shard_model``) and Megatron-Core's ``FullyShardedDataParallel``
(``mcore.shard_model``), whose ``.module`` is the bundled copy's ``MegatronFSDP``; both copies
record the same boxes (``_compat.megatron_fsdp_module`` finds which one wrapped the model).

[Note: Megatron-FSDP state as boxes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-FSDP's distributed parameters (the ones its optimizer steps) are DTensors whose
local tensor is a row range of the TP-local piece, padded to bucket boundaries, so shards are
uneven (rows 32..49 of 64 on one rank, none on another). TP is ``[Shard(0), Shard(0)]`` on
``(dp_shard, tp)`` with a patched ``_shard_order``, not ``_StridedShard``: ``full_tensor()``
and DCP's own ``compute_local_shape_and_global_offset`` read those placements left to right
and are WRONG for them. What is right is the box Megatron-FSDP itself records
(``uneven_dtensor.update_uneven_dtensor_chunk_metadata``: global offsets + local sizes,
computed by gathering the local shapes along its shard order)::

    o_proj.weight (64, 64), mesh (dp_shard=2, tp=2), TP Shard(0) then FSDP rows:
    rank (dp, tp)   local rows   global box (item coordinates)
    (0, 0)          14           rows  0..13
    (1, 0)          18           rows 14..31
    (0, 1)          14           rows 32..45
    (1, 1)          18           rows 46..63

:func:`save` and :func:`load` are the core's ``shardbridge.checkpoint.save`` / ``load`` with a
:class:`~shardbridge.checkpoint.StateDictProvider` (:class:`MegatronFSDPStateDicts`) that
hands the core the distributed (main) parameters and their optimizer states under the
user's FQNs, and those boxes as ``local_offsets``. The core writes them as explicit chunks
(views into the live local tensors), splits fused parameters into their components in
global item coordinates (never from the local size: Megatron-LM #4423), for DTensor AND
plain-tensor optimizer states alike, and commits with its own manifest. So
``shardbridge.checkpoint.load`` reads these checkpoints into torch-FSDP2 models, and
:func:`load` reads the core's checkpoints into Megatron-FSDP, across meshes, bit-exact.
After a load the provider writes non-tensor optimizer values back and copies the main
weights into the compute weights (``install_optimized_model_weights``).

Optimizer states of a parameter whose local shard is empty on this rank may not exist
(Megatron-FSDP's optimizer never saw that piece), or exist with ``step`` still 0 (a rank whose
shard is empty gets no gradient, so torch optimizers never step it there). Before a save each
``step`` becomes the maximum over ranks (:func:`_agree_on_step`; measured on megatron-core's
copy: without it a dp2 x tp2 checkpoint stored step 0 for 8 of 21 parameters after 2 steps, and
a resharded load then restarted Adam's bias correction for them). A rank with no entry simply
writes none (another rank writes the value); on load every rank describes the same keys (agreed
with one ``all_gather_object``), with a throwaway tensor shaped like the (empty) local shard or a
throwaway scalar (``step``), so every rank checks the same keys.

Registered local experts (``_experts.register_expert_stack``; Megatron-Core's MoE layers) are
stored as the core's ``[E, ...]`` expert tensors, each rank's boxes with the global expert index
prepended; their ``step`` is agreed over ranks and experts (one stored value per tensor) and
their param group must be the same for every expert of a stack. See [Note: local experts in
global coordinates] in ``_experts.py``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from shardbridge import checkpoint as core
from shardbridge._compat import local_tensor
from shardbridge.adapters import LocalChunks
from shardbridge.fused import FusedSpec, fused_params
from torch import nn
from torch.distributed.tensor import DTensor

from shardbridge_megatron_fsdp._compat import (
    chunk_offsets,
    install_distributed_params,
    megatron_fsdp_module,
    optimizer_named_parameters,
)
from shardbridge_megatron_fsdp._experts import ExpertSlot, expert_slots

__all__ = [
    "DistParam",
    "ExpertStackState",
    "MegatronFSDPStateDicts",
    "dist_params",
    "expert_stacks",
    "install_weights",
    "load",
    "local_box",
    "save",
]


@dataclass(frozen=True)
class DistParam:
    """One Megatron-FSDP distributed parameter and the true box of its local tensor."""

    fqn: str
    """FQN in the user's module (no ``module.`` prefix)."""
    param: DTensor
    """The distributed (optimizer) parameter."""
    offsets: tuple[int, ...]
    """Global offsets of the local tensor (item coordinates)."""
    spec: FusedSpec | None
    """FusedSpec when the parameter is fused."""

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)

    @property
    def local(self) -> torch.Tensor:
        return local_tensor(self.param)


def _mfsdp(model: nn.Module) -> tuple[Any, ModuleType]:
    """``(MegatronFSDP module, its package)`` of a model either entry point wrapped; ValueError otherwise."""
    found = megatron_fsdp_module(model)
    if found is None:
        raise ValueError(
            f"model must be the module shard_model returned (MegatronFSDP, or Megatron-Core's "
            f"FullyShardedDataParallel from mcore.shard_model), got {type(model).__name__}; for torch-FSDP2 models "
            "use shardbridge.checkpoint.save / load"
        )
    return found


def local_box(param: DTensor, package: ModuleType) -> tuple[int, ...]:
    """Global offsets of a Megatron-FSDP distributed parameter's local tensor.

    Read from the chunk metadata Megatron-FSDP (``package``, the copy that made ``param``)
    recorded on the local tensor, or (``no_shard`` parameters carry none) computed with its own
    gather; a collective in that case, so call it for the same parameters in the same order on
    every rank. See [Note: Megatron-FSDP state as boxes].
    """
    return chunk_offsets(param, package)


def dist_params(model: nn.Module) -> list[DistParam]:
    """Every distributed parameter of a wrapped model with its box, in a fixed order."""
    inner, package = _mfsdp(model)
    install_distributed_params(inner)
    fused = fused_params(inner.module)
    out = []
    for fqn, param in optimizer_named_parameters(inner):
        assert isinstance(param, DTensor), (fqn, type(param))
        out.append(DistParam(fqn, param, local_box(param, package), fused.get(fqn)))
    return out


def install_weights(model: nn.Module) -> None:
    """Copy the (loaded) main weights into the compute weights (``install_optimized_model_weights``)."""
    _mfsdp(model)[0].install_optimized_model_weights()


def _shard_like(dp: DistParam, value: Any) -> bool:
    """Whether an optimizer state is shaped like the parameter's shard.

    DTensor states (torch optimizers on DTensor params) and plain local tensors (fused
    optimizers such as TE's FusedAdam) both qualify; the core places both at the
    parameter's box (see [Note: item coordinates] in the core's ``_fused.py`` for why plain
    ones must not be split by their own size).
    """
    if isinstance(value, DTensor):
        return tuple(value.shape) == dp.shape and tuple(local_tensor(value).shape) == tuple(dp.local.shape)
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(dp.local.shape)


def _state_keys(optimizer: torch.optim.Optimizer, params: list[DistParam]) -> dict[str, dict[str, bool]]:
    """fqn -> {state key: is shard-shaped}, agreed on by all ranks (some ranks hold no state)."""
    local: dict[str, dict[str, bool]] = {}
    for dp in params:
        state = optimizer.state.get(dp.param, {})
        local[dp.fqn] = {k: _shard_like(dp, v) for k, v in state.items()}
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return local
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    merged: dict[str, dict[str, bool]] = {}
    for one in gathered:
        for fqn, keys in one.items():
            into = merged.setdefault(fqn, {})
            for key, shard_shaped in keys.items():
                into[key] = into.get(key, False) or shard_shaped
    return merged


@dataclass(frozen=True)
class ExpertStackState:
    """The local experts of one stored ``[E, ...]`` tensor this rank holds.

    See [Note: local experts in global coordinates] in ``_experts.py``.
    """

    stored: str
    """FQN of the stored tensor."""
    shape: tuple[int, ...]
    """``(E, *expert parameter shape)``."""
    members: tuple[tuple[DistParam, int], ...]
    """``(distributed parameter, global expert index)`` of each local expert."""

    def chunks(self, local_of: Any) -> LocalChunks:
        """The boxes of the stored tensor: ``local_of(dp)`` (a local shard, or None) of each member."""
        pieces = []
        for dp, index in self.members:
            local = local_of(dp)
            if local is not None:
                pieces.append(((index, *dp.offsets), local.unsqueeze(0)))  # a view: loads fill it
        return LocalChunks(self.shape, pieces)


def expert_stacks(params: list[DistParam], slots: dict[str, ExpertSlot]) -> dict[str, ExpertStackState]:
    """Stored FQN -> :class:`ExpertStackState` of the registered local experts among ``params``.

    Raises:
        ValueError: local experts of one stored tensor with different shapes, or a stored name
            that is also a parameter's name.
        NotImplementedError: expert parameters split over a tensor-parallel axis.
    """
    members: dict[str, list[tuple[DistParam, int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    names = {dp.fqn for dp in params}
    for dp in params:
        slot = slots.get(dp.fqn)
        if slot is None:
            continue
        mesh = dp.param.device_mesh
        for axis, size in zip(mesh.mesh_dim_names or (), mesh.shape):
            if axis == "tp" and size > 1:
                raise NotImplementedError(
                    f"{dp.fqn}: expert parameters split over tp={size} (expert_tensor_parallel_size > 1) are not "
                    "checkpointed in global expert coordinates; use expert_tensor_parallel_size=1 "
                    "(mcore.init_parallel_state sets it)"
                )
        shape = (slot.num_experts, *dp.shape)
        if shapes.setdefault(slot.stored, shape) != shape or slot.stored in names:
            raise ValueError(
                f"{dp.fqn}: stored as {slot.stored!r} {shape}, which "
                f"{'is a parameter name' if slot.stored in names else f'other experts store as {shapes[slot.stored]}'}; "
                "every local expert of a stack must have the same shape and the stack a name of its own"
            )
        members.setdefault(slot.stored, []).append((dp, slot.index))
    return {name: ExpertStackState(name, shapes[name], tuple(m)) for name, m in members.items()}


def _state_local(state: dict[str, Any], key: str) -> torch.Tensor | None:
    value = state.get(key)
    if value is None:
        return None
    return local_tensor(value) if isinstance(value, DTensor) else value


class MegatronFSDPStateDicts:
    """The :class:`~shardbridge.checkpoint.StateDictProvider` of a Megatron-FSDP model (either host).

    State dicts of the distributed (main) parameters and their optimizer states under the
    user's FQNs, each parameter's box from Megatron-FSDP's chunk metadata, ``step`` agreed over
    ranks before a save, and after a load the non-tensor optimizer values written back and the
    main weights installed into the compute weights. See [Note: Megatron-FSDP state as boxes].

    Example:
        >>> checkpoint.save(path, model=model, optimizer=opt,
        ...                 state_dicts=MegatronFSDPStateDicts())  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._params: dict[str, DistParam] = {}
        self._stacks: dict[str, ExpertStackState] = {}

    def state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, for_load: bool
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        params = dist_params(model)
        self._stacks = expert_stacks(params, expert_slots(_mfsdp(model)[0].module))
        stacked = {dp.fqn for stack in self._stacks.values() for dp, _ in stack.members}
        plain = [dp for dp in params if dp.fqn not in stacked]
        self._params = {dp.fqn: dp for dp in plain}
        model_sd: dict[str, Any] = {dp.fqn: dp.param for dp in plain}
        model_sd.update({name: stack.chunks(lambda dp: dp.local) for name, stack in self._stacks.items()})
        if optimizer is None:
            return model_sd, None
        optim_sd: dict[str, Any] = {}
        # Keys agreed over ranks: on load for every parameter, on save for the expert stacks
        # (each stack's entries, and so the step agreement below, must be the same on every rank).
        agreed = _state_keys(optimizer, params) if for_load or self._stacks else None
        keys = agreed if for_load else None
        if not for_load:
            _agree_on_step(optimizer, params)
        by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        for stack in self._stacks.values():
            optim_sd.update(_stack_optim_entries(stack, optimizer, agreed, by_param))
        if not for_load:
            _agree_on_stack_steps(optim_sd, self._stacks)
        for dp in plain:
            state = optimizer.state.get(dp.param, {})
            for key, value in state.items():
                optim_sd[f"state.{dp.fqn}.{key}"] = value
            for key, shard_shaped in (keys or {}).get(dp.fqn, {}).items():
                if key not in state:
                    # Throwaway: this rank holds no state here (an empty shard).
                    placeholder = torch.empty_like(dp.local) if shard_shaped else torch.zeros(())
                    optim_sd[f"state.{dp.fqn}.{key}"] = placeholder
        for dp in plain:
            group = by_param.get(id(dp.param))
            if group is None:
                raise ValueError(
                    f"parameter {dp.fqn!r} is not in any optimizer param group; build the optimizer over "
                    "model.parameters() before shard_model, or pass optimizer=None"
                )
            for hyper, value in group.items():
                if hyper != "params":
                    optim_sd[f"param_groups.{dp.fqn}.{hyper}"] = value
        return model_sd, optim_sd

    def local_offsets(self, fqn: str, param: DTensor) -> tuple[int, ...] | None:
        dp = self._params.get(fqn)
        return dp.offsets if dp is not None and dp.param is param else None

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_sd: dict[str, Any],
        optim_sd: dict[str, Any] | None,
        *,
        strict: bool,
    ) -> None:
        if optimizer is not None:
            assert optim_sd is not None
            by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
            for dp in self._params.values():
                state = optimizer.state.get(dp.param, {})
                for key in state:
                    value = optim_sd.get(f"state.{dp.fqn}.{key}")
                    if value is not None and not isinstance(value, torch.Tensor):
                        state[key] = value  # tensors were loaded in place
                group = by_param[id(dp.param)]
                for hyper in group:
                    if hyper != "params" and f"param_groups.{dp.fqn}.{hyper}" in optim_sd:
                        group[hyper] = optim_sd[f"param_groups.{dp.fqn}.{hyper}"]
            for stack in self._stacks.values():
                _load_stack_optim_entries(stack, optimizer, optim_sd, by_param)
        # The loaded values sit in the main (optimizer) weights; forward uses the compute weights.
        install_weights(model)


def _stack_optim_entries(
    stack: ExpertStackState,
    optimizer: torch.optim.Optimizer,
    keys: dict[str, dict[str, bool]],
    by_param: dict[int, dict[str, Any]],
) -> dict[str, Any]:
    """``state.<stored>.*`` and ``param_groups.<stored>.*`` of one stack of local experts.

    States shaped like the parameter are boxes of the stored tensor (LocalChunks); any other
    state (``step``) is one value, the maximum over the local experts (on save; agreed over
    ranks afterwards by :func:`_agree_on_stack_steps`). ``keys``: the state keys agreed over
    ranks (:func:`_state_keys`), so every rank describes the same entries.
    """
    out: dict[str, Any] = {}
    states = [(dp, optimizer.state.get(dp.param, {})) for dp, _ in stack.members]
    shaped: dict[str, bool] = {}
    for dp, _ in stack.members:
        for key, shard_shaped in keys.get(dp.fqn, {}).items():
            shaped[key] = shaped.get(key, False) or shard_shaped
    for key, shard_shaped in shaped.items():
        name = f"state.{stack.stored}.{key}"
        if shard_shaped:
            by_dp = {id(dp): state for dp, state in states}
            out[name] = stack.chunks(lambda dp, key=key, by_dp=by_dp: _state_local(by_dp[id(dp)], key))
            continue
        values = [state[key] for _, state in states if key in state]
        if not values:
            out[name] = torch.zeros(())  # no local expert here holds it: a throwaway (load), 0 (save, then agreed)
        elif isinstance(values[0], torch.Tensor):
            out[name] = values[0].detach().clone().fill_(max(float(v) for v in values))
        else:
            out[name] = type(values[0])(max(float(v) for v in values))
    groups = {id(by_param[id(dp.param)]) for dp, _ in stack.members if id(dp.param) in by_param}
    if len(groups) != 1 or any(id(dp.param) not in by_param for dp, _ in stack.members):
        raise ValueError(
            f"the local experts stored as {stack.stored!r} are in {len(groups)} optimizer param groups (or in none); "
            "they are one stored tensor, so put every expert of it in the same param group"
        )
    group = by_param[id(stack.members[0][0].param)]
    out.update({f"param_groups.{stack.stored}.{h}": v for h, v in group.items() if h != "params"})
    return out


def _load_stack_optim_entries(
    stack: ExpertStackState,
    optimizer: torch.optim.Optimizer,
    optim_sd: dict[str, Any],
    by_param: dict[int, dict[str, Any]],
) -> None:
    """After a load: the one stored value of each non-shard state, and the hyperparameters, into every expert."""
    for dp, _ in stack.members:
        state = optimizer.state.get(dp.param, {})
        for key, current in state.items():
            value = optim_sd.get(f"state.{stack.stored}.{key}")
            if value is None or isinstance(value, LocalChunks):
                continue  # boxes were filled in place
            if isinstance(current, torch.Tensor) and current.dim() == 0:
                current.fill_(float(value))
            elif not isinstance(current, torch.Tensor):
                state[key] = type(current)(float(value)) if isinstance(current, (int, float)) else value
        group = by_param[id(dp.param)]
        for hyper in group:
            if hyper != "params" and f"param_groups.{stack.stored}.{hyper}" in optim_sd:
                group[hyper] = optim_sd[f"param_groups.{stack.stored}.{hyper}"]


def _agree_on_stack_steps(optim_sd: dict[str, Any], stacks: dict[str, ExpertStackState]) -> None:
    """One ``step`` per stored expert tensor, the same on every rank: the maximum over ranks.

    Each rank holds different experts of a stack (its ep rank's), stepped the same number of
    times in practice; DCP writes one rank's copy of a scalar, so they must agree exactly.
    """
    names = sorted(f"state.{name}.step" for name in stacks)
    names = [n for n in names if isinstance(optim_sd.get(n), (torch.Tensor, int, float))]
    if not names or not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    agreed = torch.tensor([float(optim_sd[n]) for n in names], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    for name, value in zip(names, agreed.tolist()):
        current = optim_sd[name]
        optim_sd[name] = current.fill_(value) if isinstance(current, torch.Tensor) else type(current)(value)


def _agree_on_step(optimizer: torch.optim.Optimizer, params: list[DistParam]) -> None:
    """Give every rank the optimizer ``step`` of the ranks that hold the parameter's data.

    See [Note: Megatron-FSDP state as boxes]: the value is the same scalar on every rank in the
    checkpoint (DCP writes one rank's copy), so before a save each ``step`` becomes the maximum
    over ranks. One all-reduce; nothing changes where every rank already agrees.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    steps = []
    for dp in params:
        step = optimizer.state.get(dp.param, {}).get("step")
        steps.append(-1.0 if step is None else float(step))
    agreed = torch.tensor(steps, dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    for dp, value in zip(params, agreed.tolist()):
        state = optimizer.state.get(dp.param)
        if state is None or "step" not in state:
            continue
        if isinstance(state["step"], torch.Tensor):
            state["step"].fill_(value)
        else:
            state["step"] = type(state["step"])(value)


def save(path: str | os.PathLike[str], *, model: nn.Module, **kwargs: Any) -> Path | core.AsyncSave:
    """Save a Megatron-FSDP model (and optimizer) as a shardbridge checkpoint. Call on every rank.

    ``shardbridge.checkpoint.save(path, model=model, **kwargs)`` (``optimizer``, ``step``,
    ``extra``, ``overwrite``, ``async_``: its keywords) with :class:`MegatronFSDPStateDicts`, so
    the checkpoint has the core's format: it loads with ``shardbridge.checkpoint.load`` into
    torch-FSDP2 / TP / single-process models of any layout, exports with
    ``shardbridge.checkpoint.export_safetensors``, and loads back into either Megatron-FSDP host
    with :func:`load`. Fused parameters (registered with ``shardbridge.fused.register_fused``; the
    Megatron-Core entry point registers QKV and SwiGLU) are stored as their components. See
    [Note: Megatron-FSDP state as boxes].

    Args:
        path: the checkpoint directory to create (e.g. ``shardbridge.checkpoint.step_dir``).
        model: the module :func:`~shardbridge_megatron_fsdp.shard_model` or
            ``shardbridge_megatron_fsdp.mcore.shard_model`` returned.
        **kwargs: the other keywords of ``shardbridge.checkpoint.save``.

    Returns:
        The committed checkpoint directory, or (``async_=True``) the
        ``shardbridge.checkpoint.AsyncSave`` whose ``wait()`` returns it.

    Example:
        >>> from shardbridge.checkpoint import step_dir
        >>> save(step_dir("/ckpt", 10), model=model, optimizer=opt, step=10)  # doctest: +SKIP
    """
    _mfsdp(model)
    return core.save(path, model=model, state_dicts=MegatronFSDPStateDicts(), **kwargs)


def load(path: str | os.PathLike[str], *, model: nn.Module, **kwargs: Any) -> core.TrainState:
    """Load a shardbridge checkpoint into a Megatron-FSDP model (either host), in place. Call on every rank.

    The checkpoint may come from Megatron-FSDP, Megatron-Core, torch FSDP2, TP or one process.
    ``shardbridge.checkpoint.load(path, model=model, **kwargs)`` (``optimizer``, ``strict``,
    ``rng``: its keywords) with :class:`MegatronFSDPStateDicts`, which also handles what a plain
    ``dcp.load`` leaves to the user: the loaded main weights are copied into Megatron-FSDP's
    compute weights (``install_optimized_model_weights``; the upstream recipe is
    ``model.load_state_dict`` after ``dcp.load``), and optimizer hyperparameters are written back
    into the param groups.

    Args:
        path: the checkpoint directory.
        model: the module either ``shard_model`` returned.
        **kwargs: the other keywords of ``shardbridge.checkpoint.load``.

    Returns:
        The checkpoint's :class:`~shardbridge.checkpoint.TrainState`.

    Example:
        >>> state = load(latest("/ckpt"), model=model, optimizer=opt)  # doctest: +SKIP
    """
    _mfsdp(model)
    return core.load(path, model=model, state_dicts=MegatronFSDPStateDicts(), **kwargs)
