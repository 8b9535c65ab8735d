"""``load`` / ``load_latest``: a checkpoint into any layout of a compatible model."""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate

from shardbridge._compat import dcp_set_element, flatten_state_dict
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint._async import settle
from shardbridge.checkpoint._save import check_model_and_optimizer
from shardbridge.checkpoint._verify import hash_share, local_problems, merge_problems
from shardbridge.checkpoint.derived import DerivedRecords, checkpoint_records, declared_digest, derive_load
from shardbridge.checkpoint.state._chunks import LoadPlanner, LocalChunks
from shardbridge.checkpoint.state._provider import StateDictProvider, check_provider
from shardbridge.checkpoint.state._rng import restore_rng
from shardbridge.checkpoint.state._state import (
    MODEL_KEY,
    OPTIM_KEY,
    PortableState,
    build_portable_state,
    drop_optim_entries,
    finish_load,
    optim_state_owner,
    unpack_param_groups,
)
from shardbridge.checkpoint.storage._backend import Stored
from shardbridge.checkpoint.storage._catalog import newest
from shardbridge.checkpoint.storage._errors import dcp_errors
from shardbridge.checkpoint.storage._integrity import FileProblem, check_files, damage_message
from shardbridge.checkpoint.storage._location import Location, locate, open_checkpoint
from shardbridge.checkpoint.storage._manifest import (
    DCP_METADATA_NAME,
    FILES_SINCE_VERSION,
    MANIFEST_NAME,
    OPTIM_STATE_ABSENT,
    Manifest,
)
from shardbridge.checkpoint.storage._reader import TrustedReader
from shardbridge.checkpoint.storage._trust import raise_untrusted, read_metadata

__all__ = ["TrainState", "load", "load_latest"]

_MAX_NAMES = 5
logger = logging.getLogger("shardbridge.checkpoint")


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
    path: Path | str
    """The checkpoint directory loaded (a ``str`` URI for a checkpoint given as one)."""
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
    verify: bool = True,
) -> TrainState:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``), in place.

    Works across layouts: a checkpoint saved with any mix of FSDP2 / HSDP / TP degrees (or in
    one process) loads into any other, fused parameters included (their components are
    stored, so a different TP degree re-interleaves them). Call on every rank, after the
    model is parallelized and materialised (not on the meta device) and the optimizer built;
    an optimizer without state gets it from one zero-gradient step first (torch's
    ``get_state_dict`` does this), then the saved state overwrites it.

    Args:
        path: a checkpoint directory (see :func:`latest`), or its URI (``s3://...``, ``file://...``).
        model: the model to fill.
        optimizer: its optimizer, or None to load the model only (the checkpoint's optimizer
            state, if any, is ignored).
        strict: require that the model's (and optimizer's) keys and the checkpoint's are the
            same; False loads the keys both have. Shapes must match either way.
        rng: restore the torch RNG states (each rank its own when the world size matches,
            else rank 0's on every rank, with a warning).
        state_dicts: a framework's :class:`StateDictProvider`, as in :func:`save`; its
            ``load_state_dicts`` runs after DCP instead of torch's ``set_state_dict``.
        verify: compare every file's xxh3_128 checksum with the manifest, computed in the pass
            that reads it into the tensors (one rank per file), and agreed on by every rank
            before any value is handed to the model ([Note: verifying while reading] in
            ``storage/_reader.py``: a refused load has read into the tensors in place). False
            checks existence and sizes only (always done). Checkpoints of format 1 and 2
            record nothing and load unverified. See [Note: checkpoint integrity] in
            ``_integrity.py``.

    Returns:
        The :class:`TrainState` (step, extra).

    Raises:
        ValueError: missing path, not a shardbridge checkpoint, damaged manifest, a file
            missing, truncated, corrupted (the model's tensors then hold what was read), foreign
            or extra (the first is named), keys that do not match (the first few are named), a shape mismatch, or a rank-local tensor
            (:func:`mark_rank_local`) no ``state_dicts`` provider took over. Raised on every rank.

    Example:
        >>> state = load(step_dir(root, 100), model=model, optimizer=opt)  # doctest: +SKIP
        >>> state.step  # doctest: +SKIP
        100
    """
    with _dist.entry():  # see [Note: collective entry points] in _dist.py
        state = _load(
            path, model=model, optimizer=optimizer, strict=strict, rng=rng, state_dicts=state_dicts, verify=verify
        )
    assert state is not None
    return state


def _load(
    path: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    rng: bool,
    state_dicts: StateDictProvider | None,
    verify: bool,
    skip_damaged: bool = False,
) -> TrainState | None:
    """:func:`load`; ``skip_damaged``: a damaged checkpoint (manifest or files) returns None, logged."""
    # Checked on every rank together, arguments compared between ranks, in one round: one
    # rank's bad argument must not leave the others waiting in a collective. See
    # [Note: symmetric errors] in _dist.py.
    replicas = _replicas(model, optimizer, state_dicts)  # see [Note: reading once under replication]
    same = {"path": str(path), "strict": strict, "rng": rng, "verify": verify, "optimizer": optimizer is not None,
            "read once over": replicas and (replicas.dim, replicas.readers)}  # fmt: skip
    settle()  # this process's save in flight may be replacing the directory: let it finish first
    where = _where(path)
    # What a commit that replaces the checkpoint changes, taken before reading: a directory's inode;
    # on an object store the generation of the manifest the first round reads (no request of its own).
    remote = where is not None and where.backend.remote
    identity = where.backend.identity(where.path) if where is not None and not remote else None
    # Three rounds in all, two without verify (each ~10 ms on 4 processes sharing 2 cores; plain
    # DCP's load has two): 1. arguments, the manifest and the files' sizes, before DCP reads
    # anything; rank 0, once its file check found every file, derives every storage record from
    # the manifest and renders .metadata from them byte for byte, and the round agrees on it
    # ([Note: derived loads] in derived/_records.py). Where it could not, rank 0 reads .metadata
    # (restricted unpickler) and broadcasts the validated object after the round, instead of
    # every rank reading and unpickling it.
    (stored, manifest, opened, expected), intact, agreed = _dist.one_round(
        _open,
        (where if where is not None else path,),
        {
            "model": model,
            "optimizer": optimizer,
            "strict": strict,
            "rng": rng,
            "provider": state_dicts,
            "verify": verify,
            "skip_damaged": skip_damaged,
        },
        same=("shardbridge.checkpoint.load", same),
        all_of=lambda opened: not opened[2][0],  # this rank found no damaged file
        agree=lambda opened: opened[3],  # rank 0 rendered .metadata from the derivation every rank expects
    )
    # Only a damaged checkpoint gathers every rank's problems (to name them all)
    problems = [] if intact else merge_problems(_dist.all_gather(opened[0], small=True))
    if problems and skip_damaged:
        if _dist.rank() == 0:
            logger.warning(
                "shardbridge.checkpoint: skipping %s: %s; trying the next older checkpoint",
                stored,
                f"{stored.where(problems[0].name)}: {problems[0].problem}",
            )
        return None
    if problems:
        raise ValueError(damage_message(stored, problems))
    assert manifest is not None
    if remote:
        identity = manifest.generation
    records, metadata = None, None
    if agreed and expected:  # .metadata's records, derived by each rank: see [Note: derived loads]
        records = opened[1] if _dist.rank() == 0 else derive_load(manifest.layout, manifest.world_size, manifest.files)
    else:  # (a rank whose derivation failed reads .metadata itself in _read_state: the same records)
        # Rank 0's validated .metadata, broadcast: each rank receives it once (never once per rank,
        # as an all-gather would send it): _dist.broadcast_from_rank0(large=True).
        mine = None
        if _dist.rank() == 0:
            mine = opened[1] if not isinstance(opened[1], DerivedRecords) else _read_metadata_or_none(stored)
        metadata = _dist.broadcast_from_rank0(mine, large=True)
    # 2. Each rank plans and reads only the boxes it needs, without DCP's planning collectives
    # (a load plan needs no coordination); with verify it hashes its share of the files in the
    # same pass ([Note: verifying while reading] in storage/_reader.py), and the round agrees on
    # every rank's checksums. 3. The state is handed to the model. Without verify and without a
    # provider, 2 and 3 are one round; a provider's hand-over may hold collectives: it gets a
    # round of its own, so that no rank enters it while another failed reading.
    hashes = verify and manifest.format_version >= FILES_SINCE_VERSION
    read = functools.partial(
        _read_state, stored, manifest, metadata, model, optimizer,
        strict=strict, provider=state_dicts, identity=identity, records=records, verify=hashes, replicas=replicas,
    )  # fmt: skip
    finish = functools.partial(
        _finish, stored, model=model, optimizer=optimizer, manifest=manifest, strict=strict, rng=rng, provider=state_dicts
    )
    if not hashes and state_dicts is None and replicas is None:  # set_state_dict of a sharded state: local copies
        _dist.one_round(lambda: finish(read()[0]), last=True)
    else:
        (state, problems, error, keys), clean = _dist.one_round(read, all_of=lambda out: not out[1] and out[2] is None)
        if not clean and _refused(stored, problems, error, skip_damaged=skip_damaged):
            return None
        if replicas is not None:  # every reader read cleanly: its replicas get what it read
            _share(state, keys, replicas)
        _dist.one_round(finish, (state,), last=True)
    assert where is not None
    return TrainState(step=manifest.step, extra=manifest.extra, path=where.user, world_size=manifest.world_size)


_OVERWRITTEN = (
    " Its bytes were read into the model's and optimizer's tensors in place while the checksums were computed: "
    "load an intact checkpoint into them before using them"
)


def _refused(stored: Stored, problems: list[FileProblem], error: BaseException | None, *, skip_damaged: bool) -> bool:
    """After a read round that was not clean on every rank: True to skip a damaged checkpoint, else raise.

    Damage found by any rank's checksums wins over a read error (a damaged record may fail to parse
    on a rank that does not hash its file); else the read error is raised on every rank."""
    gathered = _dist.all_gather((problems, None if error is None else _dist.summary(error)), small=True)
    problems = merge_problems([g[0] for g in gathered])
    if problems and skip_damaged:
        if _dist.rank() == 0:
            logger.warning(
                "shardbridge.checkpoint: skipping %s: %s; trying the next older checkpoint",
                stored,
                f"{stored.where(problems[0].name)}: {problems[0].problem}",
            )
        return True
    if problems:
        raise ValueError(damage_message(stored, problems) + "." + _OVERWRITTEN)
    if error is not None:
        raise error
    raise _dist.replay([(r, g[1]) for r, g in enumerate(gathered) if g[1] is not None])


def _read_metadata_or_none(stored: Stored) -> Metadata | None:
    """Rank 0's restricted read of ``.metadata``; None if it fails (each rank then reads it, to raise)."""
    try:
        return read_metadata(stored)
    except Exception:  # noqa: BLE001 (raised on every rank by _read_state)
        return None


def _where(path: Any) -> Location | None:
    """``path`` resolved, or None when it is not a path (``_check_args`` raises on every rank)."""
    try:
        return locate(path)
    except (ValueError, ImportError):
        return None


def _open(
    path: Location | Any,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    rng: bool,
    provider: StateDictProvider | None,
    verify: bool,
    skip_damaged: bool,
) -> tuple[Stored | None, Manifest | None, tuple[list[FileProblem], DerivedRecords | Metadata | None], int]:
    """Round 1 of :func:`load` on one rank: arguments, manifest, this rank's file checks; on rank 0
    the derived records shown to be ``.metadata``'s, else ``.metadata`` read ([Note: derived
    loads] in ``derived/_records.py``); and the digest of the derivation: rank 0's (0: none), the
    manifest's elsewhere.

    ``skip_damaged``: a manifest that cannot be read is one more problem, not an error.
    """
    _check_verify(verify)
    try:
        checked, manifest = _check_args(path, model=model, optimizer=optimizer, strict=strict, rng=rng, provider=provider)
    except _DamagedManifest as exc:
        if not skip_damaged:
            raise exc.error from None
        return exc.stored, None, ([FileProblem(MANIFEST_NAME, str(exc.error))], None), 0
    # rank 0 only, and only once its file check found every listed file with its size
    local = local_problems(
        checked, manifest, rank0=lambda: checkpoint_records(checked, manifest) or read_metadata(checked)
    )
    if _dist.rank() == 0:
        return checked, manifest, local, local[1].digest if isinstance(local[1], DerivedRecords) else 0
    return checked, manifest, local, declared_digest(manifest.layout)


class _DamagedManifest(Exception):
    """``read_manifest``'s ValueError, told apart from the argument errors of :func:`_check_args`."""

    def __init__(self, stored: Stored, error: ValueError) -> None:
        super().__init__(str(error))
        self.stored, self.error = stored, error


def _read_state(
    path: Stored,
    manifest: Manifest,
    metadata: Metadata | None,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    strict: bool,
    provider: StateDictProvider | None,
    identity: Any = None,
    records: DerivedRecords | None = None,
    verify: bool = False,
    replicas: _Replicas | None = None,
) -> tuple[PortableState, list[FileProblem], Exception | None, list[str]]:
    """This rank's part of :func:`load`: build the portable state, check it fits, read into it.

    ``records``: every storage record, derived ([Note: derived loads]); ``metadata`` is then unused.
    ``verify``: hash this rank's share of the files while reading ([Note: verifying while reading]);
    returns ``(state, the files whose checksum failed, the read's error)``, the error left to the
    caller (a damaged file another rank hashes may be what it comes from). Without ``verify`` a
    read error is raised. ``replicas``: only the readers read ([Note: reading once under
    replication]); last in the result, the keys read (what they send)."""
    state = build_portable_state(model, optimizer, on_bad_layout="repair", log=False, provider=provider, for_load=True)
    if manifest.format_version < 2:
        unpack_param_groups(state)  # format 1 stored each param_groups entry alone
    # Each DTensor's box computed once, for the narrowing below and for DCP's planner alike.
    flat, mapping = flatten_state_dict(state.dcp_state)
    boxed = {key: _boxed(value) for key, value in flat.items()}
    # No code runs from the checkpoint's files: see [Note: untrusted checkpoints] in _trust.py.
    if records is not None:  # the saved boxes this rank's boxes overlap, and their records
        metadata = records.metadata(local=boxed)
    elif metadata is None:  # rank 0 could not read it: every rank reads it, to raise the error
        try:
            metadata = read_metadata(path)
        except ValueError:
            # A flipped byte can make .metadata unparseable before any checksum was computed: with
            # verify, damage is told as damage (load_latest then tries the next older checkpoint).
            damaged = check_files(path, manifest, checksums=[DCP_METADATA_NAME], listing=False) if verify else []
            if not damaged:
                raise
            return state, damaged, None, []
    _skip_absent_optim_state(state, metadata, manifest)
    _check_compatible(path, state, metadata, strict=strict, manifest=manifest)
    # DCP gets the state flat (flattened once, above), each DTensor as its box; the bytes items
    # it loads land in ``local`` and are put back into the nested state.
    local = {key: value for key, value in boxed.items() if _present(state.dcp_state, mapping[key])}
    planner = LoadPlanner(allow_partial_load=not strict, flatten_state_dict=False, flatten_sharded_tensors=False)
    among = (_dist.rank(), _dist.world_size()) if replicas is None else (replicas.index, replicas.readers)
    reader = TrustedReader(path, metadata, verify=hash_share(manifest.files, *among) if verify else None)
    error = None
    try:
        if among[0] >= 0:  # a reader: not a replica that receives ([Note: reading once under replication])
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                with dcp_errors("load", path), raise_untrusted():  # see [Note: DCP errors]
                    dcp.load(local, storage_reader=reader, planner=planner, no_dist=True)
    except Exception as exc:  # noqa: BLE001 (raised by the caller once the checksums are agreed on)
        if not verify:
            raise
        error = exc
    for key, value in local.items():
        if value is not boxed[key]:
            dcp_set_element(state.dcp_state, mapping[key], value)
    if identity is not None and path.backend.identity(path.path) != identity:
        raise ValueError(
            f"checkpoint {str(path)!r} was replaced while it was being loaded (a save with overwrite=True, by "
            "this job or another, committed a new version); what was read may mix both versions: load it again"
        )
    return state, reader.problems, error, [key for key in local if key in metadata.state_dict_metadata]


# [Note: reading once under replication]
# Under HSDP every DTensor of the state is Replicate over the dp_replicate mesh dim: the ranks that
# differ only in their coordinate on it load the same local tensors, and each reading them from
# storage cost dp_replicate x the bytes and requests of a load (object stores throttle there). So
# when the target state allows it (:func:`_replicas`: every DTensor Replicate over one named mesh
# dim of size > 1 of a mesh spanning the job, with the same replicas on every mesh, whose group
# takes every tensor's device; no provider), only the ranks at coordinate 0 on that dim read: the whole read as before (plan,
# trusted reader, checksums, the files to hash shared among the readers alone). Once the read round
# agreed that every reader read cleanly, each reader sends every entry it read (tensors in place,
# non-tensor values pickled) to its replicas over that dim's group, before the state reaches the
# model; a reader's failure is raised on every rank by the read round, before any broadcast.
# Otherwise every rank reads as before. The plan is compared between ranks in round 1 (``same``),
# so no rank waits in a broadcast another does not make. Each rank's RNG file stays its own.
class _Replicas(NamedTuple):
    """This rank's part in reading once: its replica group, the rank it receives from, its index
    among the readers (-1: it receives) and their number."""

    dim: str
    pg: Any
    src: int
    index: int
    readers: int


def _replicas(model: Any, optimizer: Any, provider: Any) -> _Replicas | None:
    """This rank's :class:`_Replicas`, or None: every rank reads ([Note: reading once under replication])."""
    if provider is not None or not _dist.is_distributed() or not isinstance(model, nn.Module):
        return None
    # every tensor a load may fill: the state dict's (hooks and extra state included) and the
    # optimizer state's, nested ones too (what the flattened state holds; the replicas' boxes are
    # compared again before anything is sent: _dist.from_replica0)
    tensors = [*model.parameters(), *model.buffers(), *_tensors_in(list(model.state_dict().values()))]
    if isinstance(optimizer, torch.optim.Optimizer):
        tensors += _tensors_in(list(optimizer.state.values()))
    meshes = [(t.device_mesh, t.placements) for t in tensors if isinstance(t, DTensor)]
    if not meshes:
        return None
    mesh = max((m for m, _ in meshes), key=lambda m: m.size())
    names = mesh.mesh_dim_names or ()
    # the dims of the largest mesh every DTensor is Replicate over (size > 1)
    dims = [n for n, size in zip(names, mesh.shape) if size > 1]
    for m, placements in meshes:
        over = {n for n, p in zip(m.mesh_dim_names or (), placements) if isinstance(p, Replicate)}
        dims = [n for n in dims if n in over]
    if not dims or mesh.size() != _dist.world_size():
        return None
    dim, devices = dims[0], {t.device.type for t in tensors}

    def peers(m: Any) -> list[int] | None:  # the ranks of this rank's group along ``dim`` in mesh ``m``
        at = m.get_coordinate()
        return None if at is None else m.mesh[tuple(slice(None) if n == dim else c for n, c in zip(m.mesh_dim_names, at))].tolist()

    group, pg = peers(mesh), mesh.get_group(dim)
    # every DTensor's replicas must be the same ranks (meshes of one job: experts', the dense one)
    if group is None or any(peers(m) != group for m in {id(m): m for m, _ in meshes}.values()):
        return None
    if not all(_dist.takes(pg, device) for device in devices):
        return None
    readers = sorted(mesh.mesh.select(mesh.mesh_dim_names.index(dim), 0).flatten().tolist())
    rank = _dist.rank()
    return _Replicas(dim, pg, group[0], readers.index(rank) if rank in readers else -1, len(readers))


def _tensors_in(value: Any, depth: int = 0) -> list[torch.Tensor]:
    """The tensors in nested dicts / lists / tuples (a user's state: depth bounded, not trusted data)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 32:
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return [t for v in items for t in _tensors_in(v, depth + 1)]


def _box(value: Any) -> Any:
    """What a replica must hold to take a reader's bytes for ``value``: its local boxes, dtype and kind."""
    if isinstance(value, DTensor):
        chunks = value.__create_chunk_list__() if value.device_mesh.get_coordinate() is not None else []
        return ("dtensor", tuple((tuple(c.offsets), tuple(c.sizes)) for c in chunks), str(value.dtype))
    if isinstance(value, LocalChunks):
        return ("chunks", tuple((tuple(o), tuple(p.shape), str(p.dtype)) for o, p in value.pieces))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    return ("object",)


def _share(state: PortableState, keys: list[str], replicas: _Replicas) -> None:
    """The entries ``keys`` the readers read, on their replicas ([Note: reading once under replication])."""
    flat, mapping = flatten_state_dict(state.dcp_state)
    tensors: list[torch.Tensor] = []
    objects: dict[str, Any] = {}
    for key in keys:
        value = flat[key]
        if isinstance(value, DTensor):
            tensors.append(value.to_local().detach())
        elif isinstance(value, LocalChunks):
            tensors += [piece.detach() for _, piece in value.pieces]
        elif isinstance(value, torch.Tensor):
            tensors.append(value.detach())
        else:
            objects[key] = value
    boxes = [(key, _box(flat[key])) for key in keys]
    objects = _dist.from_replica0(tensors, objects, src=replicas.src, pg=replicas.pg, boxes=boxes)
    if replicas.index < 0:
        for key, value in objects.items():
            dcp_set_element(state.dcp_state, mapping[key], value)


def _present(root: Any, path: tuple[Any, ...]) -> bool:
    """Whether ``path`` (a flattened key's) is still in the nested state ``root``."""
    for part in path:
        if isinstance(root, dict) and part in root:
            root = root[part]
        elif isinstance(root, list) and isinstance(part, int) and part < len(root):
            root = root[part]
        else:
            return False
    return True


def _boxed(value: Any) -> Any:
    """A DTensor on this rank's mesh as :class:`LocalChunks` of its one box (DCP's own description of it)."""
    if not isinstance(value, DTensor) or value.device_mesh.get_coordinate() is None:
        return value
    (chunk,) = value.__create_chunk_list__()
    if chunk.sizes.numel() == 0:  # nothing to read; DCP's planner and the narrowing treat it as before
        return value
    return LocalChunks(value.shape, [(chunk.offsets, value.to_local())])


def _finish(
    path: Stored,
    state: PortableState,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    manifest: Manifest,
    strict: bool,
    rng: bool,
    provider: StateDictProvider | None,
) -> None:
    finish_load(state, model, optimizer, strict=strict, provider=provider)
    if rng:
        restore_rng(path, _dist.rank(), _dist.world_size(), manifest.world_size)


def load_latest(
    root: str | os.PathLike[str],
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    strict: bool = True,
    rng: bool = True,
    state_dicts: StateDictProvider | None = None,
    verify: bool = True,
    missing_ok: bool = False,
) -> TrainState | None:
    """:func:`load` the newest intact checkpoint under ``root``; None (nothing loaded) if it holds none.

    Rank 0 picks the directory (:func:`latest`: sizes checked, damaged manifests skipped) and
    every rank verifies its checksums (``verify=True``); a checkpoint that fails is skipped with
    a warning and the next older one is tried, then loaded. An error on any rank (listing the
    root, credentials, an unreachable endpoint) is raised on every rank
    ([Note: collective entry points] in ``_dist.py``).

    Args:
        missing_ok: a ``root`` that does not exist returns None (a first run, e.g. on an object
            store, where a root exists once something is saved under it); False (default) raises,
            since a mistyped root would otherwise silently start training from scratch. An
            existing root without checkpoints returns None either way.

    Raises:
        ValueError: ``root`` does not exist (without ``missing_ok``), is a file, or holds
            checkpoints but every one is damaged (returning None would silently restart training
            from scratch); the message says how to see why.

    Example:
        >>> state = load_latest("/shared/ckpt", model=model, optimizer=opt, missing_ok=True)  # doctest: +SKIP
        >>> start_step = 0 if state is None or state.step is None else state.step + 1  # doctest: +SKIP
    """
    with _dist.entry():  # see [Note: collective entry points] in _dist.py
        settle()  # see load
        skip: set[str] = set()
        while True:
            # Arguments on every rank; rank 0 picks (a root's error raised on every rank), in one round.
            path = _dist.one_round(
                _pick,
                (root, frozenset(skip)),
                {"model": model, "optimizer": optimizer, "verify": verify, "missing_ok": missing_ok},
                result="rank0",
                same=("shardbridge.checkpoint.load_latest", {"root": str(root), "missing_ok": missing_ok}),
            )
            if path is None:
                return None
            # One load: a checkpoint that fails verification is skipped by every rank together.
            state = _load(path, model=model, optimizer=optimizer, strict=strict, rng=rng, state_dicts=state_dicts,
                          verify=verify, skip_damaged=verify)  # fmt: skip
            if state is not None:
                return state
            skip.add(str(path))


def _pick(
    root: Any, skip: frozenset[str], *, model: Any, optimizer: Any, verify: Any, missing_ok: Any
) -> Path | str | None:
    """One round of :func:`load_latest`: the arguments checked; on rank 0, the checkpoint to try."""
    check_model_and_optimizer(model, optimizer)
    _check_verify(verify)
    if not isinstance(missing_ok, bool):
        raise ValueError(f"missing_ok={missing_ok!r} must be True or False")
    if _dist.rank() != 0:
        return None
    where = locate(root, what="root")
    path = newest(where, skip=skip)
    if path is None:
        _nothing_to_load(where, missing_ok=missing_ok)
    return path


def _nothing_to_load(where: Location, *, missing_ok: bool) -> None:
    """No intact checkpoint under the root: fine for an existing root without any, else an error.

    A root that does not exist is refused unless ``missing_ok`` (a mistyped root must not start
    training from scratch); one whose checkpoints are all damaged is refused (returning None
    would restart training from scratch, and later saves would bury the damaged checkpoints).
    """
    backend = where.backend
    kind = backend.kind(where.path)
    if kind == "file":
        raise ValueError(f"checkpoint root {str(where)!r} is a file; pass the folder holding the step-* checkpoints")
    if kind == "missing":
        if missing_ok:
            return
        raise ValueError(
            f"checkpoint root {str(where)!r} does not exist, so there is nothing to resume from; check the path (a "
            "mistyped root would start training from scratch), or pass missing_ok=True where a first run may start "
            "without checkpoints"
        )
    saved = sorted(
        backend.display_name(c)
        for c in backend.candidates(where.path)
        if backend.kind(backend.join(c, MANIFEST_NAME)) == "file"
    )
    if saved:
        shown = ", ".join(saved[-5:]) + (f" and {len(saved) - 5} more" if len(saved) > 5 else "")
        raise ValueError(
            f"every checkpoint under {str(where)!r} is damaged ({shown}); nothing was loaded. See what is wrong with "
            f"`shardbridge ckpt verify {where}`; restore the files, or move the checkpoints away to start from scratch"
        )


def _check_verify(verify: bool) -> None:
    if not isinstance(verify, bool):
        raise ValueError(f"verify={verify!r} must be True (checksums) or False (sizes only)")


def _check_args(
    path: Location | Any,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    strict: bool,
    rng: bool,
    provider: StateDictProvider | None,
) -> tuple[Stored, Manifest]:
    """TypeError / ValueError for a bad argument of :func:`load`; the checkpoint and its validated manifest."""
    check_model_and_optimizer(model, optimizer)
    if not isinstance(path, (str, os.PathLike, Location)):
        raise ValueError(f"path={path!r} must be a checkpoint directory (str or os.PathLike) or URI")
    for name, value in (("strict", strict), ("rng", rng)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r} must be True or False")
    check_provider(provider)
    where = locate(path)
    try:
        path, manifest = open_checkpoint(where)
    except ValueError as exc:
        raise _DamagedManifest(Stored(where.backend, where.path, where.path), exc) from None
    if optimizer is not None and not manifest.has_optimizer:
        raise ValueError(
            f"checkpoint {str(path)!r} has no optimizer state (it was saved with optimizer=None); "
            "pass optimizer=None to load the model only"
        )
    return path, manifest


def _describe_model(sizes: dict[str, Any], manifest: Manifest | None = None) -> str:
    """A model told by its tensors (and, for a checkpoint, what its manifest records): whose checkpoint it is."""
    modules: dict[str, int] = {}
    for key in sizes:
        top = key.split(".")[1] if key.count(".") > 1 else key.partition(".")[2]
        modules[top] = modules.get(top, 0) + 1
    shown = ", ".join(f"{m} ({n} tensors)" if n > 1 else m for m, n in list(modules.items())[:_MAX_NAMES])
    more = f" and {len(modules) - _MAX_NAMES} more" if len(modules) > _MAX_NAMES else ""
    text = f"{sum(math.prod(s) for s in sizes.values()):,} parameters in {len(sizes)} tensors (top-level modules {shown}{more})"
    if manifest is None:
        return text
    export = manifest.extra.get("export")
    files = export.get("files") if isinstance(export, dict) else None
    config = files.get("config.json") if isinstance(files, dict) else None
    architecture = config.get("architectures") if isinstance(config, dict) else None
    if isinstance(architecture, list) and architecture:
        text = f"a {architecture[0]} of {text}"
    return f"{text}, saved at step {manifest.step} by {manifest.world_size} rank(s)"


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:_MAX_NAMES])
    return shown + (f", ... ({len(keys) - _MAX_NAMES} more)" if len(keys) > _MAX_NAMES else "")


def _skip_absent_optim_state(state: PortableState, metadata: Metadata, manifest: Manifest) -> None:
    """Parameters saved without optimizer state load without it. See [Note: parameters without optimizer state].

    Only a parameter whose state keys are ALL absent from the checkpoint and which the manifest
    records as saved without state; any other missing key is left to :func:`_check_compatible`.
    """
    recorded = set(manifest.layout.get(OPTIM_STATE_ABSENT, []))
    if OPTIM_KEY not in state.dcp_state or not recorded:
        return
    names = set(state.dcp_state[MODEL_KEY])
    head = f"{OPTIM_KEY}."
    ours, _ = flatten_state_dict({OPTIM_KEY: state.dcp_state[OPTIM_KEY]})
    owners = {optim_state_owner(k[len(head) :], names) for k in ours} - {None}
    saved = {optim_state_owner(k[len(head) :], names) for k in metadata.state_dict_metadata if k.startswith(head)}
    drop_optim_entries(state, sorted(o for o in owners if o not in saved and o in recorded))


def _check_compatible(
    path: Path, state: PortableState, metadata: Metadata, *, strict: bool, manifest: Manifest | None = None
) -> None:
    """ValueError naming missing / unexpected keys (and what saved the checkpoint) and shape mismatches before DCP runs."""
    saved = metadata.state_dict_metadata
    ours, _ = flatten_state_dict(state.dcp_state)
    tops = tuple(f"{top}." for top in state.dcp_state)
    missing = [k for k in ours if k not in saved]
    # A checkpoint saved before ties were detected also holds the alias: same values, ignored.
    # See [Note: tied tensors] in _state.py.
    aliases = {f"{MODEL_KEY}.{alias}" for alias in state.tied}
    unexpected = [k for k in saved if k.startswith(tops) and k not in ours and k not in aliases]
    if strict and (missing or unexpected):
        parts = []
        if missing:
            parts.append(f"{len(missing)} key(s) of the model are not in the checkpoint: {_names(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} key(s) of the checkpoint are not in the model: {_names(unexpected)}")
        if any(k.startswith(f"{OPTIM_KEY}.state.") for k in missing):
            parts.append(
                "missing optimizer state is accepted only for a parameter whose state keys are all absent and that "
                "the checkpoint's manifest records as saved without state (layout.optim_state_absent); otherwise "
                "the state was lost after the save"
            )
        saved_model = {k: md.size for k, md in saved.items() if k.startswith(f"{MODEL_KEY}.") and hasattr(md, "size")}
        this_model = {k: v.size() for k, v in ours.items() if k.startswith(f"{MODEL_KEY}.") and callable(getattr(v, "size", None))}
        parts.append(f"the checkpoint holds {_describe_model(saved_model, manifest)}; this model has {_describe_model(this_model)}")
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
