"""Apply tensor parallelism and FSDP2 to :class:`~shardbridge.models.Llama`.

[Note: Llama TP plan]
~~~~~~~~~~~~~~~~~~~~~
::

    tok_embeddings  weight Shard(0) (vocab rows)  in: Replicate ids  out: Partial -> Replicate
    qkv, gate_up    weight Shard(0), FUSED        in: Replicate       out: local [q_j|k_j|v_j], [gate_j|up_j]
    o_proj, down    weight Shard(1)               in: local Shard(-1) out: Partial -> Replicate
    norms           replicated plain tensors (every TP rank computes the same values)
    output          weight Shard(0) (vocab rows)  in: Replicate       out: Shard(-1) -> Replicate logits

The fused weights go through ``shard_fused``: plain ``ColwiseParallel`` would chunk
``[gate; up]`` by rows and hand TP rank 0 only gate rows. The vocab may be uneven over tp
(250 over 4 -> 63, 63, 63, 61): embedding lookups mask the ids other ranks own, and the
logits all-gather pads and unpads. Hidden dims are not: ``FusedSpec.check_tp`` requires
``num_kv_heads % tp == 0`` and ``intermediate_size % tp == 0``, so the ``Shard(-1)``
activations into ``o_proj``/``down`` are even and torch's ``RowwiseParallel`` (which
assumes even shards when it wraps a local tensor) is right. Logits stay full-vocab so the
loss is the same code in every layout; a loss-parallel cross entropy would save the
all-gather.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from shardbridge import fp8
from shardbridge._checks import checked_args
from shardbridge._fused import FUSED_SPECS_ATTR, shard_fused
from shardbridge._mesh import ParallelMesh
from shardbridge._precision import PrecisionPolicy
from shardbridge._tp import TPMode, check_tp_divides, unview_tp_output
from shardbridge._wrap import apply_fsdp
from shardbridge.models._llama import Llama

__all__ = ["apply_llama_tp", "parallelize_llama"]


@checked_args(model=Llama, mesh=ParallelMesh, policy=(PrecisionPolicy, None))
def parallelize_llama(
    model: Llama,
    mesh: ParallelMesh,
    policy: PrecisionPolicy | None = None,
    *,
    compile: bool = False,
    cp_comm: str = "all_gather",
) -> Llama:
    """Tensor parallelism (when tp > 1), context parallelism (cp > 1), per-block compile, then FSDP2 units.

    A model converted for FP8 (``shardbridge.fp8.convert``, before this call) gets its backend's
    TP styles for the converted Linears and, at the end, ``fp8.refresh``. Call on an initialised model (``init_weights`` done) whose parameters are identical on
    every rank; call with the same arguments on every rank. With cp > 1, feed each rank its
    part of the batch (``shardbridge.cp.cp_split`` of tokens and labels over ``mesh["cp"]``) and
    reduce the loss with ``shardbridge.cp.cp_cross_entropy``.

    Args:
        model: the model, in ``policy.main_params_dtype``.
        mesh: the run's :class:`~shardbridge.ParallelMesh`.
        policy: mixed precision for FSDP2; None = no casting.
        compile: ``torch.compile`` each transformer block (before FSDP, as torchtitan).
        cp_comm: with cp > 1, how attention spans cp: "all_gather" (K/V all-gathered) or
            "ring" (K/V passed around the cp ring; CPU). See ``shardbridge.cp.cp_attention``.

    Returns:
        ``model``, parallelized in place.

    Raises:
        ValueError: ``num_kv_heads`` or ``intermediate_size`` not divisible by tp.

    Example:
        >>> pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")  # doctest: +SKIP
        >>> model = parallelize_llama(Llama(LlamaConfig.tiny()), pm)  # doctest: +SKIP
    """
    apply_llama_tp(model, mesh["tp"])
    if mesh.dims.cp > 1:
        # Attention spans the cp axis; params stay replicated over cp, FSDP shards them over
        # the flattened dp_shard_cp (see [Note: loss over dp_cp] in shardbridge._cp).
        model.set_context_parallel(mesh["cp"], comm=cp_comm)
    if compile:
        for block in model.layers:
            block.compile()
    apply_fsdp(model, mesh, policy)
    fp8.refresh(model)  # an FP8-converted model: what derives from the sharded weights (first scales)
    return model


@checked_args(model=Llama, tp_mesh=DeviceMesh)
def apply_llama_tp(model: Llama, tp_mesh: DeviceMesh) -> Llama:
    """Shard ``model`` over the 1-D ``tp_mesh`` as in [Note: Llama TP plan]: the TP step of :func:`parallelize_llama`.

    Column-parallel qkv/gate_up (fused), row-parallel o_proj/down, vocab-parallel embedding and
    output. For frameworks that shard the rest themselves (``shardbridge_megatron_fsdp.shard_model``);
    a 1-rank ``tp_mesh`` changes nothing.

    Returns:
        ``model``, sharded in place.

    Raises:
        ValueError: ``num_kv_heads`` or ``intermediate_size`` not divisible by the tp size.

    Example:
        >>> apply_llama_tp(Llama(LlamaConfig.tiny()), pm["tp"])  # doctest: +SKIP
    """
    if tp_mesh.size() == 1:
        return model
    _check_tp_divides(model, tp_mesh.size())
    plan: dict[str, ParallelStyle] = {
        # Shard(0) vocab rows; Partial -> Replicate (all-reduce) of the looked-up rows.
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        # Shard(-1) -> Replicate: full-vocab logits on every TP rank.
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    done = fp8.converted(model)
    fp8_styles = done.tp_styles if done is not None else None

    def style(kind: str, linear: nn.Module) -> ParallelStyle:
        # Modules fp8.convert converted take its backend's styles (MXFP8: the linear on local shards).
        if fp8_styles is not None and fp8.converted_fqn(linear) is not None:
            return fp8_styles[kind]()
        return ColwiseParallel() if kind == "colwise" else RowwiseParallel()

    # Every other module by the model's own plan: fused column weights first become Shard(0)
    # DTensors in item coordinates (shard_fused), then torch's styles take them as they are.
    modules = dict(model.named_modules())
    for fqn, param_tp in model.tp_plan().items():
        module_name, _, param_name = fqn.rpartition(".")
        if module_name in plan or param_tp.mode is TPMode.NONE:
            continue
        linear = modules[module_name]
        if param_tp.fused is not None and param_name == "weight":
            _shard_fused_weight(linear, tp_mesh)
        # column: Replicate in -> TP-local out; row: local Shard(-1) in -> Partial -> Replicate out
        plan[module_name] = style("colwise" if param_tp.mode is TPMode.COLUMN else "rowwise", linear)
    parallelize_module(model, tp_mesh, plan)
    # Their outputs leave FSDP2 units (embeddings; [norm, output] and the root): [Note: TP outputs are not views].
    unview_tp_output(model.tok_embeddings)
    unview_tp_output(model.output)
    if model.config.tie_word_embeddings:
        # Both are Shard(0) over vocab rows; ColwiseParallel re-wrapped output's parameter.
        model.output.weight = model.tok_embeddings.weight
    return model


def _shard_fused_weight(linear: nn.Linear, tp_mesh: DeviceMesh) -> None:
    spec = getattr(linear, FUSED_SPECS_ATTR)["weight"]
    # plain [q; k; v] -> Shard(0) DTensor whose rank-j local is [q_j; k_j; v_j]
    full = linear.weight.detach()
    weight = shard_fused(full, spec, tp_mesh)
    if type(full) is not torch.Tensor:
        # An FP8 weight wrapper (torchao's keep their class through new_zeros and copy_): the local
        # piece stays one, or the converted Linear would silently compute in high precision.
        local = full.new_zeros(weight.to_local().shape).copy_(weight.to_local())
        weight = DTensor.from_local(
            local, tp_mesh, weight.placements, run_check=False, shape=weight.shape, stride=weight.stride()
        )
    linear.weight = nn.Parameter(weight, requires_grad=linear.weight.requires_grad)


def _check_tp_divides(model: Llama, tp: int) -> None:
    cfg = model.config
    sizes = {"num_kv_heads": cfg.num_kv_heads, "intermediate_size": cfg.intermediate_size}
    check_tp_divides(sizes, tp, owner="LlamaConfig.")
