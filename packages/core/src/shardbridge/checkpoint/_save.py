"""``save``: model + optimizer + training state into one atomic checkpoint directory."""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

import shardbridge
from shardbridge._mesh import ParallelDims
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._chunks import SavePlanner
from shardbridge.checkpoint._commit import abandon, commit, new_tmp_dir
from shardbridge.checkpoint._errors import dcp_errors
from shardbridge.checkpoint._integrity import record_files
from shardbridge.checkpoint._manifest import RNG_PATTERN, Manifest, check_json_extra, utc_now
from shardbridge.checkpoint._provider import StateDictProvider, check_provider
from shardbridge.checkpoint._rng import save_rng
from shardbridge.checkpoint._state import OPTIM_KEY, OnBadLayout, PortableState, build_portable_state

__all__ = ["save"]


def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: dict[str, Any] | None = None,
    overwrite: bool = False,
    on_bad_layout: OnBadLayout = "repair",
    parallel_dims: ParallelDims | None = None,
    state_dicts: StateDictProvider | None = None,
) -> Path:
    """Save a checkpoint to the directory ``path``, atomically. Call on every rank.

    Saves the model and optimizer through torch's ``get_state_dict`` (the model's own FQNs,
    optimizer state flattened per parameter), every rank's torch RNG state, ``step`` and
    ``extra``. Fused parameters and their optimizer states are stored as their components,
    and DTensors whose layout DCP would describe wrongly are repaired (see
    :mod:`shardbridge.checkpoint._state`). The directory appears only when complete (see
    [Note: atomic commit] in ``_commit.py``). With several nodes, ``path`` must be on a
    filesystem every node shares.

    Args:
        path: the checkpoint directory to create, e.g. ``step_dir(root, step)``; its parent
            is created if needed.
        model: the model (plain, TP, FSDP2, HSDP ...).
        optimizer: its optimizer; None saves the model only.
        step: the training step, recorded in the manifest; None = no step.
        extra: JSON-serialisable user state (data-loader position, config ...).
        overwrite: replace an existing checkpoint at ``path``.
        on_bad_layout: "repair" (default) writes explicit chunk boxes for DTensors DCP
            describes wrongly (logged once per tensor); "error" raises instead.
        parallel_dims: the run's :class:`~shardbridge.ParallelDims`, recorded in the manifest
            (optional; the mesh axes seen on the DTensors are always recorded).
        state_dicts: a framework's :class:`StateDictProvider` (its own state dicts and the
            true boxes of its DTensors' local tensors), for frameworks torch's
            ``get_state_dict`` or the placements do not describe (Megatron-FSDP); None =
            torch's. See [Note: state-dict providers] in ``_provider.py``.

    Returns:
        The committed checkpoint directory.

    Raises:
        ValueError: ``path`` exists (without ``overwrite``), ``extra`` is not JSON, a bad
            layout DCP cannot describe (or any with ``on_bad_layout="error"``). Raised on
            every rank.

    Example:
        >>> root = "/shared/ckpt"  # doctest: +SKIP
        >>> save(step_dir(root, 100), model=model, optimizer=opt, step=100,
        ...      extra={"tokens_seen": 123})  # doctest: +SKIP
    """
    final = Path(path)
    # Checked on every rank together: one rank's bad argument must not leave the others
    # waiting in a collective. See [Note: symmetric errors] in _dist.py.
    extra = _dist.on_all_ranks(_check_args, step=step, extra=extra, parallel_dims=parallel_dims, provider=state_dicts)
    assert extra is not None
    _dist.check_same_on_all_ranks(
        "shardbridge.checkpoint.save",
        {"path": str(path), "step": step, "extra": extra, "overwrite": overwrite, "on_bad_layout": on_bad_layout,
         "optimizer": optimizer is not None, "parallel_dims": parallel_dims},
    )  # fmt: skip
    rank, world_size = _dist.rank(), _dist.world_size()

    # 1. The portable state dict: layouts checked, fused params split.
    state = _dist.on_all_ranks(
        build_portable_state, model, optimizer, on_bad_layout=on_bad_layout, log=rank == 0, provider=state_dicts
    )
    assert state is not None
    # 2. Rank 0 creates the temporary directory.
    tmp = _dist.on_all_ranks(new_tmp_dir, final, overwrite=overwrite, only_rank0=True)
    tmp = _dist.broadcast_from_rank0(tmp)
    try:
        # 3. Every rank writes its DCP files and RNG file; DCP fsyncs and synchronises.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            with dcp_errors("save", final, data_dir=tmp):  # see [Note: DCP errors]
                dcp.save(
                    state.dcp_state,
                    storage_writer=dcp.FileSystemWriter(tmp, sync_files=True),
                    planner=SavePlanner(),
                    no_dist=not _dist.is_distributed(),
                )
        _dist.on_all_ranks(save_rng, tmp, rank)
        # 4. Every rank hashes its files; rank 0 gets every record ([Note: checkpoint integrity]).
        files = record_files(tmp)
        # 5. Rank 0 writes the manifest (the commit point) and renames; every rank learns the outcome.
        manifest = _manifest(
            state, step=step, extra=extra, world_size=world_size, parallel_dims=parallel_dims, files=files or {}
        )
        _dist.on_all_ranks(commit, tmp, final, manifest, overwrite=overwrite, only_rank0=True)
    except BaseException:
        if rank == 0:
            abandon(tmp, final)  # deletes tmp unless it is the only complete copy: [Note: atomic commit]
        raise
    return final


def _check_args(
    *,
    step: int | None,
    extra: dict[str, Any] | None,
    parallel_dims: ParallelDims | None,
    provider: StateDictProvider | None,
) -> dict[str, Any]:
    """ValueError for a bad argument of :func:`save`; returns ``extra`` ({} for None)."""
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be an int >= 0 or None")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of JSON values, got {type(extra).__name__}")
    check_json_extra(extra)
    if parallel_dims is not None and not isinstance(parallel_dims, ParallelDims):
        raise ValueError(f"parallel_dims must be a shardbridge.ParallelDims, got {type(parallel_dims).__name__}")
    check_provider(provider)
    return extra


def _manifest(
    state: PortableState,
    *,
    step: int | None,
    extra: dict[str, Any],
    world_size: int,
    parallel_dims: ParallelDims | None,
    files: dict[str, dict[str, Any]],
) -> Manifest:
    mesh_axes: dict[str, int] = {}
    for record in state.tensors.values():
        mesh_axes.update(record["mesh"])
    dims = None if parallel_dims is None else dataclasses.asdict(parallel_dims)
    return Manifest(
        step=step,
        world_size=world_size,
        has_optimizer=OPTIM_KEY in state.dcp_state,
        layout={"parallel_dims": dims, "mesh_axes": mesh_axes, "tensors": state.tensors},
        fused=state.fused,
        extra=extra,
        rng={"world_size": world_size, "files": RNG_PATTERN},
        torch_version=torch.__version__,
        shardbridge_version=shardbridge.__version__,
        created=utc_now(),
        files=files,
    )
