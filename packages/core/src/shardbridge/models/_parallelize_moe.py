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

[Note: expert checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~
An expert tensor is ONE 3-D DTensor whose dim 0 is the global expert index in every layout:
ep splits dim 0 (``Shard(0)``), FSDP2 splits dim 0 again or dim 1, and DCP stores each rank's
box in global coordinates. A checkpoint therefore holds ``experts.gate_up_proj`` ``[E, 2I, D]``
whatever ep was, and loads into any ep, plain FSDP (ep=1), TP-only and one process
(``tests/checkpoint/test_experts.py``). FSDP2 stores the pieces as::

    FSDP on dim 0   (_StridedShard(0, sf=ep), Shard(0)) on (efsdp, ep)
                    rank (i, j): torch.chunk(ep piece j, efsdp)[i] -- experts j*E/ep + ...
    FSDP on dim 1   (Shard(1), Shard(0)): rank (i, j) holds experts j*E/ep .. (j+1)*E/ep - 1,
                    rows torch.chunk(2I rows, efsdp)[i]

``_StridedShard`` is where DCP goes wrong for FSDP2 x TP ([Note: strided sharding order]): it
reads FSDP2's layout right only when the pieces it strides over are equal. The ep pieces always
are (E is divisible by ep), so DCP describes both layouts right at every size, an uneven dim-0
split included (the property test ``test_expert_tensors_keep_item_coordinates_and_dcp_describes_them``
checks every coordinate against torch's own box; no layout repair is needed). What dim 0 does
badly is balance: 4 local experts over efsdp=8 leave half the ranks holding nothing. So FSDP2's
``shard_placement_fn`` takes dim 0 when ``E/ep`` splits evenly over efsdp, else the first later
dim that does (torchtitan switches to dim 1 when ``efsdp * ep > E``), else dim 0
(:func:`expert_shard_dim`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard

from shardbridge._ep import EPDispatch
from shardbridge._tp import check_tp_divides
from shardbridge._wrap import apply_fsdp, set_gradient_divide_factor
from shardbridge.models._moe import MoELlama
from shardbridge.models._parallelize import apply_llama_tp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from shardbridge._mesh import ParallelMesh
    from shardbridge._precision import PrecisionPolicy

__all__ = ["expert_shard_dim", "parallelize_moe"]


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
            (``shardbridge.choose_dispatch``).
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
        _shard_experts(experts, mesh, policy)
    apply_fsdp(model, mesh, policy)
    return model


def expert_shard_dim(shape: tuple[int, ...], *, ep: int, efsdp: int) -> int:
    """The dim FSDP2 shards an expert tensor ``[E, ...]`` on (its ``shard_placement_fn``).

    0 when ``E/ep`` splits evenly over ``efsdp``, else the first later dim that does (every rank
    then holds an equal share), else 0. See [Note: expert checkpoints].

    Example:
        >>> expert_shard_dim((8, 64, 32), ep=2, efsdp=2), expert_shard_dim((8, 64, 32), ep=2, efsdp=8)
        (0, 1)
    """
    if (shape[0] // ep) % efsdp == 0:
        return 0
    for dim in range(1, len(shape)):
        if shape[dim] % efsdp == 0:
            return dim
    return 0


def _shard_experts(experts: nn.Module, mesh: ParallelMesh, policy: PrecisionPolicy | None) -> None:
    ep_mesh = mesh["ep"]
    for name, param in list(experts.named_parameters(recurse=False)):
        # plain [E, ...] on every rank -> Shard(0) on ep: rank j keeps experts [j*E/ep, (j+1)*E/ep)
        setattr(experts, name, nn.Parameter(_shard_rows(param.detach(), ep_mesh), requires_grad=param.requires_grad))
    dims = mesh.dims
    needs_cast = policy is not None and (policy.param_dtype is not None or policy.output_dtype is not None)
    if dims.degree("efsdp") * dims.dp_replicate == 1 and dims.degree("dp_cp") == 1 and not needs_cast:
        return  # nothing to shard, reduce or cast: See [Note: MoE parallel plan]
    if policy is not None:
        policy.check_model_dtype(experts)
        mp_policy = policy.to_fsdp2()
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

        mp_policy = TorchMixedPrecisionPolicy()
    efsdp = dims.degree("efsdp")
    fully_shard(
        experts,
        mesh=mesh.expert_fsdp_mesh,
        mp_policy=mp_policy,
        shard_placement_fn=lambda p: Shard(expert_shard_dim(tuple(p.shape), ep=dims.ep, efsdp=efsdp)),
    )
    # Every token reaches each expert's gradient once over the world: average over the
    # data-parallel ranks (dp_cp), not over efsdp. See [Note: custom gradient divide factor].
    set_gradient_divide_factor(experts, float(dims.degree("dp_cp")))


def _shard_rows(full: torch.Tensor, ep_mesh: DeviceMesh) -> DTensor:
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    rows = full.shape[0] // ep
    local = full.narrow(0, rank * rows, rows).clone()
    stride = torch.empty(full.shape, device="meta").stride()
    return DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=full.shape, stride=stride)


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
