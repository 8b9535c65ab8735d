"""``StateDictProvider``: where a framework plugs its own state dicts into ``save`` / ``load``.

[Note: state-dict providers]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
By default :func:`~shardbridge.checkpoint.save` and :func:`~shardbridge.checkpoint.load`
read the model and optimizer through torch's ``get_state_dict`` / ``set_state_dict`` and
take each DTensor's local box from its placements (repaired by the layout algebra, see
[Note: DCP layout repair] in ``_repair.py``). A framework whose parameters are not described
by either passes a provider (``state_dicts=``) and keeps everything else of the core: the
atomic commit, manifest, RNG states, key and shape checks, fused components, symmetric
errors, and so the same on-disk format. A provider answers three questions::

    state_dicts(model, optimizer, for_load)    torch's flattened format, keyed by the
                                               user's FQNs: {fqn: tensor},
                                               {"state.<fqn>.<key>": ..., "param_groups.<fqn>.<hp>": ...}
    local_offsets(fqn, param)                  the GLOBAL offsets of a DTensor parameter's local
                                               tensor, or None: its placements describe it
    load_state_dicts(model, optimizer, ...)    after DCP filled the dicts: put back what is not
                                               filled in place (non-tensor values, copies)

Megatron-FSDP is the case this exists for: its DTensors' placements do not say where the
local rows sit (its own chunk metadata does), and the optimizer steps "main" weights that
must be copied into the compute weights after a load::

    o_proj.weight (64, 64), mesh (dp_shard=2, tp=2)
    rank   placements             local rows   local_offsets   DCP from placements
    1      [Shard(0), Shard(0)]   18           (14, 0)         (16, 0)   <- wrong

A value may also be a :class:`~shardbridge.adapters.LocalChunks` instead of a tensor: the
boxes of ONE stored tensor that this rank holds, each a view of live data, for a stored tensor
that is no single parameter of the model. Megatron-Core's experts are the case: each rank holds
``local_experts.{i}.linear_fc1.weight`` for its E/ep experts, and the checkpoint holds one
``experts.linear_fc1.weight`` ``[E, 2I, D]`` whose dim 0 is the global expert index
([Note: expert checkpoints] in ``shardbridge/_ep.py``)::

    ep rank 1 of 2, E = 4, local expert i = global expert 2 + i, FSDP rows r0..r1 of each
    model_sd["...experts.linear_fc1.weight"] = LocalChunks((4, 2I, D), [
        ((2, r0, 0), local_experts[0] rows r0..r1, viewed [1, r1 - r0, D]),
        ((3, r0, 0), local_experts[1] ...)])

The core stores it as given (no fused split, no layout repair; the manifest records
``"stored_as": "boxes"``), its optimizer entries too; on load DCP writes into the views.

An offset given for a parameter is also used for its optimizer states shaped like it
(DTensors with the same local shape, or plain tensors holding the local shard), and for its
fused components. Tensors are loaded in place: return the live tensors (or views), not
copies. ``for_load=True`` asks for the same keys on every rank (placeholders where a rank
holds nothing, e.g. optimizer states of an empty shard), so key checks agree across ranks;
on save a rank may omit what it does not hold.

[Note: rank-local tensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP keys a tensor by its name. A plain tensor, or a DTensor whose mesh does not span every
rank, under the same name on several ranks is a REPLICA to DCP: it keeps one rank's copy of
each box (the planner's dedup) and the others are never written. That is right for what torch
calls replicated, and silently wrong for a tensor whose data differs per rank under one name,
e.g. TE ``GroupedLinear`` experts under expert parallelism: ``weight0`` is global expert 0 on
ep rank 0 and expert 2 on ep rank 1::

    ep rank   named     holds        default path stores   lost
    0         weight0   expert 0     weight0 <- one rank   expert 2 (or 0)
    1         weight0   expert 2

Only a provider that knows the layout can store such a tensor (``shardbridge_te``'s
``ExpertStateDicts`` stacks them as one ``[E, ...]`` tensor). :func:`mark_rank_local` lets a
framework say so: the marked tensors of a module, with a hint naming the provider. A save or
load whose state dicts still hold a marked tensor under its own name, or an optimizer state of
it (``state.<fqn>.*``), because no provider took it over, raises ValueError naming the FQN and
the hint, on every rank (the check runs while the state is built, inside the save's argument
round and the load's read round). A provider takes a tensor over by storing it under another
name (and its optimizer states with it). The mark lives on the module (as fused specs do),
not on the tensor: FSDP2 and ``to_empty`` replace parameter objects. The check is a walk over
the modules and a set lookup per marked tensor: no data is read.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["RANK_LOCAL_ATTR", "StateDictProvider", "check_provider", "mark_rank_local", "rank_local_tensors"]

RANK_LOCAL_ATTR = "_shardbridge_rank_local"
"""Module attribute holding ``dict[tensor name, provider hint]``, written by :func:`mark_rank_local`."""


@runtime_checkable
class StateDictProvider(Protocol):
    """A framework's own state dicts and local boxes for ``save`` / ``load``.

    See [Note: state-dict providers]. Every method is called on every rank, in the same
    order; collectives are allowed in :meth:`state_dicts` (not in the other two).

    Example:
        >>> class Shifted:  # a model whose one DTensor holds rows 2.. on every rank
        ...     def state_dicts(self, model, optimizer, *, for_load):
        ...         return dict(model.named_parameters()), None
        ...     def local_offsets(self, fqn, param):
        ...         return (2, 0)
        ...     def load_state_dicts(self, model, optimizer, model_sd, optim_sd, *, strict):
        ...         pass
        >>> isinstance(Shifted(), StateDictProvider)
        True
    """

    def state_dicts(
        self, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, for_load: bool
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """``(model_sd, optim_sd)`` in torch's flattened format (optim_sd None without optimizer).

        Args:
            model: the model given to save / load.
            optimizer: the optimizer given to save / load, or None.
            for_load: True on load: every rank must return the same keys.
        """
        ...

    def local_offsets(self, fqn: str, param: DTensor) -> Sequence[int] | None:
        """Global offsets of ``param``'s local tensor (its size is the local shape), or None
        when its placements describe it. Called once per DTensor of ``model_sd``."""
        ...

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        model_sd: dict[str, Any],
        optim_sd: dict[str, Any] | None,
        *,
        strict: bool,
    ) -> None:
        """After DCP loaded into the dicts :meth:`state_dicts` returned: tensors are filled in
        place, non-tensor values (``param_groups.*``, a float ``step``) are replaced in the
        dicts; apply what the framework needs (the default calls torch's ``set_state_dict``)."""
        ...


def check_provider(provider: object) -> None:
    """ValueError unless ``provider`` is None or implements :class:`StateDictProvider`."""
    if provider is not None and not isinstance(provider, StateDictProvider):
        raise ValueError(
            f"state_dicts={type(provider).__name__} is not a StateDictProvider; implement state_dicts, "
            "local_offsets and load_state_dicts (see shardbridge.checkpoint.StateDictProvider), or pass None "
            "to use torch's get_state_dict / set_state_dict"
        )


def mark_rank_local(module: nn.Module, names: Iterable[str], *, provider_hint: str) -> None:
    """Mark tensors of ``module`` as rank-local: only a :class:`StateDictProvider` can store them.

    A rank-local tensor holds data that differs per rank under a name that is the same on every
    rank, and is NOT a replica (see [Note: rank-local tensors]). ``save`` and ``load`` refuse a
    model whose state dicts would store one (or its optimizer states) under its own name, with a
    ValueError naming it and ``provider_hint``. Marking again adds to (or replaces) the marks.

    Args:
        module: the module owning the tensors.
        names: names of its own parameters or buffers (``"weight0"``, not a dotted path).
        provider_hint: what the user must do, ending the error message, e.g.
            ``"pass state_dicts=shardbridge_te.ExpertStateDicts(...) to save and load"``.

    Raises:
        ValueError: a name that is not a parameter or buffer of ``module``, or an empty hint.

    Example:
        >>> layer = nn.Linear(2, 2)
        >>> mark_rank_local(layer, ["weight"], provider_hint="pass state_dicts=MyProvider()")
        >>> rank_local_tensors(nn.Sequential(layer))
        {'0.weight': 'pass state_dicts=MyProvider()'}
    """
    if not isinstance(provider_hint, str) or not provider_hint.strip():
        raise ValueError(
            f"provider_hint={provider_hint!r} must be a non-empty string telling the user which "
            "state_dicts= provider stores these tensors"
        )
    names = [names] if isinstance(names, str) else list(names)
    own = {n for n, _ in module.named_parameters(recurse=False)} | {n for n, _ in module.named_buffers(recurse=False)}
    unknown = [n for n in names if n not in own]
    if unknown or not names:
        raise ValueError(
            f"mark_rank_local: {unknown or names} are not parameters or buffers of {type(module).__name__} "
            f"(it has {sorted(own)}); pass the names of the module's own tensors"
        )
    marks = dict(getattr(module, RANK_LOCAL_ATTR, {}))
    marks.update(dict.fromkeys(names, provider_hint))
    setattr(module, RANK_LOCAL_ATTR, marks)


def rank_local_tensors(model: nn.Module) -> dict[str, str]:
    """FQN (as in ``model.named_parameters()``) -> provider hint of every marked tensor of ``model``."""
    out: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for name, hint in module.__dict__.get(RANK_LOCAL_ATTR, {}).items():  # no __getattr__ miss per module
            out[f"{prefix}.{name}" if prefix else name] = hint
    return out
