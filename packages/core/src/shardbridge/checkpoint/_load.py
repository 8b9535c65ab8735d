"""``load`` / ``load_latest``: a checkpoint into any layout of a compatible model."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._chunks import LoadPlanner
from shardbridge.checkpoint._commit import latest
from shardbridge.checkpoint._manifest import read_manifest
from shardbridge.checkpoint._provider import StateDictProvider, check_provider
from shardbridge.checkpoint._rng import restore_rng
from shardbridge.checkpoint._state import (
    MODEL_KEY,
    OPTIM_KEY,
    PortableState,
    build_portable_state,
    finish_load,
    unpack_param_groups,
)

__all__ = ["TrainState", "load", "load_latest"]

_MAX_NAMES = 5


@dataclass(frozen=True, kw_only=True)
class TrainState:
    """The training state a checkpoint restores besides model and optimizer.

    Example:
        >>> state = load(latest(root), model=model, optimizer=opt)  # doctest: +SKIP
        >>> start_step = (state.step or 0) + 1  # doctest: +SKIP
    """

    step: int | None
    """The ``step`` given to ``save`` (None if none was)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The ``extra`` dict given to ``save``."""
    path: Path
    """The checkpoint directory loaded."""
    world_size: int
    """Number of ranks that saved the checkpoint."""


def load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    rng: bool = True,
    state_dicts: StateDictProvider | None = None,
) -> TrainState:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``), in place.

    Works across layouts: a checkpoint saved with any mix of FSDP2 / HSDP / TP degrees (or in
    one process) loads into any other, fused parameters included (their components are
    stored, so a different TP degree re-interleaves them). Call on every rank, after the
    model is parallelized and materialised (not on the meta device) and the optimizer built;
    an optimizer without state gets it from one zero-gradient step first (torch's
    ``get_state_dict`` does this), then the saved state overwrites it.

    Args:
        path: a checkpoint directory (see :func:`latest`).
        model: the model to fill.
        optimizer: its optimizer, or None to load the model only (the checkpoint's optimizer
            state, if any, is ignored).
        strict: require that the model's (and optimizer's) keys and the checkpoint's are the
            same; False loads the keys both have. Shapes must match either way.
        rng: restore the torch RNG states (each rank its own when the world size matches,
            else rank 0's on every rank, with a warning).
        state_dicts: a framework's :class:`StateDictProvider`, as in :func:`save`; its
            ``load_state_dicts`` runs after DCP instead of torch's ``set_state_dict``.

    Returns:
        The :class:`TrainState` (step, extra).

    Raises:
        ValueError: missing path, not a shardbridge checkpoint, damaged manifest, keys that
            do not match (the first few are named), or a shape mismatch. Raised on every rank.

    Example:
        >>> state = load(step_dir(root, 100), model=model, optimizer=opt)  # doctest: +SKIP
        >>> state.step  # doctest: +SKIP
        100
    """
    path = Path(path)
    check_provider(state_dicts)
    manifest = _dist.on_all_ranks(read_manifest, path)
    assert manifest is not None
    if optimizer is not None and not manifest.has_optimizer:
        raise ValueError(
            f"checkpoint {str(path)!r} has no optimizer state (it was saved with optimizer=None); "
            "pass optimizer=None to load the model only"
        )
    state = _dist.on_all_ranks(
        build_portable_state, model, optimizer, on_bad_layout="repair", log=False, provider=state_dicts, for_load=True
    )
    assert state is not None
    if manifest.format_version < 2:
        unpack_param_groups(state)  # format 1 stored each param_groups entry alone
    _dist.on_all_ranks(_check_compatible, path, state, strict=strict)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state.dcp_state,
            storage_reader=dcp.FileSystemReader(path),
            planner=LoadPlanner(allow_partial_load=not strict),
            no_dist=not _dist.is_distributed(),
        )
    _dist.on_all_ranks(finish_load, state, model, optimizer, strict=strict, provider=state_dicts)
    if rng:
        _dist.on_all_ranks(restore_rng, path, _dist.rank(), _dist.world_size(), manifest.world_size)
    return TrainState(step=manifest.step, extra=manifest.extra, path=path, world_size=manifest.world_size)


def load_latest(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    rng: bool = True,
    state_dicts: StateDictProvider | None = None,
) -> TrainState | None:
    """:func:`load` the newest complete checkpoint under ``root``; None (nothing loaded) if none.

    Rank 0 picks the directory (:func:`latest`) and every rank loads that one.

    Example:
        >>> state = load_latest("/shared/ckpt", model=model, optimizer=opt)  # doctest: +SKIP
        >>> start_step = 0 if state is None or state.step is None else state.step + 1  # doctest: +SKIP
    """
    path = _dist.broadcast_from_rank0(latest(root) if _dist.rank() == 0 else None)
    if path is None:
        return None
    return load(path, model=model, optimizer=optimizer, strict=strict, rng=rng, state_dicts=state_dicts)


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_NAMES])
    return shown + (f", ... ({len(keys) - _MAX_NAMES} more)" if len(keys) > _MAX_NAMES else "")


def _check_compatible(path: Path, state: PortableState, *, strict: bool) -> None:
    """ValueError naming missing / unexpected keys and shape mismatches before DCP runs."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    ours, _ = flatten_state_dict(state.dcp_state)
    tops = tuple(f"{top}." for top in state.dcp_state)
    missing = [k for k in ours if k not in saved]
    unexpected = [k for k in saved if k.startswith(tops) and k not in ours]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} key(s) of the model are not in the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} key(s) of the checkpoint are not in the model: {_names(unexpected)}")
        raise ValueError(
            f"checkpoint {str(path)!r} does not fit this model: {'; '.join(parts)}. Build the model the "
            "checkpoint was saved from (same architecture, module names and fused specs; "
            f"{MODEL_KEY}.* are model keys, {OPTIM_KEY}.* optimizer keys), or pass strict=False to load the "
            "keys both have"
        )
    for key, value in ours.items():
        md = saved.get(key)
        if md is None:
            continue
        is_tensor = hasattr(value, "size") and callable(value.size)
        if isinstance(md, TensorStorageMetadata) and is_tensor:
            if tuple(md.size) != tuple(value.size()):
                raise ValueError(
                    f"shape mismatch for {key!r}: checkpoint {tuple(md.size)}, model {tuple(value.size())}; "
                    "build the model with the configuration the checkpoint was saved with"
                )
        elif isinstance(md, TensorStorageMetadata) != is_tensor:
            kind = "a tensor" if isinstance(md, TensorStorageMetadata) else "a non-tensor value"
            assert isinstance(md, (TensorStorageMetadata, BytesStorageMetadata))
            raise ValueError(
                f"{key!r} is {kind} in the checkpoint but {'not ' if is_tensor is False else ''}a tensor in "
                "the model; the checkpoint comes from a different model or optimizer type"
            )
