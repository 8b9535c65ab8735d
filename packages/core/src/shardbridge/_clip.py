"""Gradient-norm clipping for models whose parameters live on different meshes.

[Note: clipping across meshes]

Under FSDP2 x TP the parameters of one model sit on different DeviceMeshes: TP-sharded weights
on the 2-D ``(dp, tp)`` mesh, the embedding, norms and other unsharded-by-TP weights on the
1-D ``dp`` mesh (HSDP adds ``dp_replicate``). ``torch.nn.utils.clip_grad_norm_`` (torch 2.13)
stacks the per-parameter norms into one tensor, and DTensor refuses that across meshes
("All operands in aten.stack.default must have the same mesh"). Accelerate < 1.11 calls it as
is; Megatron-FSDP and torchtitan each carry their own fix.

``clip_grad_norm_`` here never asks DTensor to combine anything. Each rank sums the p-th powers
of its *local* gradient norms, each divided by the number of ranks holding an identical copy of
that shard, and one all-reduce over ``group`` (default: the world) adds the ranks up. The copies
of a DTensor shard: the mesh sizes of its ``Replicate`` dims, times ``group size / mesh size``
for the ranks outside its mesh (a weight on the dp mesh alone is repeated on every tp rank). So the collective pattern is the same on every
rank whatever it holds: a rank with an empty shard or no gradient for a parameter (Megatron-FSDP
leaves ``.grad`` None where a rank's shard is empty) still makes exactly the one all-reduce,
where per-mesh DTensor reductions would pair different collectives and crash gloo. Then every
gradient's local shard is scaled in place. The max norm (``inf``) uses an all-reduce MAX.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardbridge._compat import local_tensor

__all__ = ["clip_grad_norm_"]


@torch.no_grad()
def clip_grad_norm_(
    parameters: torch.Tensor | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """Clip the gradients of ``parameters`` to a total norm of ``max_norm``, in place.

    Same signature and contract as ``torch.nn.utils.clip_grad_norm_`` (plus keyword-only
    ``group``), but the parameters may be DTensors on
    any mix of meshes (see [Note: clipping across meshes]), plain tensors, or both. Every rank of
    ``group`` must call it (with its own parameters of the same model).

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` is clipped; ones without a gradient
            are skipped.
        max_norm: the largest total norm the gradients keep.
        norm_type: p of the p-norm (> 0); ``float("inf")`` for the max norm.
        error_if_nonfinite: raise if the total norm is nan or inf.
        foreach: use the fused ``torch._foreach_*`` kernels (True), per-tensor ops (False), or
            the fused ones wherever the device supports them (None, the default), as in torch.
        group: the ranks that hold the model (None: the default group, i.e. all ranks); every
            gradient's mesh must lie in it, and ranks outside a gradient's mesh are taken to hold
            copies of it (as the tp ranks do for a dp-only weight). Plain tensor gradients count
            as replicated over it. Not used without torch.distributed.

    Returns:
        The total norm of all gradients before clipping: a plain 0-dim float32 tensor, the same
        value on every rank (norms are taken in float32 whatever the gradient dtype; a nan in
        the max norm comes back as inf).

    Raises:
        ValueError: ``max_norm`` negative, ``norm_type`` not > 0, a gradient still ``Partial``
            (not reduced yet), or gradients on more than one device type.
        RuntimeError: ``error_if_nonfinite`` and the total norm is nan or inf.

    Example:
        >>> loss.backward()  # doctest: +SKIP
        >>> norm = shardbridge.clip_grad_norm_(model.parameters(), 1.0)  # doctest: +SKIP
    """
    if max_norm < 0:
        raise ValueError(f"max_norm={max_norm} must be >= 0")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"norm_type={norm_type} must be > 0 (or inf)")
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size(group) if distributed else 1
    devices = {g.device.type for g in grads}
    if len(devices) > 1:
        raise ValueError(f"gradients are on device types {sorted(devices)}; put the model on one device type")
    if foreach and not all(_foreach_supported(g.device) for g in grads):
        raise RuntimeError(
            f"foreach=True was passed, but the fused kernels do not support device types {sorted(devices)}; "
            "pass foreach=None or False"
        )
    fused = foreach is not False
    device = _collective_device(group, distributed)

    # local tensors grouped by how many ranks hold an identical copy
    by_copies: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                raise ValueError(
                    f"a gradient has placements {g.placements} (Partial: not reduced yet); "
                    "clip after backward() has finished and FSDP has reduced the gradients"
                )
            mesh = g.device_mesh
            # ranks outside the mesh (e.g. the tp ranks of a dp-only weight) hold copies too
            copies = (
                world // mesh.size() * math.prod(mesh.size(d) for d, pl in enumerate(g.placements) if pl.is_replicate())
            )
            by_copies.setdefault(copies, []).append(local_tensor(g))
        else:
            by_copies.setdefault(world, []).append(g)

    inf = math.isinf(norm_type)
    acc = torch.zeros((), dtype=torch.float32, device=device)
    for copies, tensors in by_copies.items():
        nonempty = [t for t in tensors if t.numel()]  # FSDP2 leaves empty shards; inf-norm refuses them
        if not nonempty:
            continue
        if fused and _foreach_supported(nonempty[0].device):
            per_tensor = torch._foreach_norm(nonempty, norm_type, dtype=torch.float32)
        else:
            per_tensor = [torch.linalg.vector_norm(t, norm_type, dtype=torch.float32) for t in nonempty]
        norms = torch.stack(per_tensor).to(device)
        acc = torch.maximum(acc, norms.max()) if inf else acc + norms.pow(norm_type).sum() / copies
    if inf:  # NCCL's MAX need not propagate nan: make it inf, which does
        acc = torch.where(acc.isnan(), torch.full_like(acc, math.inf), acc)
    if distributed:
        dist.all_reduce(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM, group=group)
    total = acc if inf else acc.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is {total.item()}; "
            "pass error_if_nonfinite=False to clip anyway (the gradients become nan)"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for tensors in by_copies.values():
        for t in tensors:
            by_device.setdefault(t.device, []).append(t)
    for dev, tensors in by_device.items():
        if fused and _foreach_supported(dev):
            torch._foreach_mul_(tensors, coef.to(dev))  # fp32 coefficient, as torch's clip does
        else:
            for t in tensors:
                t.mul_(coef.to(dev))
    return total


def _foreach_supported(device: torch.device) -> bool:
    # torch's rule for foreach=None (torch.utils._foreach_utils, 2.13), less private backends.
    return device.type in ("cpu", "cuda", "xpu", "mtia")


def _collective_device(group: dist.ProcessGroup | None, distributed: bool) -> torch.device:
    """The all-reduce operand's device, chosen alike on every rank (a rank may hold no gradient).

    CUDA when the group has an NCCL backend, else CPU (gloo; also CPU-offloaded gradients).
    """
    if distributed and "nccl" in str(dist.get_backend_config(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
