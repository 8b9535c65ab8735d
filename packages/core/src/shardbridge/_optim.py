"""Optimizer param groups across a parallelization that replaces the model's parameters.

[Note: param groups by FQN]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
TP (``parallelize_module``), ``fully_shard`` and Megatron-FSDP replace a module's parameters
with new ``nn.Parameter`` objects (DTensors), so an optimizer built before parallelizing
points at parameters the model no longer has. Users build the optimizer first all the same
(Accelerate's ``prepare(model, optimizer)``, Megatron-FSDP's ``fully_shard(model, optimizer)``).
The adapters remember each group's parameters by FQN before parallelizing
(:func:`param_group_fqns`) and point the same groups, hyperparameters untouched, at the new
parameters afterwards (:func:`rebind_param_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from shardbridge._checks import checked_args

__all__ = ["param_group_fqns", "rebind_param_groups"]


@checked_args(model=nn.Module, optimizer=torch.optim.Optimizer)
def param_group_fqns(
    model: nn.Module, optimizer: torch.optim.Optimizer, *, when: str = "parallelizing"
) -> list[list[str]]:
    """The FQNs of each param group's parameters, in group order. See [Note: param groups by FQN].

    Args:
        model: the model the optimizer was built for.
        optimizer: its optimizer.
        when: named in the error, e.g. ``"prepare()"``.

    Raises:
        ValueError: a group holds a tensor that is not one of ``model``'s parameters.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> param_group_fqns(model, torch.optim.SGD(model.parameters(), lr=0.1))
        [['weight', 'bias']]
    """
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    out = []
    for index, group in enumerate(optimizer.param_groups):
        fqns = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"optimizer param group {index} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                    f"of the {type(model).__name__}; build the optimizer from model.parameters() before {when}"
                )
            fqns.append(names[id(p)])
        out.append(fqns)
    return out


@checked_args(optimizer=torch.optim.Optimizer)
def rebind_param_groups(
    optimizer: torch.optim.Optimizer, fqns: Sequence[Sequence[str]], params: Mapping[str, torch.Tensor]
) -> None:
    """Point each param group at ``params[fqn]`` in place, keeping its hyperparameters; clear state.

    Args:
        optimizer: the optimizer whose groups :func:`param_group_fqns` recorded.
        fqns: what :func:`param_group_fqns` returned before parallelizing.
        params: the new parameters by FQN, e.g. ``dict(model.named_parameters())``.

    Raises:
        ValueError: the optimizer's groups changed in number, or an FQN has no new parameter.

    Example:
        >>> model = nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> groups = param_group_fqns(model, opt)
        >>> model.weight = nn.Parameter(model.weight.detach().clone())  # what parallelizing does
        >>> rebind_param_groups(opt, groups, dict(model.named_parameters()))
        >>> opt.param_groups[0]["params"][0] is model.weight
        True
    """
    if len(fqns) != len(optimizer.param_groups):
        raise ValueError(
            f"the optimizer has {len(optimizer.param_groups)} param groups but {len(fqns)} were recorded; "
            "do not add param groups between param_group_fqns and rebind_param_groups"
        )
    for group, names in zip(optimizer.param_groups, fqns):
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(f"parameters {missing[:5]} of the optimizer are no longer in the model")
        group["params"] = [params[n] for n in names]
    optimizer.state.clear()
