"""Megatron-Core models under Megatron-Core's own Megatron-FSDP, from shardbridge's dims and policy.

[Note: the Megatron-Core path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
This is what Megatron-LM does with ``--use-megatron-fsdp``, driven by shardbridge's
configuration::

    shardbridge                               Megatron-Core 0.16.1
    ParallelDims(dp_shard=-1, tp=T, ep=E) -->  parallel_state.initialize_model_parallel(T,
                                                expert_model_parallel_size=E,
                                                expert_tensor_parallel_size=1)
                                              (rank order tp fastest, as ParallelDims' mesh;
                                              experts: ep fastest, then expert dp = efsdp)
                                              + model_parallel_cuda_manual_seed(seed)
    PrecisionPolicy            ------>  DistributedDataParallelConfig(
                                                grad_reduce_in_fp32, preserve_fp32_weights)
    shard_model(fp8=FP8Recipe)  ------>  DistributedDataParallelConfig(fp8_param_gather=True)
                                              on a GPU, checked against the TransformerConfig's
                                              fp8 / fp8_recipe / fp8_param (see [Note: FP8 on
                                              the Megatron-Core path])
    shard_model(model, optimizer, ...) --->  FullyShardedDataParallel(config, ddp_config, model)
                                              (mcore_fsdp_adapter.py: the bundled megatron_fsdp)
                                              + its fully_shard_optimizer (step installs the
                                              main weights; zero_grad clears the buffers)

Expert parallelism is Megatron-Core's own (its MoE layers, ``SequentialMLP`` experts, its
token dispatchers). ``expert_tensor_parallel_size=1`` makes Megatron's expert groups the
``(efsdp, ep)`` axes of [Note: expert axes] in ``shardbridge/_mesh.py`` rank for rank: an ep
group takes consecutive ranks (the tp ranks first), Megatron-FSDP shards each expert over the
expert data-parallel group (efsdp), and experts are never tensor-parallel. The experts are
registered so that checkpoints store them in global expert coordinates ([Note: local experts
in global coordinates] in ``_experts.py``).

The model's TP parameters are Megatron-style plain tensors (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``): column-parallel (``linear_qkv``, ``linear_fc1``,
the vocab-parallel embedding and output layer, ``partition_dim=0``) AND row-parallel
(``linear_proj``, ``linear_fc2``, ``partition_dim=1``). The bundled Megatron-FSDP turns them
into DTensors on its (dp_cp, tp) mesh itself, so no TP conversion happens here. On gloo
``gradient_reduce_div_fusion`` is turned off (no PREMUL_SUM), and on a host without CUDA the
CPU patch is installed for the megatron-core host (see [Note: the CPU patch] in ``_cpu_patch.py``). Without
Transformer Engine, megatron-core 0.16.1's ``FullyShardedDataParallel`` fails for any TP > 1
model (``isinstance(m, (TELinear,))`` with a stand-in that is no class); ``_compat.fix_missing_te_linear`` fixes that on any device.
"""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.distributed as dist
from shardbridge import ParallelDims, PrecisionPolicy, param_group_fqns, rebind_param_groups
from shardbridge.fp8 import FP8Recipe
from torch import nn

from shardbridge_megatron_fsdp import _cpu_patch
from shardbridge_megatron_fsdp._compat import (
    STRATEGIES,
    bundled_fsdp,
    disable_grad_div_fusion,
    fix_missing_te_linear,
    fix_missing_te_router_gemm,
    install_distributed_params,
    optimizer_named_parameters,
    require_megatron_core,
)
from shardbridge_megatron_fsdp._optimizer import zero_step
from shardbridge_megatron_fsdp.mcore._layout import register_gpt_experts, register_gpt_fused

__all__ = ["STRATEGIES", "check_cpu_config", "destroy_parallel_state", "init_parallel_state", "shard_model"]

# TransformerConfig fields that select CUDA-only kernels; False on a host without CUDA.
_CUDA_ONLY_FLAGS = (
    "masked_softmax_fusion",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "apply_rope_fusion",
    "persist_layer_norm",
    "gradient_accumulation_fusion",
    "moe_permute_fusion",
    "moe_router_fusion",
)


def init_parallel_state(dims: ParallelDims, *, seed: int = 0) -> ParallelDims:
    """Initialise Megatron-Core's ``parallel_state`` for ``dims`` on the default process group.

    Call on every rank after ``torch.distributed.init_process_group``. ``dims.ep`` is Megatron's
    ``expert_model_parallel_size`` (with ``expert_tensor_parallel_size=1``: experts are split
    over ep, never over tp; see [Note: the Megatron-Core path]); build MoE models with
    ``TransformerConfig(expert_model_parallel_size=dims.ep)``. Also seeds Megatron's RNG
    tracker (``model_parallel_cuda_manual_seed``), on CPU through the CPU patch.

    Returns:
        ``dims`` resolved for the world size.

    Raises:
        NotImplementedError: ``dp_replicate > 1`` or ``cp > 1`` (not wired on this path yet).
        ValueError: the degrees do not multiply to the world size, or ep does not divide
            dp_shard * tp (from ``ParallelDims``).

    Example:
        >>> dims = init_parallel_state(ParallelDims(dp_shard=-1, tp=2))  # doctest: +SKIP
    """
    require_megatron_core()
    dims = dims.resolve(dist.get_world_size())
    if dims.dp_replicate > 1 or dims.cp > 1:
        raise NotImplementedError(
            f"{dims}: the Megatron-Core path supports dp_shard x tp (dp_replicate=1, cp=1); "
            "HSDP and context parallelism are not wired for megatron-core yet"
        )
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    _cpu_patch.install(_cpu_patch.MEGATRON_CORE, pin=True)
    fix_missing_te_router_gemm()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp, expert_model_parallel_size=dims.ep, expert_tensor_parallel_size=1
    )
    model_parallel_cuda_manual_seed(seed)
    return dims


def destroy_parallel_state() -> None:
    """``parallel_state.destroy_model_parallel()`` (the default process group stays)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


def check_cpu_config(config: Any) -> None:
    """ValueError naming the field when a TransformerConfig selects a CUDA-only kernel on a host.

    Does nothing when CUDA is available.
    """
    if torch.cuda.is_available():
        return
    on = [name for name in _CUDA_ONLY_FLAGS if getattr(config, name, False)]
    if on:
        raise ValueError(
            f"TransformerConfig {', '.join(f'{n}=True' for n in on)} selects CUDA-only kernels, and this host has "
            f"no CUDA; set {', '.join(f'{n}=False' for n in on)} (docs/megatron-fsdp.md, CPU vs GPU)"
        )


_MCORE_FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise")
"""``TransformerConfig.fp8_recipe`` values of megatron-core 0.16.1 that are shardbridge recipe names."""


def fp8_fields(recipe: FP8Recipe | None, config: Any, *, device_type: str) -> dict[str, Any]:
    """``DistributedDataParallelConfig`` keywords for the FP8 ``recipe`` on the Megatron-Core path.

    [Note: FP8 on the Megatron-Core path]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    Megatron-Core builds its TE modules from the ``TransformerConfig`` (``fp8``,
    ``fp8_recipe``, ``fp8_param``), and its Megatron-FSDP all-gathers FP8 parameters with
    ``DistributedDataParallelConfig(fp8_param_gather=True)``. shardbridge's recipe (``shard_model``'s
    ``fp8``) is the one FP8 setting, so the two must say the same::

        fp8                                          TransformerConfig        DDP config
        None                                         fp8=None, fp8_param=F    (nothing)
        FP8Recipe(backend="te", name=R,              fp8="e4m3"|"hybrid",     fp8_param_gather=True
                  fp8_params=True), R in             fp8_recipe=R,
                  tensorwise/delayed/mxfp8/blockwise fp8_param=True

    Everything else is refused by name: torchao recipes and ``fp8_params=False`` (as on the
    standalone path, [Note: FP8 under Megatron-FSDP]), "nvfp4" (``TransformerConfig.fp4`` in
    megatron-core 0.16.1, not wired), CPU (TE's kernels), and a TransformerConfig that
    disagrees with the policy. GPU only: nothing here has run on a GPU yet.

    Raises:
        ValueError: the TransformerConfig disagrees with ``recipe`` (both named).
        NotImplementedError: what this path does not run (named, with what it does).
    """
    from shardbridge_megatron_fsdp._precision import fp8_ddp_kwargs

    if recipe is None:
        on = [f"{n}={getattr(config, n)!r}" for n in ("fp8", "fp8_param") if getattr(config, n, None)]
        if on:
            raise ValueError(
                f"TransformerConfig {', '.join(on)} but shard_model(fp8=None): the recipe is the run's one FP8 "
                f"setting; pass fp8=FP8Recipe(backend='te', name={getattr(config, 'fp8_recipe', 'delayed')!r}, "
                "fp8_params=True) (GPU), or TransformerConfig(fp8=None, fp8_param=False)"
            )
        return {}
    fields = fp8_ddp_kwargs(recipe, device_type=device_type)  # torchao, fp8_params=False, CPU: refused by name
    if recipe.name not in _MCORE_FP8_RECIPES:
        raise NotImplementedError(
            f"fp8={recipe}: megatron-core 0.16.1 configures {recipe.name!r} outside "
            f"TransformerConfig.fp8_recipe (fp4 recipes), which is not wired; use one of {list(_MCORE_FP8_RECIPES)}"
        )
    want = {"fp8": ("e4m3", "hybrid"), "fp8_recipe": (recipe.name,), "fp8_param": (True,)}
    wrong = [f"{n}={getattr(config, n, None)!r}" for n, ok in want.items() if getattr(config, n, None) not in ok]
    if wrong:
        raise ValueError(
            f"fp8={recipe} but TransformerConfig {', '.join(wrong)}: Megatron-Core builds its TE "
            f"modules from the TransformerConfig, so set TransformerConfig(fp8='hybrid' or 'e4m3', "
            f"fp8_recipe={recipe.name!r}, fp8_param=True), or change fp8 to match it"
        )
    return fields


# [Note: Megatron-Core 0.16.1 gradient reduction]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The Megatron-FSDP that megatron-core 0.16.1 bundles reduces gradients right only for these
# sizes of a parameter group's data-parallel group (measured on gloo: the update of one SGD step
# against a single-process run; dense GPT and MoE GPT alike; ratio of update norms)::
#
#     strategy              dp group of 1          dp group of 2 or more
#     no_shard              right                  WRONG (1.7x - 2.2x)
#     optim                 right                  WRONG (1.2x - 2.2x)
#     optim_grads           WRONG (1.9x - 2.0x)    right
#     optim_grads_params    WRONG (1.9x - 2.0x)    right
#
# Where it is wrong for the sharded strategies, the gradient buffer is not data-distributed
# (one rank), so the bucket handed to the reduce-scatter is a view of the buffer, and
# ``ParamAndGradBuffer._bucket_group_gradient_reduce`` then adds the reduced shard to that
# same buffer (``local_grad += reduced_grad``): every gradient counts twice. For ``optim``
# (gradients not sharded) the reduced slice likewise lands on top of the local gradient;
# Megatron-LM later copies instead of adding for ``no_shard`` / ``optim``. The dense region's
# group is dp_shard (x cp); a MoE model's experts have their own, the expert data-parallel
# group (efsdp = dp_shard * tp / ep), so ep = dp_shard * tp (one rank per expert copy, e.g.
# ep4 on 4 ranks) is wrong under every sharded strategy, and one process under both. Such a
# wrap still loads, saves, exports and runs forward (nothing there reduces gradients); its
# ``optimizer.step()`` raises NotImplementedError naming the group.
_REDUCES_RIGHT: dict[str, tuple[str, Any]] = {
    "no_shard": ("one rank", lambda size: size == 1),
    "optim": ("one rank", lambda size: size == 1),
    "optim_grads": ("two or more ranks", lambda size: size > 1),
    "optim_grads_params": ("two or more ranks", lambda size: size > 1),
}


def gradient_reduction_problem(strategy: str, groups: dict[str, int]) -> str | None:
    """Why Megatron-Core 0.16.1's Megatron-FSDP reduces some group's gradients wrong, or None.

    ``groups``: name -> size of each data-parallel group the model's parameters reduce over.
    See [Note: Megatron-Core 0.16.1 gradient reduction].
    """
    needs, right = _REDUCES_RIGHT[strategy]
    wrong = [f"the {name} has {size} rank{'s' if size > 1 else ''}" for name, size in groups.items() if not right(size)]
    if not wrong:
        return None
    return (
        f"strategy={strategy!r} and {', '.join(wrong)}: megatron-core 0.16.1's Megatron-FSDP reduces such a group's "
        f"gradients wrong (they count twice; {strategy!r} is right for groups of {needs} only; docs/megatron-fsdp.md, "
        "Megatron-Core MoE); use optim_grads_params (or optim_grads) with every data-parallel group >= 2 ranks "
        "(for experts: ep < dp_shard * tp), or no_shard / optim where every group has one rank"
    )


def _refuse_steps(optimizer: torch.optim.Optimizer, problem: str) -> None:
    """``optimizer.step()`` raises NotImplementedError(problem) (loading and saving still work)."""

    def step(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(problem)

    optimizer.step = types.MethodType(step, optimizer)


def _ddp_config(
    policy: PrecisionPolicy, strategy: str, model_dtype: torch.dtype, fp8_kwargs: dict[str, Any] | None = None
) -> Any:
    """DistributedDataParallelConfig for ``policy``: megatron-core 0.16.1 has two booleans (+ fp8_kwargs)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    if policy.output_dtype is not None:
        raise NotImplementedError(
            f"PrecisionPolicy.output_dtype={policy.output_dtype} has no Megatron-Core FSDP counterpart in "
            "megatron-core 0.16.1 (it does not cast module outputs); set output_dtype=None"
        )
    if policy.param_dtype not in (None, model_dtype):
        raise ValueError(
            f"PrecisionPolicy.param_dtype={policy.param_dtype} but the model's parameters are {model_dtype}: "
            "Megatron-Core computes in the dtype the model is built in; build it with "
            "TransformerConfig(params_dtype=..., bf16=...) or set param_dtype=None"
        )
    if policy.main_params_dtype != torch.float32:
        raise NotImplementedError(
            f"main_params_dtype={policy.main_params_dtype}: Megatron-Core 0.16.1 FSDP keeps fp32 main weights "
            "(preserve_fp32_weights) or none; use main_params_dtype=torch.float32"
        )
    comm = policy.effective_grad_comm_dtype
    if comm == torch.float32 and policy.main_grads_dtype == torch.float32:
        fp32_reduce = True
    elif comm == model_dtype and policy.main_grads_dtype in (torch.float32, model_dtype):
        fp32_reduce = False
    else:
        raise NotImplementedError(
            f"grad_comm_dtype={comm}, main_grads_dtype={policy.main_grads_dtype} with a {model_dtype} model: "
            "Megatron-Core 0.16.1 reduces gradients in fp32 (grad_reduce_in_fp32) or in the model dtype only"
        )
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=fp32_reduce,
        preserve_fp32_weights=True,
        use_distributed_optimizer=True,
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=strategy,
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        average_in_collective=False,
        **(fp8_kwargs or {}),
    )


def shard_model(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: Any,
    policy: PrecisionPolicy | None = None,
    *,
    strategy: str = "optim_grads_params",
    fp8: FP8Recipe | None = None,
) -> tuple[nn.Module, torch.optim.Optimizer | None]:
    """Wrap a Megatron-Core model in Megatron-Core's ``FullyShardedDataParallel``; rebind the optimizer.

    The model is built after :func:`init_parallel_state` (its TP layers read the parallel
    state). Fused QKV and SwiGLU ``linear_fc1`` are registered for checkpoints. The optimizer
    (any torch optimizer over ``model.parameters()``, any param groups) is rebound, group by
    group, to the distributed parameters and given Megatron-FSDP's ``step``/``zero_grad``.
    See [Note: the Megatron-Core path].

    Args:
        model: a Megatron-Core ``GPTModel`` (or any ``MegatronModule`` built from TransformerLayers).
        optimizer: its optimizer, or None.
        config: the model's ``TransformerConfig``.
        policy: precision; None = fp32 everywhere.
        strategy: Megatron-FSDP sharding (``no_shard`` ... ``optim_grads_params``).
        fp8: the run's FP8 recipe; it must agree with the TransformerConfig Megatron-Core built
            the model from (see [Note: FP8 on the Megatron-Core path]). None = no FP8.

    Returns:
        ``(wrapped model, optimizer)``: call the wrapped model like the original; train with
        ``loss.backward(); optimizer.step(); optimizer.zero_grad()``.

    A strategy that megatron-core 0.16.1 reduces wrong for the run's data-parallel group sizes
    (``optim_grads*`` with one rank, ``optim`` / ``no_shard`` with several; see [Note:
    Megatron-Core 0.16.1 gradient reduction]) still wraps, loads and saves, but the returned
    optimizer's ``step()`` raises NotImplementedError naming the group.

    Raises:
        ValueError: an unknown strategy, a CUDA-only kernel selected on a CPU host, or a
            TransformerConfig whose FP8 fields disagree with ``fp8``.
        NotImplementedError: a policy Megatron-Core 0.16.1 cannot express, or an FP8 recipe on
            CPU or of torchao (see [Note: FP8 on the Megatron-Core path]).

    Example:
        >>> dims = init_parallel_state(ParallelDims(dp_shard=-1, tp=2))  # doctest: +SKIP
        >>> model = GPTModel(config=cfg, ...)                             # doctest: +SKIP
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)          # doctest: +SKIP
        >>> model, opt = shard_model(model, opt, cfg)                     # doctest: +SKIP
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} must be one of {STRATEGIES}")
    check_cpu_config(config)
    policy = policy or PrecisionPolicy()
    model_dtype = next(model.parameters()).dtype
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    ddp_config = _ddp_config(policy, strategy, model_dtype, fp8_fields(fp8, config, device_type=device_type))
    group_fqns = None if optimizer is None else param_group_fqns(model, optimizer, when="shard_model")
    register_gpt_fused(model, config)
    experts = register_gpt_experts(model)

    _cpu_patch.install(_cpu_patch.MEGATRON_CORE, pin=True)
    fix_missing_te_linear()
    from megatron.core.distributed import FullyShardedDataParallel

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    wrapped = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model, device=device)
    inner = wrapped.module
    if dist.get_backend() == "gloo":
        disable_grad_div_fusion(inner)  # gloo has no PREMUL_SUM
    install_distributed_params(inner)
    if optimizer is None:
        return wrapped, None
    params = dict(optimizer_named_parameters(inner))
    rebind_param_groups(optimizer, group_fqns, params)
    # Our checkpoints go through MegatronFSDPStateDicts, not upstream's state-dict post-hook.
    bundled_fsdp().fully_shard_optimizer(optimizer, preproc_state_dict_for_dcp_ckpt=False)
    _init_optimizer_state(optimizer)
    problem = gradient_reduction_problem(strategy, _dp_groups(bool(experts)))
    if problem is not None:  # See [Note: Megatron-Core 0.16.1 gradient reduction]
        _refuse_steps(optimizer, problem)
    return wrapped, optimizer


def _dp_groups(has_experts: bool) -> dict[str, int]:
    """Name -> size of the data-parallel groups Megatron-FSDP reduces gradients over."""
    from megatron.core import parallel_state

    groups = {"dense data-parallel group (dp_shard x cp)": parallel_state.get_data_parallel_world_size(True)}
    if has_experts:
        groups["expert data-parallel group (efsdp)"] = parallel_state.get_expert_data_parallel_world_size()
    return groups


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's states now, as a fresh optimizer's (so a checkpoint can load into them).

    One base ``step()`` on zero gradients, made neutral by ``_optimizer.zero_step`` (SGD's momentum
    buffer and Adam's moments stay zero, which is what the first real step computes from).
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]

    def step() -> None:
        for p in params:
            p.grad = torch.zeros_like(p)
        type(optimizer).step(optimizer)
        for p in params:
            p.grad = None

    zero_step(optimizer, step)
