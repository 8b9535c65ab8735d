"""``save``: model + optimizer + training state into one atomic checkpoint directory."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import nn

import shardbridge
from shardbridge._mesh import ParallelDims
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._async import (
    AsyncSave,
    IfBusy,
    finish_previous,
    stage_state,
    start_async,
    writer_group_state,
)
from shardbridge.checkpoint._protocol import DCPSave, SaveProtocol
from shardbridge.checkpoint.derived import DerivedSave
from shardbridge.checkpoint.state._provider import StateDictProvider, check_provider
from shardbridge.checkpoint.state._rng import rng_bytes, rng_states
from shardbridge.checkpoint.state._stage import Pending
from shardbridge.checkpoint.state._state import OPTIM_KEY, OnBadLayout, PortableState, build_portable_state
from shardbridge.checkpoint.storage._backend import Target
from shardbridge.checkpoint.storage._errors import save_failure
from shardbridge.checkpoint.storage._fsspec import PART_BYTES
from shardbridge.checkpoint.storage._integrity import merge_records
from shardbridge.checkpoint.storage._location import Location, locate
from shardbridge.checkpoint.storage._manifest import (
    DERIVED_KEY,
    OPTIM_STATE_ABSENT,
    RNG_PATTERN,
    Manifest,
    check_json_extra,
    rng_file,
    utc_now,
)
from shardbridge.checkpoint.storage._writer import Writer

__all__ = ["FILES_PER_RANK", "PROTOCOLS", "SaveJob", "save", "write_and_commit"]

PROTOCOLS: dict[str, type[SaveProtocol]] = {"derived": DerivedSave, "dcp": DCPSave}
"""``save(protocol=...)``'s names. See [Note: save protocols] in ``_protocol.py``."""

FILES_PER_RANK = {False: 1, True: 4}
"""Data files each rank writes concurrently (DCP's ``thread_count``), local disk / object store:
on an object store, uploads in flight per rank (one per ``PART_BYTES`` of the rank's tensors, up
to this many). Measured: docs/benchmarks.md, object store."""


@overload
def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    step: int | None = ...,
    extra: dict[str, Any] | None = ...,
    overwrite: bool = ...,
    on_bad_layout: OnBadLayout = ...,
    parallel_dims: ParallelDims | None = ...,
    state_dicts: StateDictProvider | None = ...,
    async_: Literal[False] = ...,
    if_busy: IfBusy = ...,
    protocol: str | SaveProtocol = ...,
) -> Path | str: ...


@overload
def save(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = ...,
    step: int | None = ...,
    extra: dict[str, Any] | None = ...,
    overwrite: bool = ...,
    on_bad_layout: OnBadLayout = ...,
    parallel_dims: ParallelDims | None = ...,
    state_dicts: StateDictProvider | None = ...,
    async_: Literal[True],
    if_busy: IfBusy = ...,
    protocol: str | SaveProtocol = ...,
) -> AsyncSave: ...


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
    async_: bool = False,
    if_busy: IfBusy = "wait",
    protocol: str | SaveProtocol = "derived",
) -> Path | str | AsyncSave:
    """Save a checkpoint to the directory ``path``, atomically. Call on every rank.

    Saves the model and optimizer through torch's ``get_state_dict`` (the model's own FQNs,
    optimizer state flattened per parameter), every rank's torch RNG state, ``step`` and
    ``extra``. Fused parameters and their optimizer states are stored as their components,
    DTensors whose layout DCP would describe wrongly are repaired (see
    :mod:`shardbridge.checkpoint.state._state`), and a tensor held under several names (tied
    embeddings) is stored once. The checkpoint appears only when complete (see
    [Note: atomic commit] in ``storage/_local.py``, [Note: object-store commit] in
    ``storage/_fsspec.py``). With several nodes, ``path`` must be on a filesystem every node
    shares, or an object store.

    With ``async_=True`` the call returns once the state is copied to host memory; a
    background thread writes and commits it (see [Note: async save] in ``_async.py``), and
    training may change the model meanwhile. At most one save is in flight: the next
    :func:`save` (or :func:`wait`) first waits for it, and raises its error if it failed.

    Args:
        path: the checkpoint directory to create, e.g. ``step_dir(root, step)``; its parent
            is created if needed. A URI saves to an object store (``s3://bucket/ckpt/step-00000100``,
            ``gs://``, ``az://``; the ``s3`` extra) or local disk (``file://``).
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
        async_: False (default) returns when the checkpoint is committed; True returns an
            :class:`AsyncSave` as soon as the state is staged in host memory.
        if_busy: what this save does while a previous asynchronous save is still in flight:
            "wait" (default) for it to finish, "error" raises ``RuntimeError`` (nothing of
            this save is done; the previous one goes on).
        protocol: how the ranks coordinate: "derived" (default: plans and records derived
            from the mesh, constant-size rounds at any world size) or "dcp" (``dcp.save`` with
            its plan caching); or a protocol object, which may keep state from one save to the
            next. See [Note: save protocols] in ``_protocol.py``.

    Returns:
        The committed checkpoint directory (a ``Path``; the URI for a URI ``path``), or
        (``async_=True``) the :class:`AsyncSave` whose ``wait()`` returns it.

    Raises:
        ValueError: ``path`` exists (without ``overwrite``), ``extra`` is not JSON, a bad
            layout DCP cannot describe (or any with ``on_bad_layout="error"``), a rank-local
            tensor (:func:`mark_rank_local`) no ``state_dicts`` provider took over. Raised on
            every rank.
        RuntimeError: ``if_busy="error"`` and a save is in flight; or the previous
            asynchronous save failed (its error, naming the checkpoint and cause).

    Example:
        >>> root = "/shared/ckpt"  # doctest: +SKIP
        >>> save(step_dir(root, 100), model=model, optimizer=opt, step=100,
        ...      extra={"tokens_seen": 123})  # doctest: +SKIP
        >>> pending = save(step_dir(root, 200), model=model, optimizer=opt, step=200,
        ...                async_=True)  # doctest: +SKIP
        >>> pending.wait()  # doctest: +SKIP
    """
    with _dist.entry():  # an error on any rank, anywhere, raises on every rank: [Note: collective entry points]
        where = locate(path)
        if not isinstance(async_, bool):
            raise ValueError(f"async_={async_!r} must be True (write in the background) or False")
        if if_busy not in ("wait", "error"):
            raise ValueError(f"if_busy={if_busy!r} must be 'wait' (for the save in flight) or 'error'")
        # 0. At most one save in flight; the previous one's error surfaces here.
        finish_previous(if_busy)
        rank = _dist.rank()
        protocol = _protocol_of(protocol)
        # 1. Arguments checked, the portable state built (layouts checked, fused params split,
        # FP8 made plain) and, for async_, staged to host memory: one round in which every rank
        # also compares its arguments. See [Note: symmetric errors] in _dist.py.
        same = {"path": str(path), "step": step, "extra": {} if extra is None else extra, "overwrite": overwrite,
                "on_bad_layout": on_bad_layout, "optimizer": optimizer is not None, "parallel_dims": parallel_dims,
                "async_": async_, "protocol": protocol.name}  # fmt: skip
        # 2. In the same round, rank 0 begins the save on the backend (recovery, checks, the
        # temporary location: undone below if another rank failed) and every rank learns where to
        # write; the protocol's local step rides along ([Note: save protocols] in _protocol.py), except in
        # an asynchronous save, whose writer runs it: there the round agrees on the writer group instead.
        begun: list[Target] = []
        try:
            (prepared, target), _, agreed = _dist.one_round(
                _prepare,
                (model, optimizer),
                {
                    "step": step,
                    "extra": extra,
                    "parallel_dims": parallel_dims,
                    "provider": state_dicts,
                    "on_bad_layout": on_bad_layout,
                    "log": rank == 0,
                    "stage": async_,
                    "protocol": protocol,
                    "begin": (where, overwrite, begun) if rank == 0 else None,
                },
                same=("shardbridge.checkpoint.save", same),
                share=lambda mine: mine.target,  # rank 0's
                # see [Note: the derived protocol]; an async save's writer agrees on it: here, on the writer group
                agree=lambda mine: writer_group_state() if async_ else protocol.digest(mine.local),
            )
        except BaseException as exc:
            _dist.tell(exc)
            for target in begun:
                where.backend.abandon(target)  # see [Note: atomic commit]
            raise
        state, snapshot = prepared.state, prepared.snapshot
        job = SaveJob(
            where=where,
            target=target,
            dcp_state=state.dcp_state if snapshot is None else snapshot,
            rng=prepared.rng,
            manifest=prepared.manifest,
            protocol=protocol,
            local=prepared.local,
            derived=None if async_ else agreed and protocol.digest(prepared.local) != 0,
            pending=prepared.pending,
        )
        del state, snapshot, prepared
        if not async_:
            write_and_commit(job)
            return where.user
        try:
            return start_async(job, write_and_commit, optimizer, group_agreed=agreed)
        except BaseException as exc:
            _dist.tell(exc)
            if rank == 0:
                where.backend.abandon(job.target)
            raise


@dataclass
class SaveJob:
    """Everything the write round of a save needs: run in the foreground or by the writer thread."""

    where: Location
    """The checkpoint being saved."""
    target: Target
    """Where every rank writes (rank 0 began it)."""
    dcp_state: dict[str, Any]
    rng: bytes
    """This rank's RNG file."""
    manifest: Manifest
    """Without ``files`` (added at the commit)."""
    protocol: SaveProtocol
    local: Any
    """The protocol's result of this rank's local step (round 1; None while ``derived`` is None)."""
    derived: bool | None = False
    """Every rank can derive the global plan (round 1; [Note: the derived protocol] in ``derived/_save.py``);
    None: an asynchronous save's writer runs the protocol's local step and this round ([Note: async save])."""
    pending: Pending | None = None
    """An asynchronous save's copies left to the writer ([Note: background staging] in ``_async.py``)."""

    @property
    def final(self) -> Path | str:
        """The checkpoint, as the user named it (``AsyncSave.path``)."""
        return self.where.user


def write_and_commit(job: SaveJob) -> None:
    """The rest of :func:`save`: plan (if needed), write, ``.metadata``, commit ([Note: save protocols]).

    Collectives on ``_dist``'s group. A failure is raised on every rank; rank 0 then abandons
    the target (deleting it unless it may be the only complete copy).
    """
    rank = _dist.rank()
    backend, target = job.where.backend, job.target

    def commit(records: dict[str, dict[str, Any]], derived: dict[str, Any] | None) -> None:  # rank 0, in finish
        files = merge_records(backend, target.data, records, listing=writer.landed)  # the listing finish checked
        manifest = dataclasses.replace(job.manifest, files=files)
        if derived is not None:  # see [Note: derived loads] in derived/_records.py
            manifest = dataclasses.replace(manifest, layout={**manifest.layout, DERIVED_KEY: derived})
        backend.commit(target, manifest)

    def failure(exc: BaseException, file: str) -> BaseException:
        return save_failure(exc, rank, str(job.where), backend.uri(file), local=not backend.remote)

    writer = Writer(
        backend,
        target,
        checkpoint_id=str(job.where),
        files={rng_file(rank): job.rng},
        commit=commit,
        threads=FILES_PER_RANK[backend.remote],
        min_file_bytes=PART_BYTES,
        save_failure=failure,
    )
    try:
        if job.pending is not None:
            job.pending.run()  # a failure reaches every rank as any other: [Note: collective entry points]
        local, derived = job.local, job.derived
        if derived is None:  # an asynchronous save: the local step on the snapshot, one constant-size round
            local, _, agreed = _dist.one_round(job.protocol.local, (job.dcp_state,), agree=job.protocol.digest)
            derived = agreed and job.protocol.digest(local) != 0
        job.protocol.save(job.dcp_state, writer, local, derived)
    except BaseException as exc:
        _dist.tell(exc)  # every rank knows before rank 0 deletes what the others may still be writing
        if rank == 0:
            backend.abandon(target)  # see [Note: atomic commit], [Note: object-store commit]
        raise


def _prepare(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int | None,
    extra: dict[str, Any] | None,
    parallel_dims: ParallelDims | None,
    provider: StateDictProvider | None,
    on_bad_layout: OnBadLayout,
    log: bool,
    stage: bool,
    protocol: SaveProtocol,
    begin: tuple[Location, bool, list[Target]] | None,
) -> _Prepared:
    """Steps 1-2 of :func:`save` on one rank; rank 0 (``begin``) also begins the save on the backend."""
    extra = _check_args(
        model=model, optimizer=optimizer, step=step, extra=extra, parallel_dims=parallel_dims, provider=provider
    )
    state = build_portable_state(model, optimizer, on_bad_layout=on_bad_layout, log=log, provider=provider)
    snapshot, pending = stage_state(state.dcp_state, model, optimizer) if stage else (None, None)
    local = None if stage else protocol.local(state.dcp_state)  # staged: the writer's ([Note: async save])
    manifest = _manifest(state, step=step, extra=extra, world_size=_dist.world_size(), parallel_dims=parallel_dims)
    rng = rng_bytes(rng_states())
    target = None
    if begin is not None:
        where, overwrite, begun = begin
        target = where.backend.begin(where.path, overwrite=overwrite)
        begun.append(target)
    return _Prepared(state, snapshot, local, manifest, rng, target, pending)


@dataclass
class _Prepared:
    state: PortableState
    snapshot: dict[str, Any] | None
    local: Any
    manifest: Manifest
    rng: bytes
    target: Target | None
    pending: Pending | None


def _protocol_of(protocol: str | SaveProtocol) -> SaveProtocol:
    """``save``'s ``protocol``: a name of :data:`PROTOCOLS`, or a protocol object."""
    if isinstance(protocol, str):
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol={protocol!r} is not one of {sorted(PROTOCOLS)}; 'derived' is the default")
        return PROTOCOLS[protocol]()
    if not all(callable(getattr(protocol, m, None)) for m in ("local", "save", "digest")):
        raise TypeError(f"protocol must be a name ({', '.join(sorted(PROTOCOLS))}) or a SaveProtocol, got {protocol!r:.80}")
    return protocol


def check_model_and_optimizer(model: Any, optimizer: Any) -> None:
    """TypeError naming the parameter unless ``model`` is a module and ``optimizer`` an optimizer or None.

    Checked before anything uses them (torch's ``get_state_dict`` would raise an AttributeError
    from deep inside for swapped arguments)."""
    swapped = isinstance(model, torch.optim.Optimizer) and isinstance(optimizer, nn.Module)
    hint = "; model and optimizer look swapped: pass model=<the nn.Module>, optimizer=<its optimizer>" if swapped else ""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {_type_name(model)}{hint}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {_type_name(optimizer)}{hint}")


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _check_args(
    *,
    model: Any,
    optimizer: Any,
    step: int | None,
    extra: dict[str, Any] | None,
    parallel_dims: ParallelDims | None,
    provider: StateDictProvider | None,
) -> dict[str, Any]:
    """TypeError / ValueError for a bad argument of :func:`save`; returns ``extra`` ({} for None)."""
    check_model_and_optimizer(model, optimizer)
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise ValueError(f"step={step!r} must be an int >= 0 or None")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of JSON values, got {type(extra).__name__}")
    check_json_extra(extra)
    extra = copy.deepcopy(extra)  # the values of the call: an async save writes it later
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
) -> Manifest:
    mesh_axes: dict[str, int] = {}
    for record in state.tensors.values():
        mesh_axes.update(record["mesh"])
    dims = None if parallel_dims is None else dataclasses.asdict(parallel_dims)
    layout: dict[str, Any] = {"parallel_dims": dims, "mesh_axes": mesh_axes, "tensors": state.tensors}
    if OPTIM_KEY in state.dcp_state:  # See [Note: parameters without optimizer state] in _state.py
        layout[OPTIM_STATE_ABSENT] = state.no_optim_state
    return Manifest(
        step=step,
        world_size=world_size,
        has_optimizer=OPTIM_KEY in state.dcp_state,
        layout=layout,
        fused=state.fused,
        extra=extra,
        rng={"world_size": world_size, "files": RNG_PATTERN},
        torch_version=torch.__version__,
        shardbridge_version=shardbridge.__version__,
        created=utc_now(),
        files={},
    )
