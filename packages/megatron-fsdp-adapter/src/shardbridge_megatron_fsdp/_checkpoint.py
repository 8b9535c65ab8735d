"""Megatron-FSDP models and optimizers through shardbridge checkpoints (the core's format).

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

This module hands DCP exactly those boxes (:class:`~shardbridge.checkpoint._chunks.LocalChunks`,
views into the live local tensors), under the keys the core uses (``model.<fqn>``,
``optim.state.<fqn>.<state>``, ``optim.param_groups.<fqn>.<hyperparameter>``), with fused
parameters split into their components by the core's ``split_local`` in global item
coordinates (never from the local size: Megatron-LM #4423), for DTensor AND plain-tensor
optimizer states alike. The manifest is the core's. So ``shardbridge.checkpoint.load`` reads
these checkpoints into torch-FSDP2 models, and :func:`load` reads the core's checkpoints
into Megatron-FSDP, across meshes, bit-exact.

Optimizer states of a parameter whose local shard is empty on this rank do not exist
(Megatron-FSDP's optimizer never saw that piece); their keys are still described on every
rank, with no boxes (tensors) or a throwaway scalar on load (``step``), so every rank checks
the same keys.
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from shardbridge._fused import FusedSpec, fused_params
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._chunks import LoadPlanner, LocalChunks, SavePlanner
from shardbridge.checkpoint._commit import commit, new_tmp_dir
from shardbridge.checkpoint._load import TrainState, _check_compatible
from shardbridge.checkpoint._manifest import check_json_extra, read_manifest
from shardbridge.checkpoint._rng import restore_rng, save_rng
from shardbridge.checkpoint._save import _manifest
from shardbridge.checkpoint._state import (
    MODEL_KEY,
    OPTIM_KEY,
    PortableState,
    _fused_pieces,
    _fused_tp_size,
    _placements_record,
    component_fqn,
)
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["DistParam", "dist_params", "load", "local_box", "save"]

Pieces = list[tuple[tuple[int, ...], torch.Tensor]]


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
        return self.param._local_tensor

    def pieces(self, local: torch.Tensor) -> dict[str, Pieces]:
        """``{key-suffix: pieces}``: ``{"": [...]}`` for a plain param, one entry per component
        (``{component: [...]}``) for a fused one. ``local`` is shaped like this rank's shard."""
        if self.spec is None:
            return {"": [(self.offsets, local)] if local.numel() else []}
        box = (tuple(local.shape), self.offsets)
        return _fused_pieces(self.spec, local, box, _fused_tp_size(self.fqn, self.param, self.spec))


def _mfsdp(model: nn.Module) -> Any:
    from shardbridge_megatron_fsdp._compat import require_megatron_fsdp

    mfsdp = require_megatron_fsdp()
    if not isinstance(model, mfsdp.MegatronFSDP):
        raise ValueError(
            f"model must be the MegatronFSDP module shard_model returned, got {type(model).__name__}; "
            "for torch-FSDP2 models use shardbridge.checkpoint.save / load"
        )
    return model


def local_box(param: DTensor) -> tuple[int, ...]:
    """Global offsets of a Megatron-FSDP distributed parameter's local tensor.

    Read from the chunk metadata Megatron-FSDP recorded on the local tensor, or (``no_shard``
    parameters carry none) computed with its own gather; a collective in that case, so call
    it for the same parameters in the same order on every rank. See
    [Note: Megatron-FSDP state as boxes].
    """
    chunk_list = getattr(param._local_tensor, "__create_chunk_list__", None)
    if chunk_list is not None:
        meta = chunk_list()[0]
    else:
        from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

        meta = gather_and_compute_chunk_metadata(param)
    return tuple(int(o) for o in meta.offsets)


def dist_params(model: nn.Module) -> list[DistParam]:
    """Every distributed parameter of a MegatronFSDP model with its box, in a fixed order."""
    model = _mfsdp(model)
    model._replace_param_with_distributed_if_needed()
    fused = fused_params(model.module)
    out = []
    for fqn, param in model.param_and_grad_buffer.optimizer_named_parameters:
        assert isinstance(param, DTensor), (fqn, type(param))
        out.append(DistParam(fqn, param, local_box(param), fused.get(fqn)))
    return out


def _names(dp: DistParam) -> dict[str, str]:
    """key-suffix (see DistParam.pieces) -> stored FQN."""
    if dp.spec is None:
        return {"": dp.fqn}
    return {name: component_fqn(dp.fqn, name) for name in dp.spec.names}


def _shard_like(dp: DistParam, value: Any) -> torch.Tensor | None:
    """The local tensor of an optimizer state shaped like the parameter's shard, else None.

    DTensor states (torch optimizers on DTensor params) and plain local tensors (fused
    optimizers such as TE's FusedAdam) both qualify; see [Note: item coordinates] in the
    core's ``_fused.py`` for why plain ones must not be split by their own size.
    """
    if isinstance(value, DTensor):
        if tuple(value.shape) == dp.shape and tuple(value._local_tensor.shape) == tuple(dp.local.shape):
            return value._local_tensor.detach()
        return None
    if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(dp.local.shape):
        return value.detach()
    return None


def _state_keys(optimizer: torch.optim.Optimizer, params: list[DistParam]) -> dict[str, dict[str, bool]]:
    """fqn -> {state key: is shard-shaped}, agreed on by all ranks (some ranks hold no state)."""
    local: dict[str, dict[str, bool]] = {}
    for dp in params:
        state = optimizer.state.get(dp.param, {})
        local[dp.fqn] = {k: _shard_like(dp, v) is not None for k, v in state.items()}
    if not _dist.is_distributed():
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


@dataclass
class _Built:
    dcp_state: dict[str, dict[str, Any]]
    tensors: dict[str, dict[str, Any]]
    fused: dict[str, dict[str, Any]]
    scalars: list[tuple[DistParam, str, str]]
    """(param, state key, DCP key) of scalar states loaded into throwaway or live tensors."""
    groups: list[tuple[dict[str, Any], str, str]]
    """(param group, hyperparameter, DCP key) for non-tensor values DCP replaces on load."""


def _build(model: nn.Module, optimizer: torch.optim.Optimizer | None, *, for_load: bool) -> _Built:
    params = dist_params(model)
    model_state: dict[str, Any] = {}
    built = _Built({MODEL_KEY: model_state}, {}, {}, [], [])
    for dp in params:
        pieces = dp.pieces(dp.local.detach())
        for suffix, name in _names(dp).items():
            shape = dp.shape if dp.spec is None else tuple(dp.spec.component_shape(suffix, dp.shape))
            model_state[name] = LocalChunks(shape, pieces[suffix])
        built.tensors[dp.fqn] = _placements_record(dp.param, "repaired" if dp.spec is None else "components")
        if dp.spec is not None:
            built.fused[dp.fqn] = {
                "dim": dp.spec.dim,
                "tp_size": _fused_tp_size(dp.fqn, dp.param, dp.spec),
                "components": [{"name": n, "size": s, "fqn": component_fqn(dp.fqn, n)} for n, s in dp.spec.components],
            }
    if optimizer is None:
        return built
    optim_state: dict[str, Any] = {}
    built.dcp_state[OPTIM_KEY] = optim_state
    keys = _state_keys(optimizer, params)
    for dp in params:
        state = optimizer.state.get(dp.param, {})
        for key, shard_shaped in keys[dp.fqn].items():
            value = state.get(key)
            if shard_shaped:
                local = _shard_like(dp, value) if value is not None else None
                pieces = dp.pieces(local) if local is not None else {s: [] for s in _names(dp)}
                for suffix, name in _names(dp).items():
                    shape = dp.shape if dp.spec is None else tuple(dp.spec.component_shape(suffix, dp.shape))
                    optim_state[f"state.{name}.{key}"] = LocalChunks(shape, pieces[suffix])
                continue
            for name in _names(dp).values():
                dcp_key = f"state.{name}.{key}"
                if value is None and not for_load:
                    continue  # some other rank holds this state; it writes the value
                if value is None:
                    optim_state[dcp_key] = torch.zeros(())  # throwaway: this rank has no state here
                elif isinstance(value, torch.Tensor):
                    optim_state[dcp_key] = value.detach() if not for_load else value
                    built.scalars.append((dp, key, dcp_key))
                else:
                    optim_state[dcp_key] = value
                    built.scalars.append((dp, key, dcp_key))
    by_param = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for dp in params:
        group = by_param.get(id(dp.param))
        if group is None:
            raise ValueError(
                f"parameter {dp.fqn!r} is not in any optimizer param group; build the optimizer over "
                "model.parameters() before shard_model, or pass optimizer=None"
            )
        for hyper, value in group.items():
            if hyper == "params":
                continue
            for name in _names(dp).values():
                optim_state[f"param_groups.{name}.{hyper}"] = value
                built.groups.append((group, hyper, f"param_groups.{name}.{hyper}"))
    return built


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Save a Megatron-FSDP model (and optimizer) as a shardbridge checkpoint. Call on every rank.

    The checkpoint has the core's format (see ``shardbridge.checkpoint``): it loads with
    ``shardbridge.checkpoint.load`` into torch-FSDP2 / TP / single-process models of any
    layout, exports with ``shardbridge.checkpoint.export_safetensors``, and loads back into
    Megatron-FSDP with :func:`load`. Fused parameters (registered with
    ``shardbridge.register_fused``) are stored as their components. See
    [Note: Megatron-FSDP state as boxes].

    Args:
        path: the checkpoint directory to create (e.g. ``shardbridge.checkpoint.step_dir``).
        model: the MegatronFSDP module :func:`~shardbridge_megatron_fsdp.shard_model` returned.
        optimizer: its optimizer (as returned by ``shard_model``), or None.
        step: training step for the manifest.
        extra: JSON-serialisable user state.
        overwrite: replace an existing checkpoint at ``path``.

    Returns:
        The committed checkpoint directory.

    Example:
        >>> from shardbridge.checkpoint import step_dir
        >>> save(step_dir("/ckpt", 10), model=model, optimizer=opt, step=10)  # doctest: +SKIP
    """
    final = Path(path)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be an int >= 0 or None")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of JSON values, got {type(extra).__name__}")
    check_json_extra(extra)
    rank, world_size = _dist.rank(), _dist.world_size()
    built = _build(model, optimizer, for_load=False)
    tmp = _dist.on_all_ranks(new_tmp_dir, final, overwrite=overwrite, only_rank0=True)
    tmp = _dist.broadcast_from_rank0(tmp)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(
                built.dcp_state,
                storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                planner=SavePlanner(),
                no_dist=not _dist.is_distributed(),
            )
        _dist.on_all_ranks(save_rng, tmp, rank)
        core_state = PortableState(
            dcp_state=built.dcp_state, model_sd={}, optim_sd=None, tensors=built.tensors, fused=built.fused
        )
        manifest = _manifest(core_state, step=step, extra=extra, world_size=world_size, parallel_dims=None)
        _dist.on_all_ranks(commit, tmp, final, manifest, overwrite=overwrite, only_rank0=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    rng: bool = True,
) -> TrainState:
    """Load a shardbridge checkpoint (from Megatron-FSDP, torch FSDP2, TP, one process) into a
    Megatron-FSDP model, in place. Call on every rank.

    Handles what a plain ``dcp.load`` leaves to the user: the loaded main weights are
    copied into Megatron-FSDP's compute weights (``install_optimized_model_weights``; the
    upstream recipe is ``model.load_state_dict`` after ``dcp.load``), and optimizer
    hyperparameters are written back into the param groups.

    Args:
        path: the checkpoint directory.
        model: the MegatronFSDP module from :func:`~shardbridge_megatron_fsdp.shard_model`.
        optimizer: its optimizer, or None to load the model only.
        strict: keys of model/optimizer and checkpoint must be the same.
        rng: restore torch RNG states.

    Returns:
        The checkpoint's :class:`~shardbridge.checkpoint.TrainState`.

    Example:
        >>> state = load(latest("/ckpt"), model=model, optimizer=opt)  # doctest: +SKIP
    """
    path = Path(path)
    manifest = _dist.on_all_ranks(read_manifest, path)
    assert manifest is not None
    if optimizer is not None and not manifest.has_optimizer:
        raise ValueError(
            f"checkpoint {str(path)!r} has no optimizer state (it was saved with optimizer=None); "
            "pass optimizer=None to load the model only"
        )
    built = _build(model, optimizer, for_load=True)
    core_state = PortableState(dcp_state=built.dcp_state, model_sd={}, optim_sd=None)
    _dist.on_all_ranks(_check_compatible, path, core_state, strict=strict)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            built.dcp_state,
            storage_reader=dcp.FileSystemReader(path),
            planner=LoadPlanner(allow_partial_load=not strict),
            no_dist=not _dist.is_distributed(),
        )
    if optimizer is not None:
        optim_state = built.dcp_state[OPTIM_KEY]
        for dp, key, dcp_key in built.scalars:
            value = optim_state[dcp_key]
            if not isinstance(value, torch.Tensor):
                optimizer.state[dp.param][key] = value
        for group, hyper, dcp_key in built.groups:
            if dcp_key in optim_state:
                group[hyper] = optim_state[dcp_key]
    # The loaded values sit in the main (optimizer) weights; forward uses the compute weights.
    _mfsdp(model).install_optimized_model_weights()
    if rng:
        _dist.on_all_ranks(restore_rng, path, _dist.rank(), _dist.world_size(), manifest.world_size)
    return TrainState(step=manifest.step, extra=manifest.extra, path=path, world_size=manifest.world_size)


def iter_local_values(model: nn.Module) -> Iterator[tuple[DistParam, torch.Tensor]]:
    """(param, local tensor) pairs, for tests and the precision setup."""
    for dp in dist_params(model):
        yield dp, dp.local
