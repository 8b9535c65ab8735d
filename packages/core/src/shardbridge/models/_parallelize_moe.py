"""Apply TP, CP, expert parallelism and FSDP2 to :class:`~shardbridge.models.MoELlama`.

[Note: MoE parallel plan]
~~~~~~~~~~~~~~~~~~~~~~~~~
::

    dense region (unchanged from parallelize_llama)   mesh (dp_replicate, dp_shard, cp, tp)
      embeddings, attention, norms, output            TP plan of [Note: Llama TP plan]
      shared_expert.gate_up / .down                   TP column (fused) / row, like the Llama MLP
      router, shared_expert_gate                      replicated over tp
      FSDP units: tok_embeddings | each block | [norm, output] over dp_shard_cp (HSDP: x dp_replicate)

    expert region                                      mesh (dp_replicate, efsdp, ep)
      experts.gate_up_proj [E, 2I, D]                  Shard(0) on ep  (ep rank j: experts j*E/ep ..)
      experts.down_proj    [E, D, I]                   Shard(0) on ep
      FSDP unit: each block's experts, over efsdp (HSDP: x dp_replicate), gradient divided by
      dp_cp (every token counted once over the world, [Note: expert axes] in _mesh.py)
      tokens: split over tp, dispatched over ep ([Note: expert dispatch] in _ep.py)

The experts' FSDP unit is wrapped first (its own mesh), so each block's unit leaves the expert
parameters to it. A world with nothing to shard (efsdp = dp_replicate = 1, nothing cast) leaves
the experts unwrapped, as ``apply_fsdp`` does for a degree-1 data-parallel axis.

Expert tensors in checkpoints: [Note: expert checkpoints] in ``shardbridge/_ep.py``.
"""

from __future__ import annotations

from shardbridge._checks import checked_args
from shardbridge._ep import EPDispatch, shard_experts
from shardbridge._mesh import ParallelMesh
from shardbridge._precision import PrecisionPolicy
from shardbridge._tp import check_tp_divides
from shardbridge._wrap import apply_fsdp
from shardbridge.models._moe import MoELlama
from shardbridge.models._parallelize import apply_llama_tp

__all__ = ["parallelize_moe"]


@checked_args(model=MoELlama, mesh=ParallelMesh, policy=(PrecisionPolicy, None))
def parallelize_moe(
    model: MoELlama,
    mesh: ParallelMesh,
    policy: PrecisionPolicy | None = None,
    *,
    dispatch: EPDispatch = "auto",
    cp_comm: str = "all_gather",
) -> MoELlama:
    """TP of the dense region, CP, experts over ``ep`` with FSDP over ``efsdp``, then the dense FSDP units.

    Call on an initialised model whose parameters are identical on every rank, with the same
    arguments on every rank. See [Note: MoE parallel plan]. Train on
    ``loss + model.config.router_aux_loss_coef * model.aux_loss`` (``model.aux_loss`` is the
    global batch's load-balancing loss after each forward).

    Args:
        model: the model, in ``policy.main_params_dtype``.
        mesh: the run's :class:`~shardbridge.ParallelMesh` (``ParallelDims(..., ep=...)``).
        policy: mixed precision for FSDP2 (dense and expert units alike); None = no casting.
        dispatch: how tokens reach their experts: "all_to_all", "all_gather" or "auto"
            (``shardbridge.ep.choose_dispatch``).
        cp_comm: with cp > 1, the attention's "all_gather" or "ring".

    Returns:
        ``model``, parallelized in place.

    Raises:
        ValueError: ``num_experts`` not divisible by ep, or kv heads / the shared expert's
            width not divisible by tp; the message names the field.

    Example:
        >>> pm = ParallelDims(dp_shard=2, tp=2, ep=2).build_mesh("cpu")  # doctest: +SKIP
        >>> model = parallelize_moe(MoELlama(MoEConfig.tiny()), pm)  # doctest: +SKIP
    """
    if not isinstance(model, MoELlama):
        raise ValueError(f"parallelize_moe takes a MoELlama, got {type(model).__name__}; use parallelize_llama")
    _check_divides(model, mesh)
    if mesh.dims.tp > 1:
        apply_llama_tp(model, mesh["tp"])
    if mesh.dims.cp > 1:
        model.set_context_parallel(mesh["cp"], comm=cp_comm)
    model.set_expert_parallel(mesh, dispatch=dispatch)
    for experts in model.expert_modules():
        shard_experts(experts, mesh, policy)  # Shard(0) on ep, then FSDP2 over efsdp
    apply_fsdp(model, mesh, policy)
    return model


def _check_divides(model: MoELlama, mesh: ParallelMesh) -> None:
    cfg = model.config
    if cfg.num_experts % mesh.dims.ep:
        raise ValueError(
            f"MoEConfig.num_experts({cfg.num_experts}) is not divisible by ep({mesh.dims.ep}); every ep rank holds "
            "the same number of experts: choose ep dividing num_experts"
        )
    sizes = {"num_kv_heads": cfg.num_kv_heads}
    if cfg.shared_expert_intermediate_size:
        sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
    check_tp_divides(sizes, mesh.dims.tp, owner="MoEConfig.")
