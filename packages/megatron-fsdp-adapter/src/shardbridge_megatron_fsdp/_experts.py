"""Per-local-expert parameters stored as the core's ``[E, ...]`` expert tensors.

[Note: local experts in global coordinates]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-Core's ``SequentialMLP`` holds one MLP per LOCAL expert: ep rank r of ep holds
``experts.local_experts.{i}`` for ``i < E/ep``, and local expert i is global expert
``r * E/ep + i`` (``MoELayer.local_expert_indices``). The same FQN names a different expert
on every ep rank, so a checkpoint keyed by these FQNs fits only the ep it was saved at. The
core's expert format ([Note: expert checkpoints] in ``shardbridge/_ep.py``) is ONE tensor per
weight whose dim 0 is the global expert index, so each stack of local experts is stored as::

    Megatron-Core, ep rank r                              stored (any ep, any dp)
    <moe>.experts.local_experts.{i}.linear_fc1.weight     <moe>.experts.linear_fc1.weight [E, 2I, D]
      [2I, D] = [gate; up], Megatron-FSDP rows r0..r1       box (r * E/ep + i, r0, 0) + (1, r1 - r0, D)
    <moe>.experts.local_experts.{i}.linear_fc2.weight     <moe>.experts.linear_fc2.weight [E, D, I]
      [D, I]

A registration (:func:`register_expert_stack`, on the module that holds ``local_experts``)
says which global experts the local ones are; the checkpoint provider (``_checkpoint.py``)
hands the core one :class:`~shardbridge.adapters.LocalChunks` per stored tensor, each box a
view of a local expert's Megatron-FSDP shard (the box Megatron-FSDP records, with the expert
index prepended), for the parameter and every optimizer state shaped like it. Nothing else
changes: the same checkpoint loads at any ep (each rank reads the rows of its experts), into
one process, or into any model holding the ``[E, ...]`` tensors themselves.

Expert tensor parallelism (``expert_tensor_parallel_size > 1``) would interleave ``[gate_j;
up_j]`` inside each expert's rows; it is refused (the Megatron-Core entry point sets it to 1:
experts are split over ep, not tp, as in [Note: expert axes] of ``shardbridge/_mesh.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

__all__ = ["ExpertSlot", "ExpertStack", "expert_slots", "register_expert_stack"]

_ATTR = "_shardbridge_expert_stack"
_LOCAL = re.compile(r"local_experts\.(\d+)\.(.+)")


@dataclass(frozen=True, kw_only=True)
class ExpertStack:
    """Which global experts a module's ``local_experts`` are."""

    global_indices: tuple[int, ...]
    """Global expert index of local expert i (``MoELayer.local_expert_indices``)."""
    num_experts: int
    """E, the global number of experts (dim 0 of the stored tensors)."""

    def __post_init__(self) -> None:
        if not self.global_indices or any(not 0 <= e < self.num_experts for e in self.global_indices):
            raise ValueError(
                f"global_indices={self.global_indices} must be non-empty and within [0, num_experts="
                f"{self.num_experts})"
            )


@dataclass(frozen=True)
class ExpertSlot:
    """Where one local expert's parameter is stored."""

    stored: str
    """FQN of the stored ``[E, ...]`` tensor (``local_experts.{i}.`` dropped)."""
    index: int
    """Global expert index: the parameter is ``stored[index]``."""
    num_experts: int
    """E."""


def register_expert_stack(module: nn.Module, stack: ExpertStack) -> None:
    """Mark ``module`` (it holds a ``local_experts`` ModuleList) as the local experts ``stack`` names.

    Raises:
        ValueError: ``module`` has no ``local_experts`` of ``len(stack.global_indices)`` modules.
    """
    local = getattr(module, "local_experts", None)
    if not isinstance(local, nn.ModuleList) or len(local) != len(stack.global_indices):
        raise ValueError(
            f"{type(module).__name__} holds {len(local) if isinstance(local, nn.ModuleList) else 'no'} "
            f"local_experts, the stack names {len(stack.global_indices)}; register the module whose "
            "local_experts ModuleList holds one module per local expert"
        )
    setattr(module, _ATTR, stack)


def expert_slots(model: nn.Module) -> dict[str, ExpertSlot]:
    """Parameter FQN -> :class:`ExpertSlot` for every registered local expert's parameter.

    FQNs as ``model.named_parameters()`` gives them. See [Note: local experts in global coordinates].
    """
    out: dict[str, ExpertSlot] = {}
    for prefix, module in model.named_modules():
        stack = getattr(module, _ATTR, None)
        if stack is None:
            continue
        base = f"{prefix}." if prefix else ""
        for name, _ in module.named_parameters():
            match = _LOCAL.fullmatch(name)
            if match is None:
                continue
            i, rest = int(match.group(1)), match.group(2)
            out[base + name] = ExpertSlot(base + rest, stack.global_indices[i], stack.num_experts)
    return out
