"""Context parallelism for TransformerEngine attention: ``set_context_parallel_group`` from the cp mesh.

Public (via ``shardbridge_te``): :func:`set_context_parallel`, :data:`CP_COMM_TYPES`.

[Note: TE context parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
TE's ``DotProductAttention``, ``MultiheadAttention`` and ``TransformerLayer`` run context-
parallel once ``set_context_parallel_group(cp_group, cp_global_ranks, cp_stream,
cp_comm_type)`` is called; the last two forward it to every attention inside them. The
group comes from the run's ``cp`` axis, so FSDP (over ``dp_shard_cp``), the loss (over
``dp_cp``) and attention agree on who holds which tokens. TE's default load balancing
``DUAL_CHUNK_SWAP`` is the head-tail split of ``shardbridge.cp.cp_split`` (rank r holds chunks
r and 2cp-1-r), so the same split feeds TE and the core.

``cp_comm_type``:

    p2p         ring exchange of KV chunks (overlaps with compute)      cp_group: the cp group
    all_gather  all-gather of KV before attention                       cp_group: the cp group
    a2a         Ulysses: heads scattered, sequence gathered             cp_group: the cp group
                (heads per TP rank must be divisible by cp)
    a2a+p2p     a2a inside groups of ``a2a_size`` consecutive cp ranks,  cp_group: [a2a, p2p]
                p2p between those groups                                 (the cp axis unflattened
                                                                          to (p2p, a2a), a2a inner)

TE's own cp rank for a2a+p2p is ``a2a_size * p2p_rank + a2a_rank``: with a2a the inner dim of
the unflattened cp axis it equals the rank on ``pm["cp"]``, so the head-tail split is the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from shardbridge import ParallelMesh

__all__ = ["CP_COMM_TYPES", "set_context_parallel"]

CP_COMM_TYPES: tuple[str, ...] = ("p2p", "all_gather", "a2a", "a2a+p2p")
"""TE's context-parallel communication types (TE 2.20 ``set_context_parallel_group``)."""

_CP_MODULES = ("TransformerLayer", "MultiheadAttention", "DotProductAttention")


def set_context_parallel(
    model: nn.Module,
    mesh: ParallelMesh,
    *,
    cp_comm_type: str = "p2p",
    a2a_size: int | None = None,
    cp_stream: Any = None,
) -> list[str]:
    """Give every TE attention in ``model`` the cp group of ``mesh``. See [Note: TE context parallel].

    Call on every rank (``a2a+p2p`` creates process groups). cp == 1: nothing to do.

    Args:
        model: a model holding TE ``TransformerLayer`` / ``MultiheadAttention`` /
            ``DotProductAttention`` modules.
        mesh: the run's :class:`~shardbridge.ParallelMesh`.
        cp_comm_type: one of :data:`CP_COMM_TYPES`.
        a2a_size: for ``a2a+p2p``: cp ranks per a2a group; divides cp, 1 < a2a_size < cp.
        cp_stream: the CUDA stream TE's p2p overlaps on; None = a new stream when CUDA is
            available (else None: nothing runs on CPU).

    Returns:
        The FQNs of the outermost modules that were set (their inner attention follows).

    Raises:
        ValueError: an unknown ``cp_comm_type``, a bad ``a2a_size``, or no TE attention in
            ``model`` while cp > 1.

    Example:
        >>> set_context_parallel(model, pm, cp_comm_type="a2a+p2p", a2a_size=2)  # doctest: +SKIP
        ['layers.0', 'layers.1']
    """
    cp = mesh.dims.cp
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(
            f"cp_comm_type={cp_comm_type!r} is not a TE context-parallel type; choose one of {CP_COMM_TYPES}"
        )
    if cp == 1:
        return []
    cp_mesh = mesh["cp"]
    cp_group: Any = cp_mesh.get_group()
    if cp_comm_type == "a2a+p2p":
        if a2a_size is None or not 1 < a2a_size < cp or cp % a2a_size:
            raise ValueError(
                f"cp_comm_type='a2a+p2p' with cp={cp} needs a2a_size dividing cp with 1 < a2a_size < cp, got "
                f"a2a_size={a2a_size}; e.g. a2a_size=2 for cp=4 (or use 'p2p' / 'a2a')"
            )
        from shardbridge._compat import unflatten_mesh

        hier = unflatten_mesh(cp_mesh, 0, (cp // a2a_size, a2a_size), ("cp_p2p", "cp_a2a"))
        cp_group = [hier["cp_a2a"].get_group(), hier["cp_p2p"].get_group()]
    elif a2a_size is not None:
        raise ValueError(f"a2a_size={a2a_size} is only meaningful with cp_comm_type='a2a+p2p', got {cp_comm_type!r}")
    ranks = dist.get_process_group_ranks(cp_mesh.get_group())
    if cp_stream is None and torch.cuda.is_available():
        cp_stream = torch.cuda.Stream()
    done: list[str] = []
    covered: set[int] = set()
    for fqn, module in model.named_modules():
        if id(module) in covered or type(module).__name__ not in _CP_MODULES:
            continue
        if not callable(getattr(module, "set_context_parallel_group", None)):
            continue
        module.set_context_parallel_group(cp_group, ranks, cp_stream, cp_comm_type)
        covered.update(id(m) for m in module.modules())  # TE recursed into them
        done.append(fqn)
    if not done:
        raise ValueError(
            f"cp={cp} but {type(model).__name__} holds no TE DotProductAttention / MultiheadAttention / "
            "TransformerLayer: nothing would run context-parallel; use cp=1 or TE attention modules"
        )
    return done
