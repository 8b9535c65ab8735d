"""The user's optimizer over Megatron-FSDP's distributed parameters: states created, nothing moved.

Both entry points hand Megatron-FSDP an optimizer built over the model's parameters and rebind
its groups (``shardbridge.rebind_param_groups``) to the distributed parameters. Megatron-FSDP
then needs the optimizer's states to exist before the first real step (the standalone
``fully_shard_optimizer`` runs a step itself; a checkpoint must be able to load into them), and
a step on zero gradients is not neutral: AdamW's weight decay moves the weights, SGD puts
``weight_decay * p`` into its momentum buffer, Adam's ``step`` becomes 1. :func:`zero_step` runs
that step with ``lr=0`` and ``weight_decay=0`` and resets every ``step`` counter, so weights,
moments and bias correction are those of a fresh optimizer.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["zero_step"]


def zero_step(optimizer: torch.optim.Optimizer, step: Callable[[], object]) -> None:
    """Run ``step()`` (a step of ``optimizer`` on zero gradients) without it changing anything but the states' existence.

    Args:
        optimizer: the optimizer whose ``lr`` and ``weight_decay`` are 0 during ``step`` (tensor
            hyperparameters too), restored afterwards, and whose ``step`` counters are reset to 0.
        step: what steps it: Megatron-FSDP's ``fully_shard_optimizer`` (standalone), or the base
            class ``step`` on zero gradients (Megatron-Core).
    """
    neutral = {"lr": 0.0, "weight_decay": 0.0}
    saved = [{k: g[k] for k in neutral if k in g} for g in optimizer.param_groups]
    for g, old in zip(optimizer.param_groups, saved):
        for k in old:
            g[k] = torch.zeros_like(g[k]) if isinstance(g[k], torch.Tensor) else neutral[k]
    step()
    for g, old in zip(optimizer.param_groups, saved):
        g.update(old)
    for state in optimizer.state.values():
        count = state.get("step")
        if isinstance(count, torch.Tensor):
            count.zero_()
        elif count is not None:
            state["step"] = 0
