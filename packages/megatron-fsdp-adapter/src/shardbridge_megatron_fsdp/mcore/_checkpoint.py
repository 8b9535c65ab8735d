"""Megatron-Core models under Megatron-Core's Megatron-FSDP through shardbridge checkpoints.

The same design as the standalone adapter's checkpoints ([Note: Megatron-FSDP state as boxes]
in ``shardbridge_megatron_fsdp._checkpoint``), for Megatron-Core's bundled Megatron-FSDP: the
provider hands the core the distributed (main) parameters and their optimizer states under
the GPTModel's FQNs with the box Megatron-FSDP records for each local tensor; the core splits
fused ``linear_qkv`` (Megatron's per-group order, [Note: Megatron QKV order]) and SwiGLU
``linear_fc1`` into components in item coordinates, for DTensor and plain-tensor optimizer
states alike, and commits its own format. So a dp2 x tp2 checkpoint loads at dp4, tp4, tp1
or into a torch-FSDP2 model, bit-exact, and exports to Hugging Face safetensors.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from shardbridge import FusedSpec, fused_params
from shardbridge import checkpoint as core
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardbridge_megatron_fsdp._checkpoint import DistParam, MegatronFSDPStateDicts
from shardbridge_megatron_fsdp.mcore._compat import (
    chunk_offsets,
    optimizer_named_parameters,
    replace_params_with_distributed,
)
from shardbridge_megatron_fsdp.mcore._layout import MegatronQKVSpec

__all__ = ["McoreFSDPStateDicts", "dist_params", "fused_tp", "load", "save"]


def _inner(model: nn.Module) -> Any:
    """The bundled ``MegatronFSDP`` module inside Megatron-Core's ``FullyShardedDataParallel``."""
    from megatron.core.distributed import FullyShardedDataParallel

    if not isinstance(model, FullyShardedDataParallel):
        raise ValueError(
            f"model must be the FullyShardedDataParallel module shard_model returned, got {type(model).__name__}; "
            "for torch-FSDP2 models use shardbridge.checkpoint.save / load"
        )
    return model.module


def dist_params(model: nn.Module) -> list[DistParam]:
    """Every distributed parameter of a wrapped Megatron-Core model with its box, in a fixed order."""
    inner = _inner(model)
    replace_params_with_distributed(inner)
    fused = fused_params(inner.module)
    out = []
    for fqn, param in optimizer_named_parameters(inner):
        assert isinstance(param, DTensor), (fqn, type(param))
        out.append(DistParam(fqn, param, chunk_offsets(param), fused.get(fqn)))
    return out


def fused_tp(dp: DistParam) -> int:
    """The TP degree that interleaves a fused parameter's items (1 for Megatron QKV's fixed order)."""
    spec: FusedSpec | None = dp.spec
    if spec is None or isinstance(spec, MegatronQKVSpec):
        return 1
    tp = 1
    names = dp.param.device_mesh.mesh_dim_names or ()
    for name, size, p in zip(names, dp.param.device_mesh.shape, dp.param.placements):
        if name == "tp" and type(p) is Shard and p.dim == spec.dim:
            tp *= size
    return tp


def _agree_on_step(optimizer: torch.optim.Optimizer, params: list[DistParam]) -> None:
    """Give every rank the optimizer ``step`` of the ranks that hold the parameter's data.

    A rank whose shard of a parameter is empty gets no gradient for it, so torch optimizers
    never step it there and its ``step`` stays 0 while the ranks holding data count on. The
    value is the same scalar on every rank in the checkpoint (DCP writes one rank's copy),
    so before a save each ``step`` becomes the maximum over ranks (measured: without this a
    dp2 x tp2 checkpoint stored step 0 for 8 of 21 parameters after 2 steps, and a resharded
    load then restarted Adam's bias correction for them).
    """
    import torch.distributed as dist

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


class McoreFSDPStateDicts(MegatronFSDPStateDicts):
    """The :class:`~shardbridge.checkpoint.StateDictProvider` of a Megatron-Core FSDP model.

    The standalone adapter's provider ([Note: Megatron-FSDP state as boxes]) with Megatron-Core's
    bundled copy plugged in: its parameters and boxes, ``step`` agreed over ranks before a save
    (:func:`_agree_on_step`), its ``install_optimized_model_weights`` after a load.

    Example:
        >>> checkpoint.save(path, model=model, optimizer=opt, state_dicts=McoreFSDPStateDicts())  # doctest: +SKIP
    """

    def dist_params(self, model: nn.Module) -> list[DistParam]:
        """Megatron-Core's distributed parameters (:func:`dist_params`)."""
        return dist_params(model)

    def before_save(self, optimizer: torch.optim.Optimizer, params: list[DistParam]) -> None:
        """Every rank's ``step`` becomes the maximum over ranks (:func:`_agree_on_step`)."""
        _agree_on_step(optimizer, params)

    def install_weights(self, model: nn.Module) -> None:
        """The bundled ``MegatronFSDP``'s ``install_optimized_model_weights``."""
        _inner(model).install_optimized_model_weights()


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Save a wrapped Megatron-Core model (and optimizer) as a shardbridge checkpoint. Call on every rank.

    Args:
        path: the checkpoint directory to create.
        model: the ``FullyShardedDataParallel`` module :func:`shard_model` returned.
        optimizer: its optimizer, or None.
        step: training step for the manifest.
        extra: JSON-serialisable user state.
        overwrite: replace an existing checkpoint at ``path``.

    Returns:
        The committed checkpoint directory.

    Example:
        >>> save(step_dir("/ckpt", 10), model=model, optimizer=opt, step=10)  # doctest: +SKIP
    """
    _inner(model)
    return core.save(
        path, model=model, optimizer=optimizer, step=step, extra=extra, overwrite=overwrite,
        state_dicts=McoreFSDPStateDicts(),
    )  # fmt: skip


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    rng: bool = True,
) -> core.TrainState:
    """Load a shardbridge checkpoint (any layout, any framework) into a wrapped Megatron-Core model.

    Args:
        path: the checkpoint directory.
        model: the ``FullyShardedDataParallel`` module :func:`shard_model` returned.
        optimizer: its optimizer, or None to load the model only.
        strict: keys of model/optimizer and checkpoint must be the same.
        rng: restore torch RNG states.

    Returns:
        The checkpoint's :class:`~shardbridge.checkpoint.TrainState`.

    Example:
        >>> load(latest("/ckpt"), model=model, optimizer=opt)  # doctest: +SKIP
    """
    _inner(model)
    return core.load(path, model=model, optimizer=optimizer, strict=strict, rng=rng, state_dicts=McoreFSDPStateDicts())
