"""``save``: model + optimizer + training state into one atomic checkpoint directory."""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

import shardbridge
from shardbridge._compat import DCPStorageInfo, torch_save_without_crc
from shardbridge._mesh import ParallelDims
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._async import AsyncSave, IfBusy, finish_previous, stage_state, start_async
from shardbridge.checkpoint._chunks import SavePlanner
from shardbridge.checkpoint._commit import abandon, commit, new_tmp_dir
from shardbridge.checkpoint._errors import save_failure
from shardbridge.checkpoint._integrity import ChecksumWriter, merge_records, own_files
from shardbridge.checkpoint._manifest import OPTIM_STATE_ABSENT, RNG_PATTERN, Manifest, check_json_extra, utc_now
from shardbridge.checkpoint._provider import StateDictProvider, check_provider
from shardbridge.checkpoint._rng import rng_states, save_rng
from shardbridge.checkpoint._state import OPTIM_KEY, OnBadLayout, PortableState, build_portable_state

__all__ = ["SaveJob", "save", "write_and_commit"]


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
) -> Path: ...


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
) -> Path | AsyncSave:
    """Save a checkpoint to the directory ``path``, atomically. Call on every rank.

    Saves the model and optimizer through torch's ``get_state_dict`` (the model's own FQNs,
    optimizer state flattened per parameter), every rank's torch RNG state, ``step`` and
    ``extra``. Fused parameters and their optimizer states are stored as their components,
    DTensors whose layout DCP would describe wrongly are repaired (see
    :mod:`shardbridge.checkpoint._state`), and a tensor held under several names (tied
    embeddings) is stored once. The directory appears only when complete (see
    [Note: atomic commit] in ``_commit.py``). With several nodes, ``path`` must be on a
    filesystem every node shares.

    With ``async_=True`` the call returns once the state is copied to host memory; a
    background thread writes and commits it (see [Note: async save] in ``_async.py``), and
    training may change the model meanwhile. At most one save is in flight: the next
    :func:`save` (or :func:`wait`) first waits for it, and raises its error if it failed.

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
        async_: False (default) returns when the checkpoint is committed; True returns an
            :class:`AsyncSave` as soon as the state is staged in host memory.
        if_busy: what this save does while a previous asynchronous save is still in flight:
            "wait" (default) for it to finish, "error" raises ``RuntimeError`` (nothing of
            this save is done; the previous one goes on).

    Returns:
        The committed checkpoint directory, or (``async_=True``) the :class:`AsyncSave`
        whose ``wait()`` returns it.

    Raises:
        ValueError: ``path`` exists (without ``overwrite``), ``extra`` is not JSON, a bad
            layout DCP cannot describe (or any with ``on_bad_layout="error"``). Raised on
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
    final = Path(path)
    if not isinstance(async_, bool):
        raise ValueError(f"async_={async_!r} must be True (write in the background) or False")
    if if_busy not in ("wait", "error"):
        raise ValueError(f"if_busy={if_busy!r} must be 'wait' (for the save in flight) or 'error'")
    # 0. At most one save in flight; the previous one's error surfaces here.
    finish_previous(if_busy)
    rank, world_size = _dist.rank(), _dist.world_size()
    # 1. Arguments checked, the portable state built (layouts checked, fused params split,
    # FP8 made plain) and, for async_, staged to host memory: one round in which every rank
    # also compares its arguments. See [Note: symmetric errors] in _dist.py.
    same = {"path": str(path), "step": step, "extra": {} if extra is None else extra, "overwrite": overwrite,
            "on_bad_layout": on_bad_layout, "optimizer": optimizer is not None, "parallel_dims": parallel_dims,
            "async_": async_}  # fmt: skip
    # 2. In the same round, rank 0 creates the temporary directory (once its own checks
    # passed; deleted below if another rank failed) and every rank learns its name.
    created: list[Path] = []
    try:
        prepared, shared = _dist.one_round(
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
                "tmp_for": (final, overwrite, created) if rank == 0 else None,
            },
            same=("shardbridge.checkpoint.save", same),
            result="all",
            share=lambda mine: (mine.tmp, _unchanged(mine.local)),
            small=True,
        )
        tmp = shared[0][0]
        # 3. DCP's global plan: reused when no rank's plan changed ([Note: save rounds]).
        plan, metadata = _global_plan(prepared.local, all(unchanged for _, unchanged in shared), tmp)
    except BaseException:
        for made in created:
            abandon(made, final)  # see [Note: atomic commit]
        raise
    state, snapshot = prepared.state, prepared.snapshot
    job = SaveJob(
        final=final,
        tmp=tmp,
        dcp_state=state.dcp_state if snapshot is None else snapshot,
        rng=rng_states(),
        overwrite=overwrite,
        manifest=_manifest(state, step=step, extra=prepared.extra, world_size=world_size, parallel_dims=parallel_dims),
        plan=plan,
        metadata=metadata,
    )
    del state, snapshot, prepared
    if not async_:
        write_and_commit(job)
        return final
    try:
        return start_async(job, write_and_commit)
    except BaseException:
        if rank == 0:
            abandon(tmp, final)
        raise


@dataclass
class SaveJob:
    """Everything steps 3-5 of a save need: written in the foreground or by the writer thread."""

    final: Path
    tmp: Path
    dcp_state: dict[str, Any]
    rng: dict[str, torch.Tensor]
    overwrite: bool
    manifest: Manifest
    """Without ``files`` (added at the commit)."""
    plan: SavePlan
    """This rank's part of DCP's global plan: what it writes, into which file."""
    metadata: Metadata | None
    """Rank 0: DCP's global metadata for ``.metadata`` (a copy: the writer fills it in)."""


# [Note: save rounds]
# ~~~~~~~~~~~~~~~~~~~
# A collective round costs ~10 ms on 4 processes sharing 2 cores; at 97 MB plain ``dcp.save``
# (a plan round and a write round) took 0.10 s and shardbridge's save, with its argument round
# and two rounds of its own after DCP's (records, commit outcome), 0.13 s. So a save drives
# DCP's planner and file writer itself (their public extension APIs, as ``dcp.save`` does)
# in at most three rounds, two when the plan is unchanged:
#
# 1. argument round (``one_round``, all ranks): arguments compared, the portable state built
#    (and staged for async saves), rank 0's temporary directory, and each rank's "my local
#    plan equals the one of the last save" flag;
# 2. plan round (``gather_scatter``), only when some rank's plan changed (the first save, a
#    new layout): rank 0 turns every rank's local plan into DCP's global plan and metadata,
#    each rank gets its own part. Every rank keeps its part (rank 0 the metadata too) for
#    the next save: DCP's plan caching, without DCP's collectives;
# 3. write round (``gather_reduce``): each rank writes its DCP file (fsynced), its RNG file,
#    and hashes both ([Note: checkpoint integrity]); rank 0 receives every rank's write
#    results and records, writes ``.metadata`` (DCP's own ``finish``), commits ([Note: atomic
#    commit]) and every rank learns the outcome.
#
# The files are laid out as ``dcp.save`` lays them out (``.metadata`` from DCP's planner and
# writer, ``__<rank>_0.distcp`` as [Note: the data file writer] says), read by plain
# ``dcp.load`` and ``dcp_to_torch_save``.


# [Note: the data file writer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each rank's ``__<rank>_0.distcp`` is what DCP's ``FileSystemWriter`` writes with one file per
# rank and one thread: the plan's items in order, each tensor one ``torch.save`` record (a zip
# archive: the tensor's pickle and its raw bytes), each bytes item its bytes; every offset and
# length goes into ``.metadata``; the file is fsynced. Two things differ, both measured at
# 1 GB (docs/benchmarks.md):
#
# - the records' zip CRC32 fields are left at 0 (``torch_save_without_crc``): the manifest's
#   xxh3-128 of every file covers every byte already, and torch.load (DCP's reader,
#   ``dcp_to_torch_save``) does not check the CRC32; computing it cost ~12% of the write;
# - every byte written also feeds the file's checksum (``ChecksumWriter``), instead of a
#   second pass reading the file back.
#
# DCP's writer copies a CUDA tensor to the host ahead of writing it on a side stream; this
# writer copies it when it writes it. An asynchronous save stages to host memory first, so
# it is unaffected; a synchronous save from GPU memory waits for each copy.
_DCP_SUFFIX = ".distcp"


def write_and_commit(job: SaveJob) -> None:
    """Steps 3-5 of :func:`save`: write, record, commit in one round ([Note: save rounds]).

    Collectives on ``_dist``'s group.
    """
    rank = _dist.rank()
    writer = _TmpDirWriter(job.tmp)

    def write() -> tuple[list[WriteResult], dict[str, dict[str, Any]]]:
        try:
            writer.check()
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            planner = SavePlanner()
            planner.set_up_planner(
                state_dict=job.dcp_state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0
            )
            results = writer.write_data(planner.finish_plan(job.plan), planner).wait()
            save_rng(job.tmp, rank, job.rng)
            return results, own_files(job.tmp, rank, known=writer.records)
        except Exception as exc:  # noqa: BLE001 (raised as one clear error, on every rank)
            raise save_failure(exc, rank, job.final, job.tmp) from exc

    def commit_rank0(parts: list[tuple[list[WriteResult], dict[str, dict[str, Any]]]]) -> None:
        assert job.metadata is not None and len(parts) == _dist.world_size(), len(parts)
        try:
            writer.finish(copy.copy(job.metadata), [results for results, _ in parts])  # .metadata
        except Exception as exc:  # noqa: BLE001 (raised as one clear error, on every rank)
            raise save_failure(exc, rank, job.final, job.tmp) from exc
        _commit_rank0(job, [record for _, record in parts])

    try:
        _dist.gather_reduce(write, commit_rank0)
    except BaseException:
        if rank == 0:
            abandon(job.tmp, job.final)  # deletes tmp unless it is the only complete copy: [Note: atomic commit]
        raise


class _TmpDirWriter(dcp.FileSystemWriter):
    """DCP's file writer into the save's temporary directory; see [Note: the data file writer].

    It never creates the directory. DCP's ``prepare_local_plan`` ``mkdir``s it on every rank
    (a save never calls it). If rank 0 has already given the save up and deleted the
    directory (a dead peer, a destroyed process group), another rank would re-create it
    without a lock file, and recovery could not tell it from another job's save in progress:
    it would stay forever. So a missing directory is this rank's error instead.
    """

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp, sync_files=True)
        self.records: dict[str, dict[str, Any]] = {}
        """The data files written, by name: their records ([Note: checkpoint integrity])."""

    def write_data(self, plan: SavePlan, planner: Any) -> Future[list[WriteResult]]:
        """This rank's ``.distcp`` file, as DCP's own writer lays it out (its single-file layout)."""
        name = f"{plan.storage_data.prefix}0{_DCP_SUFFIX}"
        results = []
        with open(Path(self.path) / name, "wb") as raw:
            f = ChecksumWriter(raw)
            # DCP's order: the bytes items, then the tensors, each in plan order.
            items = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            items += [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
            for item in items:
                data = planner.resolve_data(item)
                offset = f.tell()
                if item.type == WriteItemType.BYTE_IO:
                    f.write(data.getbuffer())
                else:
                    t = data.detach().cpu()
                    if t.untyped_storage().size() != t.nbytes:
                        t = t.clone()  # a view of a larger storage: its own bytes only, as DCP does
                    torch_save_without_crc(t, f)
                length = f.tell() - offset
                results.append(
                    WriteResult(
                        index=item.index, size_in_bytes=length, storage_data=DCPStorageInfo(name, offset, length)
                    )
                )
            raw.flush()
            os.fsync(raw.fileno())
        self.records[name] = f.record()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def check(self) -> None:
        """FileNotFoundError if the directory is gone."""
        if not Path(self.path).is_dir():
            raise FileNotFoundError(
                f"the save's temporary directory {str(self.path)!r} is gone: rank 0 gave the save up (see its error)"
            )


_PLANS: dict[str, Any] = {}
"""The last save's plans, per process: ``key`` (rank, world size, group), ``local`` (this
rank's local plan), ``central`` (its part of the global plan), ``metadata`` (rank 0)."""


def _local_plan(dcp_state: dict[str, Any], rank: int) -> SavePlan:
    planner = SavePlanner()
    planner.set_up_planner(state_dict=dcp_state, storage_meta=None, is_coordinator=rank == 0)
    return planner.create_local_plan()


def _plans_key() -> tuple[Any, ...]:
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return _dist.rank(), _dist.world_size(), id(world)


def _unchanged(local: SavePlan) -> bool:
    """Whether ``local`` is this rank's plan of the last save (same process group)."""
    return _PLANS.get("key") == _plans_key() and _PLANS.get("local") == local


def _global_plan(local: SavePlan, everywhere_unchanged: bool, tmp: Path) -> tuple[SavePlan, Metadata | None]:
    """Round 2 of [Note: save rounds] (skipped when no rank's plan changed): this rank's part of
    the global plan, and (rank 0) the metadata."""
    if everywhere_unchanged:
        return _PLANS["central"], _PLANS["metadata"]
    _PLANS.clear()  # a failed round leaves no half-updated cache behind

    def plan(every_local: list[SavePlan]) -> list[tuple[SavePlan, Metadata | None]]:
        central, metadata = SavePlanner().create_global_plan(every_local)
        central = _TmpDirWriter(tmp).prepare_global_plan(central)  # each rank's file prefix
        return [(part, metadata if r == 0 else None) for r, part in enumerate(central)]

    central, metadata = _dist.gather_scatter(lambda: local, plan)
    _PLANS.update(key=_plans_key(), local=local, central=central, metadata=metadata)
    return central, metadata


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
    tmp_for: tuple[Path, bool, list[Path]] | None,
) -> _Prepared:
    """Steps 1-2 of :func:`save` on one rank; rank 0 (``tmp_for``) also creates the tmp dir."""
    extra = _check_args(step=step, extra=extra, parallel_dims=parallel_dims, provider=provider)
    state = build_portable_state(model, optimizer, on_bad_layout=on_bad_layout, log=log, provider=provider)
    snapshot = stage_state(state.dcp_state) if stage else None
    local = _local_plan(state.dcp_state if snapshot is None else snapshot, _dist.rank())
    tmp = None
    if tmp_for is not None:
        final, overwrite, created = tmp_for
        tmp = new_tmp_dir(final, overwrite=overwrite)
        created.append(tmp)
    return _Prepared(extra, state, snapshot, local, tmp)


@dataclass
class _Prepared:
    extra: dict[str, Any]
    state: PortableState
    snapshot: dict[str, Any] | None
    local: SavePlan
    tmp: Path | None


def _commit_rank0(job: SaveJob, parts: list[dict[str, dict[str, Any]]]) -> None:
    manifest = dataclasses.replace(job.manifest, files=merge_records(job.tmp, parts))
    commit(job.tmp, job.final, manifest, overwrite=job.overwrite)


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
