r"""Megatron-Core GPT parameter layouts: TP placement, fused QKV and SwiGLU in item coordinates.

[Note: Megatron QKV order]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-Core's ``linear_qkv`` stores its rows per query group (KV head)::

    [ q heads of group 0 | k_0 | v_0 | q heads of group 1 | k_1 | v_1 | ... ]

and TP splits the rows contiguously, whole groups per rank. So the DTensor-global tensor of a
TP-sharded ``linear_qkv`` (the concatenation of the TP-local pieces) is the same tensor at
every TP degree, and it equals the core's ``FusedSpec.qkv`` layout "TP-interleaved
``num_query_groups`` ways" (one segment triple per group: the q heads of a group are heads
``g * heads_per_group ...``, the HF order too). :class:`MegatronQKVSpec` is that spec: its
segments never depend on the actual TP degree, which only has to divide the group count.

``linear_fc1`` of a gated MLP (SwiGLU) is ``[gate_j; up_j]`` per TP rank (Megatron builds it
with ``partition_stride=2``): exactly the core's ``FusedSpec.swiglu`` at the actual TP
degree. Components are stored as ``...self_attention.{q,k,v}_proj.weight`` and
``...mlp.{gate,up}_proj.weight`` (see [Note: component names] in the core).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from shardbridge.fused import FusedSegment, FusedSpec, register_fused
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from shardbridge_megatron_fsdp._experts import ExpertStack, register_expert_stack

__all__ = ["MegatronQKVSpec", "fused_tp", "register_gpt_experts", "register_gpt_fused", "tp_dim", "tp_local"]

QKV_NAMES = ("q_proj", "k_proj", "v_proj")
SWIGLU_NAMES = ("gate_proj", "up_proj")


@dataclass(frozen=True, kw_only=True)
class MegatronQKVSpec(FusedSpec):
    """Megatron-Core's fused QKV: per query group ``[q heads; k; v]``. See [Note: Megatron QKV order].

    Example:
        >>> spec = MegatronQKVSpec.megatron(num_heads=4, num_query_groups=2, head_dim=1)
        >>> [(s.name, s.item_start) for s in spec.segments(1)]
        [('q_proj', 0), ('k_proj', 2), ('v_proj', 3), ('q_proj', 4), ('k_proj', 6), ('v_proj', 7)]
    """

    num_query_groups: int
    """Query groups (KV heads); the fixed interleave of the rows."""

    @classmethod
    def megatron(cls, *, num_heads: int, num_query_groups: int, head_dim: int, dim: int = 0) -> MegatronQKVSpec:
        """The spec of a ``linear_qkv`` weight (``dim=0``) or bias."""
        base = FusedSpec.qkv(num_heads=num_heads, num_kv_heads=num_query_groups, head_dim=head_dim, names=QKV_NAMES)
        return cls(components=base.components, dim=dim, head_dim=head_dim, num_query_groups=num_query_groups)

    def check_tp(self, tp_size: int) -> None:
        """Raise unless ``tp_size`` divides ``num_query_groups`` (whole groups per TP rank)."""
        if not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tp_size={tp_size!r} must be an int >= 1")
        if self.num_query_groups % tp_size:
            raise ValueError(
                f"num_query_groups={self.num_query_groups} is not divisible by tp_size={tp_size}; Megatron-Core "
                "splits linear_qkv by whole query groups: use a tensor_model_parallel_size dividing it"
            )

    def segments(self, tp_size: int) -> tuple[FusedSegment, ...]:
        """The same segments at every TP degree: the layout interleaved by query group."""
        self.check_tp(tp_size)
        return FusedSpec.segments(self, self.num_query_groups)


def register_gpt_fused(model: nn.Module, config: object) -> dict[str, FusedSpec]:
    """Register fused QKV and (gated MLP) SwiGLU ``linear_fc1`` specs on a Megatron-Core GPT model.

    Routed experts' ``linear_fc1`` (``...experts.local_experts.{i}.linear_fc1``) is not
    registered: it is stored whole, ``[gate; up]`` in an ``[E, 2I, D]`` expert tensor (see
    :func:`register_gpt_experts`). A shared expert's is, with its own width.

    Returns the specs by parameter FQN. Idempotent.
    """
    heads = config.num_attention_heads
    groups = config.num_query_groups or heads
    head_dim = config.kv_channels or config.hidden_size // heads
    out: dict[str, FusedSpec] = {}
    for prefix, module in model.named_modules():
        leaf = prefix.rsplit(".", 1)[-1]
        for pname in ("weight", "bias"):
            if module._parameters.get(pname) is None:
                continue
            if leaf == "linear_qkv":
                spec: FusedSpec = MegatronQKVSpec.megatron(num_heads=heads, num_query_groups=groups, head_dim=head_dim)
            elif leaf == "linear_fc1" and config.gated_linear_unit and ".local_experts." not in f".{prefix}":
                width = config.ffn_hidden_size
                if ".shared_experts." in f".{prefix}.":
                    width = config.moe_shared_expert_intermediate_size
                spec = FusedSpec.swiglu(width, names=SWIGLU_NAMES)
            else:
                continue
            register_fused(module, pname, spec)
            out[f"{prefix}.{pname}"] = spec
    return out


def register_gpt_experts(model: nn.Module) -> dict[str, ExpertStack]:
    """Register the routed experts of a Megatron-Core GPT model's MoE layers for checkpoints.

    Each MoE layer's ``SequentialMLP`` (``moe_grouped_gemm=False``) gets an
    :class:`ExpertStack` from the layer's own ``local_expert_indices``, so its
    ``local_experts.{i}`` are stored as the ``[E, ...]`` tensors of [Note: local experts in
    global coordinates] (``_experts.py``). Call after the model is built (the indices depend on
    the ep rank). Idempotent.

    Returns:
        The stacks by the FQN of the experts module (empty for a dense model).

    Raises:
        NotImplementedError: a MoE layer whose experts are not a ``SequentialMLP`` (``TEGroupedMLP``
            / ``GroupedMLP``: ``moe_grouped_gemm=True``, GPU only).
    """
    out: dict[str, ExpertStack] = {}
    for prefix, module in model.named_modules():
        indices = getattr(module, "local_expert_indices", None)
        experts = getattr(module, "experts", None)
        if indices is None or experts is None:
            continue
        where = f"{prefix}.experts" if prefix else "experts"
        if not isinstance(getattr(experts, "local_experts", None), nn.ModuleList):
            raise NotImplementedError(
                f"{where} is a {type(experts).__name__}: only SequentialMLP experts (moe_grouped_gemm=False, "
                "local_experts.{i}) are checkpointed in global expert coordinates; TEGroupedMLP / GroupedMLP "
                "(moe_grouped_gemm=True) need a GPU and are not wired (docs/megatron-fsdp.md, Megatron-Core MoE)"
            )
        stack = ExpertStack(global_indices=tuple(int(i) for i in indices), num_experts=module.config.num_moe_experts)
        register_expert_stack(experts, stack)
        out[where] = stack
    return out


def tp_dim(param: torch.Tensor) -> int | None:
    """The dim a Megatron TP parameter is split on (``partition_dim``), None when replicated."""
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None


def tp_local(full: torch.Tensor, dim: int | None, spec: FusedSpec | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    """The TP-local piece of a full (tp=1 layout) tensor, as Megatron-Core holds it.

    Fused SwiGLU rows: ``[gate_j; up_j]``; Megatron QKV and everything else: the ``tp_rank``-th
    contiguous chunk along ``dim``; ``dim=None``: the whole tensor.
    """
    if dim is None or tp_size == 1:
        return full
    if spec is not None and not isinstance(spec, MegatronQKVSpec) and spec.dim == dim:
        from shardbridge.fused import tp_local_fused

        return tp_local_fused(full, spec, tp_size, tp_rank)
    if full.shape[dim] % tp_size:
        raise ValueError(
            f"size {full.shape[dim]} along dim {dim} is not divisible by tensor_model_parallel_size={tp_size}"
        )
    return full.chunk(tp_size, dim)[tp_rank]


def fused_tp(spec: FusedSpec | None, param: DTensor) -> int:
    """The TP degree that interleaves a fused parameter's items (1 for Megatron QKV's fixed order and unfused ones)."""
    if spec is None or isinstance(spec, MegatronQKVSpec):
        return 1
    tp = 1
    names = param.device_mesh.mesh_dim_names or ()
    for name, size, p in zip(names, param.device_mesh.shape, param.placements):
        if name == "tp" and type(p) is Shard and p.dim == spec.dim:
            tp *= size
    return tp
