"""TE ``GroupedLinear`` experts on the core's ``ep`` axis, checkpointed as global ``[E, out, in]`` tensors.

Public: :func:`shard_grouped_experts`, :class:`ExpertStateDicts`. ``ExpertState`` and
``EXPERT_ATTR`` are implementation details (the rest of the adapter reads the mark).

[Note: GroupedLinear experts]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
TE's ``GroupedLinear(num_gemms, in_features, out_features)`` holds one 2-D parameter per GEMM,
``weight0 .. weight{num_gemms-1}`` ``[out, in]`` (and ``bias0 ..`` ``[out]`` with ``bias=True``),
and runs GEMM i on the next ``m_splits[i]`` rows of its input. As the routed experts of a MoE
layer (Megatron-Core's ``TEGroupedMLP``: ``linear_fc1`` ``[2I, D]`` per expert, ``linear_fc2``
``[D, I]``) under expert parallelism, ep rank j builds ``num_gemms = E / ep`` of them, and its
``weight{i}`` is GLOBAL expert ``g = j * E/ep + i``. Nothing in the parameters says so:
``weight0`` is a different expert on every ep rank, under one name. The core stores an expert
tensor as ONE tensor whose dim 0 is the global expert index ([Note: expert checkpoints] in
``shardbridge/_ep.py``), so :class:`ExpertStateDicts` presents the per-expert parameters of a
GroupedLinear as the pieces of such a tensor::

    E = 4 experts, ep = 2, FSDP2 over efsdp = 2: every rank builds GroupedLinear(2, in, out)

    rank (efsdp r, ep j)   holds               in the checkpoint: <fqn>.weight [4, out, in]
    (0, 0)                 weight0, weight1    experts 0..1, rows torch.chunk(out, 2)[0]
    (1, 0)                 weight0, weight1    experts 0..1, rows torch.chunk(out, 2)[1]
    (0, 1)                 weight0, weight1    experts 2..3, rows torch.chunk(out, 2)[0]
    (1, 1)                 weight0, weight1    experts 2..3, rows torch.chunk(out, 2)[1]

The stacked name is TE's own: with ``single_grouped_weight=True`` a GroupedLinear registers ONE
``weight`` ``[num_gemms, out, in]`` and maps it to and from ``weight0 ..`` when loading (TE 2.20.2
``module/grouped_linear.py``, ``_remap_grouped_weight_state_dict_keys``); here it spans all E
experts, not the local ones. ``names=`` renames it, e.g. to the reference MoE's
``experts.gate_up_proj`` / ``experts.down_proj`` (the same ``[E, 2I, D]`` / ``[E, D, I]``; TE's
fc1 output is ``[gate; up]`` as the core's, split by ``chunk(2, -1)``), so either model loads the
other's checkpoints.

:func:`shard_grouped_experts` marks each GroupedLinear with its ep coordinates and makes the
experts module an FSDP2 unit over ``efsdp`` (``shardbridge.ep.shard_experts`` with nothing to split:
the ep split is the modules' own), gradients divided by ``dp_cp`` as for every expert.
``set_device_mesh`` and ``default_units`` leave marked modules alone: experts are not
tensor-parallel ([Note: expert axes] in ``shardbridge/_mesh.py``). :class:`ExpertStateDicts`
takes torch's state dicts and replaces, for each marked module and each per-expert group
(``weight*``, ``bias*``), the model entry, every optimizer state laid out like it and the
param-group entries by ONE entry of the stacked name: a DTensor on ``pm.expert_mesh``
``(dp_replicate, efsdp, ep)`` with ``Shard(0)`` on ep and FSDP2's placement of the per-expert
tensor one dim to the right (``Shard(d)`` -> ``Shard(d + 1)`` on efsdp), global shape
``[E, *per-expert shape]``. Scalars (AdamW's ``step``) and hyperparameters must agree across the
local experts and are stored once; an ``_extra_state`` without FP8 state is not stored (models
without TE, the reference MoE among them, have none; on load the module keeps its own). The
stack is a copy (one extra copy of the local experts while a save is built); after a load each
slice is copied back into ``weight{i}`` and its states, and torch's per-expert dicts go to
``set_state_dict``.

Without the provider, torch's state dicts name ``weight0`` alike on every ep rank, with the same
box: DCP would take the ranks for replicas, keep one rank's copy of each piece, and lose the other
experts without an error (measured before the guard: a same-layout round trip returned rows of
other ep ranks' experts). So :func:`shard_grouped_experts` marks every per-expert parameter
rank-local (``shardbridge.adapters.mark_rank_local``, [Note: rank-local tensors] in the core),
and ``save`` / ``load`` without ``state_dicts=ExpertStateDicts(...)`` raise ValueError on every
rank, naming the first ``weight{i}`` and the provider (``test_without_the_provider_save_and_load_raise``).
The mark is set at every ep, ep=1 and one process included, where the default path would lose
nothing: every checkpoint of these experts then has one format, the stacked one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from shardbridge import ParallelMesh, PrecisionPolicy
from shardbridge._compat import state_dict_fqns
from shardbridge.ep import shard_experts
from shardbridge.fp8 import plain_state_dict
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard

from shardbridge_te._compat import grouped_linear_params
from shardbridge_te._placements import EXPERT_ATTR

__all__ = ["ExpertState", "ExpertStateDicts", "expert_state", "shard_grouped_experts"]

_PROVIDER_HINT = (
    "this is a GroupedLinear expert put on the ep axis by shardbridge_te.shard_grouped_experts: pass "
    "state_dicts=shardbridge_te.ExpertStateDicts(...) to shardbridge.checkpoint.save and load (and "
    "load_latest), which stores each GroupedLinear's experts as one [E, ...] tensor"
)
"""The end of the error ``save`` / ``load`` raise without the provider ([Note: rank-local tensors] in the core)."""

NameMap = Mapping[str, str] | Callable[[str], str]
"""Stacked FQN (``<module fqn>.weight``) -> the name stored in the checkpoint."""

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass(frozen=True, kw_only=True)
class ExpertState:
    """Where one GroupedLinear's GEMMs sit among the global experts."""

    num_experts: int
    """E, the global number of experts of the layer."""
    first: int
    """Global index of local GEMM 0 (``ep_rank * E / ep``)."""
    groups: Mapping[str, tuple[str, ...]]
    """``{"weight": ("weight0", ...), "bias": (...)}``: the per-expert parameter names."""
    mesh: ParallelMesh | None
    """The run's mesh; None = one process (every expert local)."""


def expert_state(module: nn.Module) -> ExpertState | None:
    """The mark :func:`shard_grouped_experts` left on ``module``, or None."""
    return getattr(module, EXPERT_ATTR, None)


def shard_grouped_experts(
    experts: nn.Module,
    mesh: ParallelMesh | None,
    policy: PrecisionPolicy | None = None,
    *,
    num_experts: int,
) -> nn.Module:
    """Put the TE ``GroupedLinear`` experts of ``experts`` on the ``ep`` axis; in place.

    ``experts`` is a GroupedLinear or a module holding them (Megatron-Core's ``TEGroupedMLP``:
    ``linear_fc1``, ``linear_fc2``), built on every ep rank with its ``num_experts / ep`` local
    experts (GEMM i = global expert ``ep_rank * num_experts / ep + i``), not tensor-parallel
    (``tp_size=1``, ``parallel_mode=None``). Marks each GroupedLinear with its ep coordinates
    (read by :class:`ExpertStateDicts`; ``set_device_mesh`` and ``default_units`` then leave
    it alone), its per-expert parameters rank-local (``shardbridge.checkpoint.save`` / ``load``
    refuse them without ``state_dicts=ExpertStateDicts(...)``) and makes ``experts`` one FSDP2 unit over ``mesh.expert_fsdp_mesh``, gradients
    divided by ``dp_cp`` (``shardbridge.ep.shard_experts``). Call it before
    :func:`~shardbridge_te.parallelize` (or ``set_device_mesh`` / ``apply_fsdp``), on meta or
    real parameters; run the experts through ``shardbridge.ep.run_experts``. See
    [Note: GroupedLinear experts].

    Args:
        experts: the experts module.
        mesh: the run's :class:`~shardbridge.ParallelMesh` (``ParallelDims(..., ep=...)``);
            None = one process, every expert local (nothing is sharded; the mark still makes
            checkpoints hold the stacked tensors).
        policy: mixed precision for the experts' FSDP2 unit; None = no casting.
        num_experts: E, the global number of experts; every GroupedLinear must have
            ``num_gemms = E / ep``.

    Returns:
        ``experts``.

    Raises:
        ValueError: no GroupedLinear in ``experts``, ``num_gemms * ep != num_experts``, a
            tensor-parallel GroupedLinear, or one already marked / converted.
        NotImplementedError: FP8 parameters (``quantized_model_init``) or TE's single grouped
            parameters (``single_grouped_weight`` / ``single_grouped_bias``).

    Example:
        >>> pm = ParallelDims(dp_shard=4, ep=2).build_mesh("cuda")  # doctest: +SKIP
        >>> for layer in model.decoder.layers:  # doctest: +SKIP
        ...     shard_grouped_experts(layer.mlp.experts, pm, num_experts=8)
        >>> shardbridge_te.parallelize(model, pm)  # doctest: +SKIP
        >>> ckpt.save(path, model=model, optimizer=opt, state_dicts=ExpertStateDicts())  # doctest: +SKIP
    """
    from shardbridge.adapters import mark_rank_local

    from shardbridge_te._apply import te_modules

    grouped = [(fqn, m) for fqn, m, kind in te_modules(experts) if kind == "GroupedLinear"]
    owner = type(experts).__name__
    if not grouped:
        raise ValueError(
            f"shard_grouped_experts: {owner} holds no TransformerEngine GroupedLinear; pass the module "
            "holding the experts' GroupedLinears (e.g. Megatron-Core's TEGroupedMLP)"
        )
    ep = 1 if mesh is None else mesh.dims.ep
    ep_rank = 0 if mesh is None else mesh["ep"].get_local_rank()
    marks = {}
    for fqn, module in grouped:
        where = f"{owner}.{fqn}" if fqn else owner
        groups = _check_grouped_linear(where, module, num_experts=num_experts, ep=ep)
        num_local = num_experts // ep
        marks[fqn] = ExpertState(num_experts=num_experts, first=ep_rank * num_local, groups=groups, mesh=mesh)
    for fqn, module in grouped:
        setattr(module, EXPERT_ATTR, marks[fqn])
        # weight0 is another expert on every ep rank: only ExpertStateDicts stores it right
        names = [n for group in marks[fqn].groups.values() for n in group]
        mark_rank_local(module, names, provider_hint=_PROVIDER_HINT)
        _install_portable_extra_state(module)
    if mesh is not None:
        # No parameter of its own to split over ep (each rank built its own experts): FSDP2 over
        # efsdp (HSDP: x dp_replicate), gradient divided by dp_cp. See [Note: expert axes].
        shard_experts(experts, mesh, policy, params=[])
    return experts


def _check_grouped_linear(where: str, module: nn.Module, *, num_experts: int, ep: int) -> dict[str, tuple[str, ...]]:
    """ValueError / NotImplementedError unless ``module`` can hold ``num_experts / ep`` experts."""
    if expert_state(module) is not None:
        raise ValueError(f"{where} is already on the ep axis; call shard_grouped_experts once per experts module")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts={num_experts!r} must be a positive int (the layer's global number of experts)")
    num_gemms = int(module.num_gemms)
    if num_gemms * ep != num_experts:
        raise ValueError(
            f"{where}: GroupedLinear.num_gemms({num_gemms}) * ep({ep}) != num_experts({num_experts}); each ep "
            "rank builds its own num_experts / ep experts: choose ep dividing num_experts and build "
            "GroupedLinear(num_experts // ep, ...)"
        )
    tp_size, mode = int(getattr(module, "tp_size", 1) or 1), getattr(module, "parallel_mode", None)
    if tp_size != 1 or mode is not None:
        raise ValueError(
            f"{where}: GroupedLinear(tp_size={tp_size}, parallel_mode={mode!r}) is tensor-parallel; experts on "
            "the ep axis are not (tp ranks hold different experts instead): build it with tp_size=1, "
            "parallel_mode=None"
        )
    if getattr(module, "primary_weights_in_fp8", False):
        raise NotImplementedError(
            f"{where}: FP8 parameters (quantized_model_init) on GroupedLinear experts are not supported yet; "
            "build the experts outside quantized_model_init (FP8 compute under te.autocast is unaffected)"
        )
    groups = grouped_linear_params(module)  # NotImplementedError for single grouped parameters
    for names in groups.values():
        for name in names:
            param = module._parameters.get(name)
            if isinstance(param, DTensor):
                raise ValueError(
                    f"{where}.{name} is already a DTensor; call shard_grouped_experts before set_device_mesh, "
                    "parallelize or fully_shard"
                )
    return groups


def _install_portable_extra_state(module: nn.Module) -> None:
    from shardbridge_te._checkpoint import install_portable_extra_state
    from shardbridge_te._compat import te_version
    from shardbridge_te._patches import gate

    if gate("portable_extra_state", te_version()):  # see [Note: portable _extra_state]
        install_portable_extra_state(module)


# --------------------------------------------------------------------------- the provider


@dataclass
class _Stacked:
    """One stacked entry: the per-expert keys it replaced and what it holds."""

    module: nn.Module
    expert: ExpertState
    name: str
    """Stored (stacked) FQN."""
    members: tuple[str, ...]
    """torch's per-expert FQNs, local GEMM order."""


class ExpertStateDicts:
    """The :class:`~shardbridge.checkpoint.StateDictProvider` for models with GroupedLinear experts.

    torch's state dicts (as ``shardbridge.checkpoint`` takes them by default), with the per-expert
    parameters of every GroupedLinear marked by :func:`shard_grouped_experts` stored as global
    ``[E, ...]`` tensors, their optimizer states alike. See [Note: GroupedLinear experts].

    Args:
        names: renames the stacked entries: a mapping (missing keys keep their name) or a
            function of the stacked FQN ``<GroupedLinear fqn>.weight`` / ``.bias``; None keeps
            TE's names.

    Example:
        >>> to_reference = {"layers.0.feed_forward.experts.linear_fc1.weight": "layers.0.feed_forward.experts.gate_up_proj"}
        >>> provider = ExpertStateDicts(names=to_reference)
        >>> provider.stored_name("layers.0.feed_forward.experts.linear_fc1.weight")
        'layers.0.feed_forward.experts.gate_up_proj'
        >>> ckpt.save(path, model=model, optimizer=opt, state_dicts=provider)  # doctest: +SKIP
    """

    def __init__(self, names: NameMap | None = None) -> None:
        if names is not None and not (isinstance(names, Mapping) or callable(names)):
            raise ValueError(
                f"names={type(names).__name__} must be a mapping or a function from the stacked FQN to the stored name"
            )
        self._names = names
        self._stacked: list[_Stacked] = []
        self._torch: tuple[dict[str, Any], dict[str, Any] | None] = ({}, None)

    def stored_name(self, fqn: str) -> str:
        """The checkpoint name of the stacked entry ``fqn`` (``<GroupedLinear fqn>.weight``)."""
        if self._names is None:
            return fqn
        name = self._names.get(fqn, fqn) if isinstance(self._names, Mapping) else self._names(fqn)
        if not isinstance(name, str) or not name:
            raise ValueError(f"ExpertStateDicts(names=...) maps {fqn!r} to {name!r}; it must give a non-empty name")
        return name

    # StateDictProvider -----------------------------------------------------------------

    def state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, for_load: bool
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """torch's flattened dicts, every marked GroupedLinear's per-expert entries stacked."""
        if optimizer is None:
            model_sd, optim_sd = get_model_state_dict(model, options=_OPTIONS), None
        else:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
        model_sd = plain_state_dict(model_sd)
        optim_sd = None if optim_sd is None else plain_state_dict(optim_sd)
        self._torch = (model_sd, optim_sd)
        self._stacked = _stacked_entries(model, model_sd, self.stored_name)
        out_model = {k: v for k, v in model_sd.items() if k not in _empty_extra_states(model, model_sd)}
        out_optim = None if optim_sd is None else dict(optim_sd)
        for entry in self._stacked:
            if entry.name in out_model:
                raise ValueError(
                    f"ExpertStateDicts: the experts {entry.members[0]!r}.. would be stored as {entry.name!r}, which "
                    "the model already has; choose another name (names=)"
                )
            params = [model_sd[k] for k in entry.members]
            for k in entry.members:
                del out_model[k]
            out_model[entry.name] = _stack(entry, params, params)
            if out_optim is not None:
                _stack_optim(entry, params, out_optim)
        return out_model, out_optim

    def local_offsets(self, fqn: str, param: DTensor) -> None:
        """None: every DTensor here says where its local tensor sits by its placements."""
        return None

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_sd: dict[str, Any],
        optim_sd: dict[str, Any] | None,
        *,
        strict: bool,
    ) -> None:
        """Copy each loaded stacked entry back into its experts, then torch's ``set_state_dict``."""
        torch_model, torch_optim = self._torch
        for key, value in model_sd.items():
            if key in torch_model and not isinstance(value, torch.Tensor):
                torch_model[key] = value
        for entry in self._stacked:
            _unstack(entry, model_sd[entry.name], [torch_model[k] for k in entry.members])
            if torch_optim is not None and optim_sd is not None:
                _unstack_optim(entry, optim_sd, torch_optim)
        if torch_optim is not None and optim_sd is not None:
            for key, value in optim_sd.items():
                if key in torch_optim and not isinstance(value, torch.Tensor):
                    torch_optim[key] = value  # non-tensor values the load replaced (param_groups.*)
        options = StateDictOptions(flatten_optimizer_state_dict=True, strict=strict)
        if optimizer is None:
            set_model_state_dict(model, torch_model, options=options)
        else:
            set_state_dict(model, optimizer, model_state_dict=torch_model, optim_state_dict=torch_optim, options=options)
        self._torch, self._stacked = ({}, None), []  # keep no references to the model past the load


def _stacked_entries(model: nn.Module, model_sd: dict[str, Any], stored_name: Callable[[str], str]) -> list[_Stacked]:
    out = []
    for fqn, module in model.named_modules():
        expert = expert_state(module)
        if expert is None:
            continue
        key_prefix = _state_dict_prefix(model, fqn, model_sd, expert)
        for group, names in expert.groups.items():
            members = tuple(f"{key_prefix}{n}" for n in names)
            missing = [k for k in members if k not in model_sd]
            if missing:
                raise ValueError(
                    f"ExpertStateDicts: the state dict lacks {missing[:2]} of the experts at {fqn or 'the root'}; "
                    "pass the model shard_grouped_experts was called on"
                )
            out.append(_Stacked(module=module, expert=expert, name=stored_name(f"{key_prefix}{group}"), members=members))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise ValueError(f"ExpertStateDicts: two expert tensors would be stored under one name: {names}")
    return out


def _empty_extra_states(model: nn.Module, model_sd: dict[str, Any]) -> set[str]:
    """``_extra_state`` keys of marked GroupedLinears that hold no FP8 state (not stored).

    A GroupedLinear without FP8 has nothing in its ``_extra_state`` (a portable payload with
    ``recipe=None``); leaving it out lets models without it (the reference MoE, transformers)
    load the checkpoint strictly. On load the module keeps its own. A state with FP8 metadata
    is stored (see [Note: portable _extra_state] in ``_checkpoint.py``).
    """
    from shardbridge_te._checkpoint import decode_extra_state, is_portable_extra_state

    out = set()
    for fqn, module in model.named_modules():
        expert = expert_state(module)
        if expert is None:
            continue
        key = f"{_state_dict_prefix(model, fqn, model_sd, expert)}_extra_state"
        value = model_sd.get(key)
        if is_portable_extra_state(value) and decode_extra_state(value)["recipe"] is None:
            out.add(key)
    return out


def _state_dict_prefix(model: nn.Module, fqn: str, model_sd: dict[str, Any], expert: ExpertState) -> str:
    """``fqn.`` as torch's state dict spells it (wrappers such as ``_checkpoint_wrapped_module.`` dropped)."""
    first = next(iter(expert.groups.values()))[0]
    name = f"{fqn}.{first}" if fqn else first
    for key in (*sorted(state_dict_fqns(model, name)), name):  # torch's key first (a child named `module`)
        if key in model_sd:
            return key[: -len(first)]
    return f"{fqn}." if fqn else ""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _expert_placements(param: torch.Tensor, mesh: ParallelMesh) -> list[Any]:
    """Placements on ``(dp_replicate, efsdp, ep)`` of the stack of ``param``-like per-expert tensors."""
    placements: dict[str, Any] = {"dp_replicate": Replicate(), "efsdp": Replicate(), "ep": Shard(0)}
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        for axis, p in zip(names, param.placements):
            if axis not in ("dp_replicate", "efsdp"):
                raise ValueError(
                    f"an expert tensor is a DTensor on mesh axes {names}; GroupedLinear experts are sharded over "
                    "efsdp (and dp_replicate) only: call shard_grouped_experts, not set_device_mesh, on them"
                )
            if type(p) is Shard:
                placements[axis] = Shard(p.dim + 1)  # per-expert dim d -> dim d + 1 of [E, ...]
            elif not p.is_replicate():
                raise NotImplementedError(f"expert tensor placement {p!r} on {axis}: only Shard and Replicate")
    return [placements[a] for a in ("dp_replicate", "efsdp", "ep")]


def _stack(entry: _Stacked, values: list[Any], params: list[torch.Tensor]) -> torch.Tensor:
    """The stacked ``[E, ...]`` tensor of per-expert ``values`` laid out like ``params``."""
    local = torch.stack([_local(v).detach() for v in values])
    expert, param = entry.expert, params[0]
    if expert.mesh is None:
        if isinstance(param, DTensor):
            raise ValueError(
                f"{entry.members[0]!r} is a DTensor, but shard_grouped_experts was called with mesh=None (one "
                "process); call it with the run's ParallelMesh instead of sharding the experts otherwise"
            )
        return local  # one process: [E, ...] whole
    shape = (expert.num_experts, *param.shape)
    stride = torch.empty(shape, device="meta").stride()
    # E/ep local experts [out_piece, in] x ep ranks -> [E, out, in]: Shard(0) on ep, FSDP's dim + 1 on efsdp
    return DTensor.from_local(
        local,
        expert.mesh.expert_mesh,
        _expert_placements(param, expert.mesh),
        run_check=False,
        shape=shape,
        stride=stride,
    )


def _same(values: list[Any]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(v, torch.Tensor) and v.shape == first.shape and torch.equal(v, first) for v in values)
    return all(v == first for v in values)


def _like_param(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and _local(value).shape == _local(param).shape


def _optim_keys(entry: _Stacked, optim_sd: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """``{"state." / "param_groups.": {suffix: [key per expert]}}`` of the entry's members."""
    out: dict[str, dict[str, list[str]]] = {"state.": {}, "param_groups.": {}}
    for head in out:
        for i, member in enumerate(entry.members):
            prefix = f"{head}{member}."
            suffixes = sorted(k[len(prefix) :] for k in optim_sd if k.startswith(prefix))
            for suffix in suffixes:
                out[head].setdefault(suffix, [None] * len(entry.members))[i] = f"{prefix}{suffix}"  # type: ignore[index]
        for suffix, keys in out[head].items():
            if None in keys:
                absent = entry.members[keys.index(None)]
                raise ValueError(
                    f"ExpertStateDicts: the optimizer holds {head}{entry.members[0]}.{suffix} but not for {absent!r}; "
                    f"the experts of one GroupedLinear are stored as one tensor {entry.name!r}: give every expert the "
                    "same optimizer state and param group"
                )
    return out


def _stack_optim(entry: _Stacked, params: list[torch.Tensor], optim_sd: dict[str, Any]) -> None:
    for head, by_suffix in _optim_keys(entry, optim_sd).items():
        for suffix, keys in by_suffix.items():
            values = [optim_sd.pop(k) for k in keys]
            key = f"{head}{entry.name}.{suffix}"
            if all(_like_param(v, p) for v, p in zip(values, params)):
                optim_sd[key] = _stack(entry, values, params)
            elif _same(values):
                optim_sd[key] = values[0]  # a scalar (AdamW's step) or a hyperparameter, stored once
            else:
                raise ValueError(
                    f"ExpertStateDicts: {head}{entry.members[0]}.{suffix} differs across the experts of one "
                    f"GroupedLinear ({[_short(v) for v in values]}); they are stored as one tensor {entry.name!r}: "
                    "keep the experts of one GroupedLinear in one param group, stepped together"
                )


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}" if value.dim() else f"tensor({value.item():g})"
    return repr(value)[:40]


def _unstack(entry: _Stacked, stacked: Any, targets: list[torch.Tensor]) -> None:
    """Copy the loaded ``stacked`` tensor's slices into the experts' own tensors, in place."""
    local = _local(stacked)
    with torch.no_grad():
        for i, target in enumerate(targets):
            _local(target).copy_(local[i])


def _unstack_optim(entry: _Stacked, loaded: dict[str, Any], torch_optim: dict[str, Any]) -> None:
    for head, by_suffix in _optim_keys(entry, torch_optim).items():
        for suffix, keys in by_suffix.items():
            value = loaded.get(f"{head}{entry.name}.{suffix}")
            if value is None:
                continue  # not in the checkpoint (strict=False): the optimizer keeps its own
            targets = [torch_optim[k] for k in keys]
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                _unstack(entry, value, targets)
            elif isinstance(value, torch.Tensor):
                with torch.no_grad():
                    for target in targets:
                        target.copy_(value)  # a scalar state loaded into expert 0's: the same for all
            else:
                for k in keys:
                    torch_optim[k] = value
