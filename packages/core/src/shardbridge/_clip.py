"""Gradient-norm clipping for models whose parameters live on different meshes.

[Note: clipping across meshes]

Under FSDP2 x TP the parameters of one model sit on different DeviceMeshes: TP-sharded weights
on the 2-D ``(dp, tp)`` mesh, the embedding, norms and other unsharded-by-TP weights on the
1-D ``dp`` mesh (HSDP adds ``dp_replicate``). ``torch.nn.utils.clip_grad_norm_`` (torch 2.13)
stacks the per-parameter norms into one tensor, and DTensor refuses that across meshes
("All operands in aten.stack.default must have the same mesh"). Accelerate < 1.11 calls it
as is; Megatron-FSDP and torchtitan each carry their own fix.

``clip_grad_norm_`` here groups the gradients by mesh, lets DTensor compute each group's norm
(a ``_NormPartial`` that ``full_tensor()`` reduces over exactly the mesh dims that shard it, so a
replicated dim is not counted twice), combines the per-mesh norms as plain tensors, and scales
every gradient's local shard in place. One reduction per mesh, whatever the parameter count.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total norm of ``max_norm``, in place.

    Same contract as ``torch.nn.utils.clip_grad_norm_``, but the parameters may be DTensors on
    any mix of meshes (see [Note: clipping across meshes]), plain tensors, or both.

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` is clipped; ones without a gradient
            are skipped.
        max_norm: the largest total norm the gradients keep.
        norm_type: p of the p-norm; ``float("inf")`` for the max norm.
        error_if_nonfinite: raise if the total norm is nan or inf.
        foreach: passed to torch's per-group norm (None: torch picks).

    Returns:
        The total norm of all gradients before clipping: a plain 0-dim tensor, the same value on
        every rank.

    Raises:
        ValueError: ``max_norm`` negative, or gradients on more than one device type.
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan or inf.

    Example:
        >>> loss.backward()  # doctest: +SKIP
        >>> norm = shardbridge.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
    """
    if max_norm < 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    if not params:
        return torch.tensor(0.0)
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None  # DeviceMesh hashes by value
        groups.setdefault(key, []).append(p.grad)
    devices = {g.device.type for g in (p.grad for p in params)}
    if len(devices) > 1:
        raise ValueError(f"gradients are on device types {sorted(devices)}; put the model on one device type")
    norms = []
    for mesh, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        norms.append(norm.full_tensor() if mesh is not None else norm)
    total = torch.linalg.vector_norm(torch.stack([n.float() for n in norms]), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "pass error_if_nonfinite=False to clip anyway (the gradients become nan)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    locals_ = [g._local_tensor if isinstance(g, DTensor) else g for grads in groups.values() for g in grads]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in locals_:
        by_dtype.setdefault(g.dtype, []).append(g)
    for dtype, tensors in by_dtype.items():
        torch._foreach_mul_(tensors, coef.to(dtype=dtype, device=tensors[0].device))
    return total
