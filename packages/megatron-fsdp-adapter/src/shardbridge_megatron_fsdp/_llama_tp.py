"""A column-parallel-only TP plan for the reference Llama (megatron-fsdp 0.6.1 takes Shard(0) only).

[Note: dim-0 TP plan]
~~~~~~~~~~~~~~~~~~~~~
The core's plan (``shardbridge.models._parallelize``) makes ``o_proj``/``down`` row-parallel
(``Shard(1)``), which megatron-fsdp 0.6.1 cannot shard (``shard_model`` refuses it). This plan
keeps every TP weight on dim 0::

    tok_embeddings  replicated over tp (see below)
    qkv, gate_up    Shard(0), fused (shard_fused)  out: local [q_j|k_j|v_j], [gate_j|up_j]
    o_proj, down    Shard(0)                       in: Shard(-1) -> Replicate (all-gather)
                                                   out: Shard(-1) -> Replicate
    output          Shard(0) vocab rows            out: Shard(-1) -> Replicate logits

The embedding stays replicated over tp: with torch's ``RowwiseParallel`` on ``nn.Embedding``
megatron-fsdp 0.6.1 receives a gradient of the global shape for the TP-local main grad and
fails in ``_grad_acc`` ("size of tensor a (128) must match ... (256)"). It costs an extra activation all-gather per projection against the row-parallel plan, and
it stores the same parameters under the same names, so its checkpoints load into models
parallelized with the core plan (any layout) and back.
"""

from __future__ import annotations

from shardbridge import FUSED_SPECS_ATTR, check_tp_divides, shard_fused
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, parallelize_module

__all__ = ["apply_llama_tp"]


def apply_llama_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard a :class:`shardbridge.models.Llama` over ``tp_mesh`` with dim-0 weights only.

    See [Note: dim-0 TP plan]. Call before :func:`~shardbridge_megatron_fsdp.shard_model`.

    Example:
        >>> apply_llama_tp(model, pm["tp"])  # doctest: +SKIP
    """
    if tp_mesh.size() == 1:
        return model
    cfg = model.config
    sizes = {"num_kv_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size}
    check_tp_divides(sizes, tp_mesh.size(), owner="LlamaConfig.")
    plan: dict[str, ParallelStyle] = {
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for index, block in enumerate(model.layers):
        for linear in (block.attention.qkv, block.feed_forward.gate_up):
            spec = getattr(linear, FUSED_SPECS_ATTR)["weight"]
            # plain [gate; up] -> Shard(0), rank j holds [gate_j; up_j]
            linear.weight = nn.Parameter(shard_fused(linear.weight.detach(), spec, tp_mesh))
        prefix = f"layers.{index}"
        plan[f"{prefix}.attention.qkv"] = ColwiseParallel()
        plan[f"{prefix}.feed_forward.gate_up"] = ColwiseParallel()
        for name in ("attention.o_proj", "feed_forward.down"):
            plan[f"{prefix}.{name}"] = ColwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())
    parallelize_module(model, tp_mesh, plan)
    return model
