"""The reference Llama's full TP plan (the core's), for Megatron-FSDP.

[Note: Llama TP under Megatron-FSDP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``apply_llama_tp`` applies the core's plan (``shardbridge.models._parallelize``, [Note: Llama TP
plan]) unchanged::

    tok_embeddings  Shard(0) vocab rows      (vocab-parallel; Partial -> Replicate output)
    qkv, gate_up    Shard(0), fused          (column-parallel)
    o_proj, down    Shard(1)                 (row-parallel; Partial -> Replicate output)
    norms           replicated plain tensors
    output          Shard(0) vocab rows      (Shard(-1) -> Replicate logits)

Megatron-FSDP 0.6.1 mis-describes ``Shard(1)`` DTensor parameters and receives the vocab-parallel
embedding's gradient as ``Replicate``; ``shard_model`` fixes both (see [Note: TP DTensor
parameters in Megatron-FSDP] in ``_tp_patch.py``). Earlier versions of this adapter turned
o_proj/down column-parallel instead (an extra activation all-gather per projection); that
workaround is gone. A model built with this plan holds exactly the parameters, names and
placements of ``shardbridge.models.parallelize_llama``'s TP step, so checkpoints move between
Megatron-FSDP and torch FSDP2 in both directions at any layout.
"""

from __future__ import annotations

from shardbridge import check_tp_divides
from shardbridge.models import Llama
from shardbridge.models._parallelize import apply_tp
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["apply_llama_tp"]


def apply_llama_tp(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """Shard a :class:`shardbridge.models.Llama` over ``tp_mesh`` with the core's full TP plan.

    Column-parallel qkv/gate_up, row-parallel o_proj/down, vocab-parallel embedding and output
    (see [Note: Llama TP under Megatron-FSDP]). Call before
    :func:`~shardbridge_megatron_fsdp.shard_model`; a 1-rank ``tp_mesh`` changes nothing.

    Raises:
        ValueError: ``num_kv_heads`` or ``intermediate_size`` not divisible by the tp size.

    Example:
        >>> apply_llama_tp(model, pm["tp"])  # doctest: +SKIP
    """
    if tp_mesh.size() == 1:
        return model
    cfg = model.config
    sizes = {"num_kv_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size}
    check_tp_divides(sizes, tp_mesh.size(), owner="LlamaConfig.")
    apply_tp(model, tp_mesh)
    return model
