"""Build the portable state dict DCP saves and loads: layouts checked, fused params split.

One function, :func:`build_portable_state`, serves save and load alike: it takes torch's
``get_state_dict`` of the live model and optimizer and returns the dict handed to DCP, whose
tensors are the live tensors or views into them. On save DCP reads them; on load DCP writes
into them in place, and :func:`finish_load` hands torch's dicts to ``set_state_dict``.

[Note: DCP layout repair]
~~~~~~~~~~~~~~~~~~~~~~~~~
DCP describes a DTensor's local tensor with one box computed from its placements
(``_compute_local_shape_and_global_offset``). For FSDP2 x TP with uneven TP pieces that box
is not what the rank holds (dim 0 = 9, mesh (dp_shard=4, tp=2), see [Note: strided
sharding order] in ``shardbridge/_layout.py``)::

    coordinate   holds (FSDP2)   DCP describes
    (3, 0)       nothing         row 8          <- save writes 0 rows under a 1-row box
    (3, 1)       row 8           nothing        <- row 8 is never written

``dcp.save`` succeeds; the checkpoint does not load. Before saving, every DTensor is checked
with the layout algebra for EVERY mesh coordinate (pure, so all ranks agree without
communicating). Where the rank's true box differs from DCP's, the entry is replaced by a
:class:`~shardbridge.checkpoint._chunks.LocalChunks` holding the true box and a view of the
local tensor ("repair"), or ``on_bad_layout="error"`` raises. Entries DCP describes right stay
DTensors. Data that is not one box (several ranges along a dim) cannot be described by one
write item per rank and raises. The same objects serve loading (views into the live local
tensors), so a checkpoint saved by any layout loads into any other.

[Note: component names]
~~~~~~~~~~~~~~~~~~~~~~~
A fused parameter (``shardbridge._fused``) is stored as one tensor per component, named by
:func:`component_fqn`: when the parameter's own name is ``weight`` or ``bias``, the fused
MODULE's name is replaced by the component name; otherwise the parameter's name is::

    layers.0.feed_forward.gate_up.weight -> layers.0.feed_forward.gate_proj.weight
                                            layers.0.feed_forward.up_proj.weight
    layers.0.attention.qkv.bias          -> layers.0.attention.{q,k,v}_proj.bias
    blocks.0.mixer.in_proj_packed        -> blocks.0.mixer.{q,k,v,beta}

Optimizer entries follow: ``state.<fused>.exp_avg`` -> ``state.<component>.exp_avg``. A
state shaped like the parameter (DTensor, full plain tensor, or a plain tensor holding exactly
this rank's local shard) is split like the parameter, in component-global coordinates; any
other entry (``step``, ``param_groups.*``) is stored once per component with the same value.
So a model with separate ``gate_proj``/``up_proj`` modules reads the same checkpoint.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from shardbridge._fp8 import plain_state_dict
from shardbridge._fused import FusedSpec, fused_params, split_local
from shardbridge._layout import Chunk, chunk_box, dcp_chunk, find_dcp_mismatches, fsdp_chunk, local_chunk
from shardbridge.checkpoint._chunks import LocalChunks
from shardbridge.checkpoint._provider import StateDictProvider

__all__ = [
    "PACKED_PARAM_GROUPS",
    "OnBadLayout",
    "PortableState",
    "build_portable_state",
    "component_fqn",
    "finish_load",
    "unpack_param_groups",
]

logger = logging.getLogger("shardbridge.checkpoint")

OnBadLayout = Literal["repair", "error"]
MODEL_KEY = "model"
OPTIM_KEY = "optim"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
_LOGGED_REPAIRS: set[tuple[str, tuple[int, ...], tuple[Placement, ...]]] = set()

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (sizes, offsets)


def component_fqn(fused_fqn: str, component: str) -> str:
    """The FQN a fused parameter's component is stored under. See [Note: component names].

    Example:
        >>> component_fqn("layers.0.feed_forward.gate_up.weight", "up_proj")
        'layers.0.feed_forward.up_proj.weight'
        >>> component_fqn("mixer.in_proj_packed", "beta")
        'mixer.beta'
    """
    parts = fused_fqn.split(".")
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        parts[-2] = component
    else:
        parts[-1] = component
    return ".".join(parts)


@dataclass
class PortableState:
    """What :func:`build_portable_state` returns."""

    dcp_state: dict[str, dict[str, Any]]
    """Handed to DCP: ``{"model": {...}, "optim": {...}}`` (no "optim" without optimizer)."""
    model_sd: dict[str, Any]
    """torch's model state dict (values share storage with the model)."""
    optim_sd: dict[str, Any] | None
    """torch's flattened optimizer state dict, or None."""
    aliases: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    """(top, key) of a value torch's dicts hold -> (top, key) of the DCP entry it loads from."""
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Manifest layout record per model key."""
    fused: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Manifest record per fused parameter."""


# --------------------------------------------------------------------------- layout


def _true_chunk(
    shape: tuple[int, ...], mesh_shape: tuple[int, ...], placements: tuple[Placement, ...], coordinate: Sequence[int]
) -> Chunk:
    """What the local tensor at ``coordinate`` holds: FSDP2's layout for placements
    ``fully_shard`` builds, else the DTensor's own (left-to-right) reading."""
    try:
        return fsdp_chunk(shape, mesh_shape, placements, coordinate)
    except ValueError:
        return local_chunk(shape, mesh_shape, placements, coordinate)


def _same_box(a: Box | None, b: Box) -> bool:
    if a is None:
        return False
    if 0 in a[0] and 0 in b[0]:
        return True  # both empty: nothing is written, offsets do not matter
    return a == b


@dataclass(frozen=True)
class _LayoutVerdict:
    bad: bool
    """Some coordinate's true data differs from DCP's box."""
    non_contiguous: bool
    """Some coordinate's true data is not one box."""
    detail: str
    """A mismatch message with a fix, or ""."""


@functools.lru_cache(maxsize=4096)
def _verdict(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Placement, ...],
    names: tuple[str, ...] | None,
) -> _LayoutVerdict:
    """Compare the truth with DCP's box on every coordinate (pure: every rank agrees)."""
    bad = non_contiguous = False
    # Coordinates along Replicate axes hold the same data: checking index 0 suffices.
    axes = [range(1) if isinstance(p, Replicate) else range(s) for s, p in zip(mesh_shape, placements)]
    for coordinate in itertools.product(*axes):
        box = chunk_box(shape, _true_chunk(shape, mesh_shape, placements, coordinate))
        if box is None:
            bad = non_contiguous = True
            break
        if not _same_box(box, dcp_chunk(shape, mesh_shape, placements, coordinate)):
            bad = True
    detail = ""
    if bad:
        mismatches = [
            m
            for m in find_dcp_mismatches(shape, mesh_shape, placements, mesh_dim_names=names)
            if m.kind != "empty_shard"
        ]
        if mismatches:
            detail = mismatches[0].reason
    return _LayoutVerdict(bad=bad, non_contiguous=non_contiguous, detail=detail)


def _describe(fqn: str, t: DTensor) -> str:
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    mesh_text = ", ".join(f"{n}={s}" for n, s in zip(names, mesh.shape))
    return f"{fqn!r} (shape {tuple(t.shape)}, placements {tuple(t.placements)}, mesh ({mesh_text}))"


def _local_box(fqn: str, t: DTensor) -> Box:
    """The true (sizes, offsets) of this rank's local tensor; ValueError if not one box."""
    shape, mesh_shape, placements = tuple(t.shape), tuple(t.device_mesh.shape), tuple(t.placements)
    coordinate = t.device_mesh.get_coordinate()
    assert coordinate is not None, "rank is not part of the DTensor's mesh"
    local_shape = tuple(t._local_tensor.shape)
    candidates = [_true_chunk(shape, mesh_shape, placements, coordinate)]
    candidates.append(local_chunk(shape, mesh_shape, placements, coordinate))
    for chunk in candidates:
        box = chunk_box(shape, chunk)
        if box is None:
            continue
        if box[0] == local_shape:
            return box
    if all(chunk_box(shape, c) is None for c in candidates):
        raise ValueError(
            f"{_describe(fqn, t)}: this rank's data is several separate ranges along a dim, which DCP "
            "cannot describe with one box per rank; redistribute it to Shard/Replicate placements "
            "before saving (e.g. dtensor.redistribute(mesh, [Shard(0), ...])) or choose dims divisible "
            "by the mesh axes that shard them"
        )
    raise ValueError(
        f"{_describe(fqn, t)}: the local tensor has shape {local_shape}, which the layout algebra "
        f"does not explain (it expects {[chunk_box(shape, c) for c in candidates]}); shardbridge cannot "
        "save it safely. Please report this layout"
    )


def _boxed_pieces(local: torch.Tensor, box: Box) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    sizes, offsets = box
    return [(offsets, local)] if 0 not in sizes else []


def _check_dtensor(fqn: str, t: DTensor, on_bad_layout: OnBadLayout, log: bool) -> LocalChunks | None:
    """None when DCP describes ``t`` right, else the repaired chunk object (or raise)."""
    mesh = t.device_mesh
    verdict = _verdict(tuple(t.shape), tuple(mesh.shape), tuple(t.placements), mesh.mesh_dim_names)
    if verdict.non_contiguous:
        raise ValueError(
            f"{_describe(fqn, t)}: some rank holds several separate ranges of a dim, which DCP cannot "
            f"describe with one box per rank ({verdict.detail or 'non-contiguous shard'}); redistribute it "
            "to Shard/Replicate placements before saving"
        )
    if not verdict.bad:
        return None
    if on_bad_layout == "error":
        raise ValueError(
            f"{_describe(fqn, t)}: DCP would describe some ranks' shards wrongly and the checkpoint would "
            f"not load ({verdict.detail}); save with on_bad_layout='repair' (the default) to write explicit "
            "chunk boxes"
        )
    key = (fqn, tuple(t.shape), tuple(t.placements))
    if log and key not in _LOGGED_REPAIRS:
        _LOGGED_REPAIRS.add(key)
        logger.warning(
            "shardbridge.checkpoint: %s: DCP's own description of this layout is wrong (%s); writing "
            "explicit chunk boxes instead (see [Note: DCP layout repair])",
            _describe(fqn, t),
            verdict.detail,
        )
    box = _local_box(fqn, t)
    return LocalChunks(t.shape, _boxed_pieces(t._local_tensor.detach(), box))


# --------------------------------------------------------------------------- fused


def _fused_tp_size(fqn: str, t: DTensor, spec: FusedSpec) -> int:
    """TP degree that interleaves ``t``'s items: the mesh axes named "tp" that Shard spec.dim."""
    mesh = t.device_mesh
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim == 1 and isinstance(t.placements[0], Shard):
            raise ValueError(
                f"fused parameter {fqn!r} is sharded on an unnamed 1-D mesh, so shardbridge cannot tell "
                "TP from FSDP; name the mesh axes (ParallelDims.build_mesh does, or "
                "init_device_mesh(..., mesh_dim_names=('tp',)))"
            )
        names = tuple("" for _ in range(mesh.ndim - 1)) + ("tp",)
    tp = 1
    for name, size, p in zip(names, mesh.shape, t.placements):
        if name == "tp" and type(p) is Shard and p.dim == spec.dim:
            tp *= size
    return tp


def _fused_pieces(
    spec: FusedSpec, local: torch.Tensor, box: Box, tp_size: int
) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Component name -> (component-global offsets, view) pieces of this rank's box."""
    sizes, offsets = box
    out: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {n: [] for n in spec.names}
    if 0 in sizes:
        return out
    for piece in split_local(local, spec, tp_size, offsets[spec.dim]):
        piece_offsets = list(offsets)
        piece_offsets[spec.dim] = piece.component_offset
        out[piece.name].append((tuple(piece_offsets), piece.view))
    return out


@dataclass(frozen=True)
class _ParamInfo:
    """Layout of one parameter that its state entries are compared against."""

    fqn: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtensor: DTensor | None
    spec: FusedSpec | None
    box: Box | None = None
    """The local box a :class:`StateDictProvider` gave (None: from the placements)."""

    def holds_like_param(self, value: DTensor) -> bool:
        """Whether a DTensor state is laid out like the parameter (its box applies)."""
        return tuple(value.shape) == self.shape and tuple(value._local_tensor.shape) == self.local_shape


def _param_box(info: _ParamInfo) -> Box:
    """This rank's box of the DTensor parameter: the provider's, else the layout algebra's."""
    assert info.dtensor is not None
    return info.box if info.box is not None else _local_box(info.fqn, info.dtensor)


def _split_fused_value(info: _ParamInfo, value: Any) -> dict[str, LocalChunks] | None:
    """Per component, the chunk object of a param-shaped tensor; None for other values."""
    spec = info.spec
    assert spec is not None
    if not isinstance(value, torch.Tensor):
        return None
    if isinstance(value, DTensor):
        if tuple(value.shape) != info.shape:
            return None
        # Always explicit boxes: DCP's own description of the fused tensor is never used.
        box = info.box if info.box is not None and info.holds_like_param(value) else _local_box(info.fqn, value)
        local = value._local_tensor.detach()
        tp_size = _fused_tp_size(info.fqn, value, spec)
    elif tuple(value.shape) == info.shape:
        # A full plain tensor, in the parameter's item coordinates ([gate; up] without TP).
        box, local = (tuple(value.shape), (0,) * value.dim()), value.detach()
        tp_size = 1 if info.dtensor is None else _fused_tp_size(info.fqn, info.dtensor, spec)
    elif info.dtensor is not None and tuple(value.shape) == info.local_shape:
        # A plain tensor holding exactly this rank's local shard of the DTensor param.
        box = _param_box(info)
        local, tp_size = value.detach(), _fused_tp_size(info.fqn, info.dtensor, spec)
    else:
        return None
    pieces = _fused_pieces(spec, local, box, tp_size)
    return {name: LocalChunks(spec.component_shape(name, info.shape), pieces[name]) for name in spec.names}


# --------------------------------------------------------------------------- building


def _split_optim_key(key: str, param_fqns: set[str]) -> tuple[str, str, str] | None:
    """``state.<fqn>.exp_avg`` -> ("state.", fqn, ".exp_avg"); longest matching fqn wins."""
    for head in ("state.", "param_groups."):
        if not key.startswith(head):
            continue
        rest = key[len(head) :]
        i = len(rest)
        while (i := rest.rfind(".", 0, i)) > 0:
            if rest[:i] in param_fqns:
                return head, rest[:i], rest[i:]
    return None


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """torch's state dicts, FP8 subclasses made plain. See [Note: portable FP8 checkpoints]."""
    if optimizer is None:
        return plain_state_dict(get_model_state_dict(model, options=_OPTIONS)), None
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    return plain_state_dict(model_sd), plain_state_dict(optim_sd)


def _normalised_fused(model: nn.Module, model_sd: dict[str, Any]) -> dict[str, FusedSpec]:
    """fused_params keyed like the state dict (without compile / wrapper prefixes)."""
    out = {}
    for fqn, spec in fused_params(model).items():
        key = fqn if fqn in model_sd else ".".join(p for p in fqn.split(".") if p not in ("_orig_mod", "module"))
        if key in model_sd:
            out[key] = spec
    return out


def _placements_record(t: torch.Tensor, stored_as: str) -> dict[str, Any]:
    if not isinstance(t, DTensor):
        return {"mesh": {}, "placements": [], "stored_as": stored_as}
    mesh = t.device_mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {
        "mesh": {n: int(s) for n, s in zip(names, mesh.shape)},
        "placements": [repr(p) for p in t.placements],
        "stored_as": stored_as,
    }


def build_portable_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    on_bad_layout: OnBadLayout = "repair",
    log: bool = True,
    provider: StateDictProvider | None = None,
    for_load: bool = False,
) -> PortableState:
    """torch's state dicts of ``model``/``optimizer``, made portable for DCP.

    Args:
        model: the (possibly FSDP2 / TP) model.
        optimizer: its optimizer, or None for the model only.
        on_bad_layout: "repair" or "error", see [Note: DCP layout repair].
        log: log each repaired tensor (once per process); rank 0 passes True.
        provider: the framework's state dicts and local boxes instead of torch's (see
            [Note: state-dict providers] in ``_provider.py``); None = torch's.
        for_load: passed to ``provider.state_dicts``.

    Raises:
        ValueError: a layout DCP cannot describe (or any bad layout with "error"), a fused
            parameter that cannot be split, or component names that collide with existing keys.
    """
    if on_bad_layout not in ("repair", "error"):
        raise ValueError(f"on_bad_layout={on_bad_layout!r} must be 'repair' or 'error'")
    if provider is None:
        model_sd, optim_sd = _state_dicts(model, optimizer)
    else:
        model_sd, optim_sd = provider.state_dicts(model, optimizer, for_load=for_load)
    fused = _normalised_fused(model, model_sd)
    for fqn, spec in fused.items():
        value = model_sd[fqn]
        if not isinstance(value, DTensor) and value.shape[spec.dim] != spec.total:
            raise ValueError(
                f"fused parameter {fqn!r} is a plain tensor of shape {tuple(value.shape)}, a TP-local piece "
                f"(the FusedSpec total along dim {spec.dim} is {spec.total}); its place in the global tensor "
                "is unknown, so it cannot be checkpointed. Make it a DTensor first "
                "(shardbridge._tp.to_dtensor_param)"
            )
    params: dict[str, _ParamInfo] = {}
    for fqn, value in model_sd.items():
        if isinstance(value, torch.Tensor):
            dt = value if isinstance(value, DTensor) else None
            local_shape = tuple(dt._local_tensor.shape) if dt is not None else tuple(value.shape)
            box = _provided_box(provider, fqn, dt) if dt is not None and provider is not None else None
            params[fqn] = _ParamInfo(fqn, tuple(value.shape), local_shape, dt, fused.get(fqn), box)
    state = PortableState(dcp_state={MODEL_KEY: {}}, model_sd=model_sd, optim_sd=optim_sd)
    _add_entries(state, MODEL_KEY, model_sd, params, lambda key: ("", key, ""), on_bad_layout, log)
    if optim_sd is not None:
        state.dcp_state[OPTIM_KEY] = {}
        names = set(params)
        _add_entries(state, OPTIM_KEY, optim_sd, params, lambda key: _split_optim_key(key, names), on_bad_layout, log)
    for fqn, spec in fused.items():
        info = params[fqn]
        tp = _fused_tp_size(fqn, info.dtensor, spec) if info.dtensor is not None else 1
        state.fused[fqn] = {
            "dim": spec.dim,
            "tp_size": tp,
            "components": [{"name": n, "size": s, "fqn": component_fqn(fqn, n)} for n, s in spec.components],
        }
    _pack_param_groups(state)
    return state


# [Note: packed param groups]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch's flattened optimizer state dict has one entry per parameter AND hyperparameter
# (``param_groups.<fqn>.lr``, ``.betas``, ``.eps``, ... ~15 per parameter). Stored one by one,
# each is a DCP bytes item: its own write item, planning entry, metadata record and torch.load
# on every rank (430 of 550 loads for the 21-parameter demo model). They are tiny, identical on
# every rank, and always read together, so format 2 stores them as ONE item,
# ``optim.param_groups``: a list of ``(key, value)`` pairs (a list without tensors is a DCP leaf;
# a dict would be flattened back into single items). Loading unpacks it before anything reads
# the entries; a format-1 checkpoint (single items) is read by unpacking before DCP runs.
PACKED_PARAM_GROUPS = "param_groups"


def _pack_param_groups(state: PortableState) -> None:
    optim = state.dcp_state.get(OPTIM_KEY)
    if not optim:
        return
    keys = [k for k, v in optim.items() if k.startswith("param_groups.") and not isinstance(v, torch.Tensor)]
    if keys:
        optim[PACKED_PARAM_GROUPS] = [(k, optim.pop(k)) for k in keys]


def unpack_param_groups(state: PortableState) -> None:
    """Single ``param_groups.*`` entries again: after a load, or to read a format-1 checkpoint."""
    optim = state.dcp_state.get(OPTIM_KEY)
    if optim and isinstance(optim.get(PACKED_PARAM_GROUPS), list):
        optim.update(dict(optim.pop(PACKED_PARAM_GROUPS)))


def _provided_box(provider: StateDictProvider, fqn: str, t: DTensor) -> Box | None:
    """The provider's box of ``t``'s local tensor, checked to fit in the global shape."""
    offsets = provider.local_offsets(fqn, t)
    if offsets is None:
        return None
    offsets = tuple(int(o) for o in offsets)
    sizes = tuple(t._local_tensor.shape)
    if len(offsets) != t.dim() or any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, t.shape)):
        raise ValueError(
            f"{_describe(fqn, t)}: local_offsets={offsets} from {type(provider).__name__} do not place the "
            f"local tensor of shape {sizes} inside the global shape; return one offset per dim with "
            "offset + local size <= global size (or None to use the placements)"
        )
    return sizes, offsets


def _add_entries(
    state: PortableState,
    top: str,
    sd: dict[str, Any],
    params: dict[str, _ParamInfo],
    parse: Any,
    on_bad_layout: OnBadLayout,
    log: bool,
) -> None:
    out = state.dcp_state[top]
    fused_keys: dict[str, tuple[str, str, str, _ParamInfo]] = {}
    for key, value in sd.items():
        parsed = parse(key)
        info = params.get(parsed[1]) if parsed is not None else None
        if info is not None and info.spec is not None:
            fused_keys[key] = (*parsed, info)
            continue
        out[key] = _plain_entry(key, value, info, on_bad_layout, log and top == MODEL_KEY)
        if top == MODEL_KEY and isinstance(value, torch.Tensor):
            stored = "repaired" if isinstance(out[key], LocalChunks) else "dtensor"
            state.tensors[key] = _placements_record(value, stored if isinstance(value, DTensor) else "plain")
    for key, (head, fqn, tail, info) in fused_keys.items():
        value = sd[key]
        split = _split_fused_value(info, value)
        for name in info.spec.names:
            new_key = f"{head}{component_fqn(fqn, name)}{tail}"
            if new_key in sd or new_key in out:
                raise ValueError(
                    f"fused parameter {fqn!r}: its component {name!r} would be stored as {new_key!r}, which "
                    "the state dict already has; rename the component in its FusedSpec"
                )
            if split is not None:
                out[new_key] = split[name]
            else:
                out[new_key] = value
                state.aliases.setdefault((top, key), (top, new_key))
        if top == MODEL_KEY and isinstance(value, torch.Tensor):
            state.tensors[key] = _placements_record(value, "components")


def _plain_entry(key: str, value: Any, info: _ParamInfo | None, on_bad_layout: OnBadLayout, log: bool) -> Any:
    if isinstance(value, DTensor):
        if info is not None and info.box is not None and info.holds_like_param(value):
            # The provider's box (a parameter or a state laid out like it); placements unused.
            return LocalChunks(info.shape, _boxed_pieces(value._local_tensor.detach(), info.box))
        repaired = _check_dtensor(key, value, on_bad_layout, log)
        return value if repaired is None else repaired
    if (
        isinstance(value, torch.Tensor)
        and info is not None
        and info.dtensor is not None
        and tuple(value.shape) == info.local_shape
        and info.local_shape != info.shape
    ):
        # A plain tensor holding this rank's local shard of a DTensor parameter (fused
        # optimizers keep states so): placed where the parameter's local shard is.
        return LocalChunks(info.shape, _boxed_pieces(value.detach(), _param_box(info)))
    return value


def finish_load(
    state: PortableState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    strict: bool,
    provider: StateDictProvider | None = None,
) -> None:
    """After DCP filled ``state.dcp_state`` in place: copy aliased values back, then
    set_state_dict (or the provider's ``load_state_dicts``)."""
    unpack_param_groups(state)  # See [Note: packed param groups]
    for (top, key), (src_top, src_key) in state.aliases.items():
        target = state.model_sd if top == MODEL_KEY else state.optim_sd
        value = state.dcp_state[src_top].get(src_key)
        if isinstance(value, torch.Tensor):
            continue  # the same tensor object, filled in place
        assert target is not None
        target[key] = value
    for top, sd in ((MODEL_KEY, state.model_sd), (OPTIM_KEY, state.optim_sd)):
        if sd is None:
            continue
        for key, value in state.dcp_state[top].items():
            if key in sd and not isinstance(value, (torch.Tensor, LocalChunks)):
                sd[key] = value  # non-tensor values DCP replaced (param_groups entries)
    if provider is not None:
        provider.load_state_dicts(model, optimizer, state.model_sd, state.optim_sd, strict=strict)
        return
    options = StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)
    if optimizer is None:
        set_model_state_dict(model, state.model_sd, options=options)
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state.model_sd, optim_state_dict=state.optim_sd, options=options
        )
