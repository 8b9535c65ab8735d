"""Build the portable state dict DCP saves and loads: layouts checked, fused params split.

One function, :func:`build_portable_state`, serves save and load alike: it takes torch's
``get_state_dict`` of the live model and optimizer and returns the dict handed to DCP, whose
tensors are the live tensors or views into them. On save DCP reads them; on load DCP writes
into them in place, and :func:`finish_load` hands torch's dicts to ``set_state_dict``.

How layouts DCP would describe wrongly are repaired: [Note: DCP layout repair] in
``_repair.py``. How fused parameters are stored: [Note: component names] in
``_components.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from shardbridge._compat import WRAPPER_NAMES, local_tensor, state_dict_fqns
from shardbridge._fused import FusedSpec, fused_params
from shardbridge.checkpoint.state._chunks import LocalChunks
from shardbridge.checkpoint.state._components import (
    ParamInfo,
    component_fqn,
    fused_tp_size,
    param_box,
    split_fused_value,
)
from shardbridge.checkpoint.state._provider import StateDictProvider, rank_local_tensors
from shardbridge.checkpoint.state._repair import (
    Box,
    OnBadLayout,
    box_rule,
    boxed_pieces,
    check_dtensor,
    describe,
    dtensor_origin,
)
from shardbridge.fp8._tensors import plain_state_dict

__all__ = [
    "PACKED_PARAM_GROUPS",
    "OnBadLayout",
    "PortableState",
    "build_portable_state",
    "component_fqn",
    "drop_optim_entries",
    "finish_load",
    "optim_state_owner",
    "unpack_param_groups",
]

MODEL_KEY = "model"
OPTIM_KEY = "optim"
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
    packed_param_groups: dict[str, Any] = field(default_factory=dict)
    """The live ``optim.param_groups`` entries (component names) before a load replaced them."""
    tied: dict[str, str] = field(default_factory=dict)
    """Model key of a tied alias -> the key it is stored under. See [Note: tied tensors]."""
    no_optim_state: list[str] = field(default_factory=list)
    """Stored names (component names for fused params) of parameters the optimizer holds no
    state for. See [Note: parameters without optimizer state]."""
    dropped_optim_state: list[str] = field(default_factory=list)
    """Load only: stored names whose optimizer state is absent from the checkpoint as recorded;
    their state is dropped after the load. See [Note: parameters without optimizer state]."""


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


def _normalised_fused(model: nn.Module, model_sd: dict[str, Any], *, every: bool) -> dict[str, FusedSpec]:
    """fused_params keyed like the state dict (:func:`state_dict_names`, the first that is a key).

    ``every``: the state dict is torch's, which holds every parameter, so a fused parameter without
    a key is refused (never stored whole: its TP-interleaved order would load wrong at another TP
    size); a provider's state dict may store a parameter under another name."""
    out = {}
    for fqn, spec in fused_params(model).items():
        key = next((k for k in state_dict_names(model, fqn) if k in model_sd), None)
        if key is not None:
            out[key] = spec
        elif every:
            raise ValueError(
                f"fused parameter {fqn!r} has no key in torch's state dict of this model "
                f"(which holds {sorted(model_sd)[:3]} ...): a state-dict hook or a wrapper torch does not know "
                "renamed or removed it; checkpoint the model without it, or pass a StateDictProvider (state_dicts=) "
                "whose keys name the parameter"
            )
    return out


def state_dict_names(model: nn.Module, fqn: str) -> list[str]:
    """The keys a state dict may hold the tensor ``fqn`` of ``model`` under, the most certain first.

    torch's own key (``get_state_dict`` drops wrappers by module type: activation checkpointing's
    ``_checkpoint_wrapped_module``, ``torch.compile``'s ``_orig_mod``, DDP's ``module``; a
    submodule merely named ``module`` keeps its name), then the name itself, then the name without
    those parts (a framework's wrapper torch does not know, such as Megatron-FSDP's ``module``,
    whose provider keys the state dicts by the user's names).
    """
    parts = fqn.split(".")
    if WRAPPER_NAMES.isdisjoint(parts):
        return [fqn]
    try:
        torchs = sorted(state_dict_fqns(model, fqn))
    except AttributeError:  # a mark naming a tensor the model no longer has
        torchs = []
    return list(dict.fromkeys([*torchs, fqn, ".".join(p for p in parts if p not in WRAPPER_NAMES)]))


# [Note: tied tensors]
# ~~~~~~~~~~~~~~~~~~~~
# A parameter (or buffer) registered under several names, e.g. tied input/output embeddings
# (``output.weight`` IS ``tok_embeddings.weight``; under FSDP2 x TP one DTensor), appears in
# torch's model state dict once per name, each a view of the same storage (the optimizer
# holds it once, under the first name). It is stored ONCE, under the first name in
# ``named_parameters(remove_duplicate=False)`` order (the module registration order, the
# same on every rank); the manifest records the alias as ``"stored_as": "tied", "tied_to":
# <key>``. On load the stored entry is filled in place, and every name sees it (one
# storage). Ties are found structurally (the same Parameter object), never by comparing
# data pointers alone (an empty local shard has no storage to compare); a tie is kept only
# where the state-dict values really share storage (a provider's copies are stored apart).
# A checkpoint written before ties were detected holds both names: the alias key is then
# ignored on load (same values). Export writes an alias only if its name map asks for it
# (see [Note: streaming export] in ``_export.py``).


def _tied_keys(model: nn.Module, model_sd: dict[str, Any], fused: dict[str, FusedSpec]) -> dict[str, str]:
    """Alias key -> stored key for tensors registered under several names. See [Note: tied tensors]."""
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for fqn, tensor in named:
        key = next((k for k in state_dict_names(model, fqn) if k in model_sd), None)
        if key is None or key in fused:
            continue
        canonical = first.setdefault(id(tensor), key)
        if canonical != key and canonical not in fused and _same_storage(model_sd[canonical], model_sd[key]):
            tied[key] = canonical
    return tied


def _same_storage(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or type(a) is not type(b):
        return False
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if isinstance(a, DTensor):
        if a.placements != b.placements or a.device_mesh != b.device_mesh:
            return False
        a, b = local_tensor(a), local_tensor(b)
    if a.numel() == 0:
        return a.shape == b.shape
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


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
            parameter that cannot be split, component names that collide with existing keys,
            or a rank-local tensor no provider took over ([Note: rank-local tensors]).
    """
    if on_bad_layout not in ("repair", "error"):
        raise ValueError(f"on_bad_layout={on_bad_layout!r} must be 'repair' or 'error'")
    if provider is None:
        model_sd, optim_sd = _state_dicts(model, optimizer)
    else:
        model_sd, optim_sd = provider.state_dicts(model, optimizer, for_load=for_load)
    _check_rank_local(model, model_sd, optim_sd, provider)
    fused = _normalised_fused(model, model_sd, every=provider is None)
    for fqn, spec in fused.items():
        value = model_sd[fqn]
        if not isinstance(value, DTensor) and value.shape[spec.dim] != spec.total:
            raise ValueError(
                f"fused parameter {fqn!r} is a plain tensor of shape {tuple(value.shape)}, a TP-local piece "
                f"(the FusedSpec total along dim {spec.dim} is {spec.total}); its place in the global tensor "
                "is unknown, so it cannot be checkpointed. Make it a DTensor first "
                "(shardbridge._tp.to_dtensor_param)"
            )
    tied = _tied_keys(model, model_sd, fused)
    params: dict[str, ParamInfo] = {}
    for fqn, value in model_sd.items():
        if isinstance(value, torch.Tensor):
            dt = value if isinstance(value, DTensor) else None
            local_shape = tuple(local_tensor(dt).shape) if dt is not None else tuple(value.shape)
            box = _provided_box(provider, fqn, dt) if dt is not None and provider is not None else None
            params[fqn] = ParamInfo(fqn, tuple(value.shape), local_shape, dt, fused.get(fqn), box)
    state = PortableState(dcp_state={MODEL_KEY: {}}, model_sd=model_sd, optim_sd=optim_sd, tied=tied)
    stored_sd = {k: v for k, v in model_sd.items() if k not in tied}
    _add_entries(state, MODEL_KEY, stored_sd, params, lambda key: ("", key, ""), on_bad_layout, log)
    for alias, key in tied.items():
        record = state.tensors.get(key) or _placements_record(model_sd[alias], "plain")
        state.tensors[alias] = {**record, "stored_as": "tied", "tied_to": key}
    if optim_sd is not None:
        state.dcp_state[OPTIM_KEY] = {}
        names = set(params)
        split = {key: _split_optim_key(key, names) for key in optim_sd}  # once per key: both steps use it
        _add_entries(state, OPTIM_KEY, optim_sd, params, split.__getitem__, on_bad_layout, log)
        state.no_optim_state = _stateless_params(split, fused)
    for fqn, spec in fused.items():
        info = params[fqn]
        tp = fused_tp_size(fqn, info.dtensor, spec) if info.dtensor is not None else 1
        state.fused[fqn] = {
            "dim": spec.dim,
            "tp_size": tp,
            "components": [{"name": n, "size": s, "fqn": component_fqn(fqn, n)} for n, s in spec.components],
        }
    _pack_param_groups(state)
    return state


def _check_rank_local(
    model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any] | None, provider: StateDictProvider | None
) -> None:
    """ValueError if a rank-local tensor would be stored under its own name. See [Note: rank-local tensors]."""
    marked = rank_local_tensors(model)
    if not marked:
        return
    hints = {key: hint for fqn, hint in marked.items() for key in state_dict_names(model, fqn)}  # torch's spelling
    stored = [(key, key) for key in model_sd if key in hints]  # (state-dict key, marked tensor)
    # "state.<fqn>.<state name>" (nested states: "<name>.<name>"): the owner is parts [1, stop) for
    # stop = fqn.count(".") + 2, one lookup per depth of the marked names (2.5x faster than trying
    # every dot, _split_optim_key, on 6k state keys)
    stops = {fqn.count(".") + 2 for fqn in hints}
    for key in optim_sd or ():
        if key.startswith("state."):
            parts = key.split(".")
            for stop in stops:
                if len(parts) > stop and (owner := ".".join(parts[1:stop])) in hints:
                    stored.append((key, owner))
                    break
    if not stored:
        return
    keys = ", ".join(repr(key) for key, _ in stored[:3]) + (f" and {len(stored) - 3} more" if len(stored) > 3 else "")
    by = "torch's state dicts" if provider is None else f"the state dicts of {type(provider).__name__}"
    raise ValueError(
        f"{by} would store {keys} under the same name on every rank, but {stored[0][1]!r} is rank-local "
        "(marked by mark_rank_local): it holds different data on each rank, so DCP would keep one rank's copy "
        f"and silently drop the others; {hints[stored[0][1]]}"
    )


# [Note: parameters without optimizer state]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A parameter that never gets a gradient (a DSA indexer behind a top-k, a compressor unused at
# short sequences) has no optimizer state: AdamW creates it lazily at the first step with a
# gradient. A fresh optimizer's ``get_state_dict`` initialises state for EVERY parameter, so a
# load would miss that parameter's ``optim.state.<fqn>.*`` keys. Save records these parameters
# (stored names) in the manifest, ``layout.optim_state_absent``. On load, a parameter whose
# state keys are ALL absent from the checkpoint and that the manifest records so loads with no
# state: its keys are not read, and after ``set_state_dict`` its state is removed from the
# optimizer, as in the saved run (the next step with a gradient initialises it). Any other
# missing key (some of a parameter's keys, or all of them without the record: state lost after
# the save) stays an error under strict.


def _stateless_params(split: dict[str, tuple[str, str, str] | None], fused: dict[str, FusedSpec]) -> list[str]:
    """Stored names of the parameters in ``param_groups`` with no ``state.*`` key (``split``: each
    optimizer key's :func:`_split_optim_key`)."""
    grouped, with_state = set(), set()
    for parsed in split.values():
        if parsed is not None:
            (grouped if parsed[0] == "param_groups." else with_state).add(parsed[1])
    out = []
    for fqn in sorted(grouped - with_state):
        spec = fused.get(fqn)
        out.extend([component_fqn(fqn, n) for n in spec.names] if spec is not None else [fqn])
    return out


def optim_state_owner(key: str, names: set[str]) -> str | None:
    """The stored parameter name of a flattened optimizer ``state.<name>.<...>`` key, else None."""
    parsed = _split_optim_key(key, names)
    return parsed[1] if parsed is not None and parsed[0] == "state." else None


def drop_optim_entries(state: PortableState, names: list[str]) -> None:
    """Load only: do not read the optimizer state of ``names``; dropped after the load."""
    if not names or OPTIM_KEY not in state.dcp_state:
        return
    wanted = set(names)
    model_names = set(state.dcp_state[MODEL_KEY])
    optim = state.dcp_state[OPTIM_KEY]
    for key in [k for k in optim if optim_state_owner(k, model_names) in wanted]:
        del optim[key]
    state.aliases = {k: v for k, v in state.aliases.items() if v[0] != OPTIM_KEY or v[1] in optim}
    state.dropped_optim_state = sorted(wanted)


def _drop_loaded_state(state: PortableState, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Remove the optimizer state of ``state.dropped_optim_state`` (after set_state_dict)."""
    if not state.dropped_optim_state:
        return
    stored_to_param = {}
    for fqn, record in state.fused.items():
        for component in record["components"]:
            stored_to_param[component["fqn"]] = fqn
    by_name: dict[str, nn.Parameter] = {}
    names = [(state_dict_names(model, fqn), param) for fqn, param in model.named_parameters(remove_duplicate=False)]
    for rank in range(max((len(n) for n, _ in names), default=0)):  # every parameter's most certain name first
        for candidates, param in names:
            if rank < len(candidates):
                by_name.setdefault(candidates[rank], param)
    for name in state.dropped_optim_state:
        param = by_name.get(stored_to_param.get(name, name))
        if param is None:
            raise ValueError(
                f"parameter {name!r} has no optimizer state in the checkpoint, but this model has no parameter of "
                "that name to clear it on; load into the model the checkpoint was saved from"
            )
        optimizer.state.pop(param, None)


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
        state.packed_param_groups = dict(optim[PACKED_PARAM_GROUPS])  # the live values, before DCP replaces them


def unpack_param_groups(state: PortableState) -> None:
    """Single ``param_groups.*`` entries again: after a load, or to read a format-1 checkpoint."""
    optim = state.dcp_state.get(OPTIM_KEY)
    if optim and isinstance(optim.get(PACKED_PARAM_GROUPS), list):
        optim.update(dict(optim.pop(PACKED_PARAM_GROUPS)))


def _kind(value: Any) -> Any:
    """What a hyperparameter must stay across a save/load: a number, a string, a sequence of a length."""
    if value is None:
        return None
    if isinstance(value, (bool, int, float, torch.Tensor)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, tuple)):
        return f"a sequence of {len(value)}"
    return type(value).__name__


def _check_loaded_param_groups(state: PortableState, *, strict: bool) -> None:
    """ValueError unless the loaded ``optim.param_groups`` is what save writes, fitting this optimizer.

    It is a bytes item (``torch.load(weights_only=True)``: no code runs), but a damaged or
    crafted one could still hold anything; without this check the optimizer would silently
    keep its own hyperparameters. See [Note: packed param groups].
    """
    optim = state.dcp_state.get(OPTIM_KEY)
    if not optim or PACKED_PARAM_GROUPS not in optim or not state.packed_param_groups:
        return
    loaded = optim[PACKED_PARAM_GROUPS]
    where = f"checkpoint entry {OPTIM_KEY}.{PACKED_PARAM_GROUPS} (the optimizer's hyperparameters)"
    pairs = isinstance(loaded, list) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and p[0].startswith("param_groups.")
        for p in loaded
    )
    if not pairs:
        raise ValueError(
            f"{where} is a {type(loaded).__name__}, not a list of (key, value) pairs: the checkpoint is damaged or "
            "was not written by shardbridge (run `shardbridge ckpt verify` on it)"
        )
    got = dict(loaded)
    live_values = state.packed_param_groups
    missing = [k for k in live_values if k not in got]
    if strict and missing:
        raise ValueError(
            f"{where} lacks {len(missing)} of this optimizer's hyperparameters ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); load it into the optimizer type it was saved from, or pass "
            "strict=False to keep this optimizer's values for those"
        )
    for key, value in got.items():
        live = live_values.get(key)
        if key in live_values and None not in (_kind(live), _kind(value)) and _kind(live) != _kind(value):
            raise ValueError(
                f"{where}: {key!r} is {_kind(value)} ({value!r:.60}) in the checkpoint but {_kind(live)} in this "
                "optimizer: the checkpoint is damaged or comes from another optimizer type"
            )


def _provided_box(provider: StateDictProvider, fqn: str, t: DTensor) -> Box | None:
    """The provider's box of ``t``'s local tensor, checked to fit in the global shape."""
    offsets = provider.local_offsets(fqn, t)
    if offsets is None:
        return None
    offsets = tuple(int(o) for o in offsets)
    sizes = tuple(local_tensor(t).shape)
    if len(offsets) != t.dim() or any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, t.shape)):
        raise ValueError(
            f"{describe(fqn, t)}: local_offsets={offsets} from {type(provider).__name__} do not place the "
            f"local tensor of shape {sizes} inside the global shape; return one offset per dim with "
            "offset + local size <= global size (or None to use the placements)"
        )
    return sizes, offsets


def _add_entries(
    state: PortableState,
    top: str,
    sd: dict[str, Any],
    params: dict[str, ParamInfo],
    parse: Any,
    on_bad_layout: OnBadLayout,
    log: bool,
) -> None:
    out = state.dcp_state[top]
    fused_keys: dict[str, tuple[str, str, str, ParamInfo]] = {}
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
        elif top == MODEL_KEY and isinstance(value, LocalChunks):
            # A provider's own boxes (e.g. per-expert parameters stacked into [E, ...]).
            state.tensors[key] = {"mesh": {}, "placements": [], "stored_as": "boxes"}
    for key, (head, fqn, tail, info) in fused_keys.items():
        value = sd[key]
        split = split_fused_value(info, value)
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


def _plain_entry(key: str, value: Any, info: ParamInfo | None, on_bad_layout: OnBadLayout, log: bool) -> Any:
    if isinstance(value, DTensor):
        if info is not None and info.box is not None and info.holds_like_param(value):
            # The provider's box (a parameter or a state laid out like it); placements unused.
            return LocalChunks(info.shape, boxed_pieces(local_tensor(value).detach(), info.box))
        repaired = check_dtensor(key, value, on_bad_layout, log)
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
        local = value.detach()
        origin = None  # a provider's box: not what the placements give
        if info.box is None:
            origin = dtensor_origin(info.dtensor, box_rule(info.fqn, info.dtensor)[1])
            origin = dataclasses.replace(origin, dtype=local.dtype)
        return LocalChunks(info.shape, boxed_pieces(local, param_box(info)), origin=origin)
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
    _check_loaded_param_groups(state, strict=strict)
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
    else:
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)
        if optimizer is None:
            set_model_state_dict(model, state.model_sd, options=options)
        else:
            set_state_dict(
                model, optimizer, model_state_dict=state.model_sd, optim_state_dict=state.optim_sd, options=options
            )
    if optimizer is not None:
        _drop_loaded_state(state, model, optimizer)  # See [Note: parameters without optimizer state]
