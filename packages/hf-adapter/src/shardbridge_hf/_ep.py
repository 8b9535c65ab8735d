"""transformers' expert-parallel plan (``base_model_ep_plan``) on the core ``ep`` axis.

[Note: HF EP plan on the shardbridge mesh]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.21+ gives MoE models a second plan beside the TP plan, e.g. Qwen3-MoE's::

    layers.*.mlp.experts.gate_up_proj   grouped_gemm          [E, 2I, D] split on dim 0 (experts)
    layers.*.mlp.experts.down_proj      grouped_gemm
    layers.*.mlp.experts                ep_dispatch_experts   tokens to the experts' ranks and back

which transformers applies only inside ``from_pretrained(distributed_config=DistributedConfig(
ep_size=...))``. Here the same plan runs on the core mesh, with ``fsdp_config.shardbridge.ep_size``
(``ParallelDims.ep``)::

    HF EP style            what it becomes
    grouped_gemm           the parameter is Shard(0) on pm["ep"], then FSDP2 over pm["efsdp"]
                           (shardbridge.ep.shard_experts; every parameter of the experts module must
                           be planned so: each must split by expert)
    ep_dispatch_experts    the module's forward goes through shardbridge.ep.run_experts: tokens split
                           over tp, dispatched over ep (all-to-all or all-gather), the module's own
                           forward runs this rank's experts (its local expert ids, unit weights),
                           outputs weighted, summed, gathered over tp
    colwise / rowwise ...  on a dense module (Gemma 4's plan names its dense MLP): dense modules stay
                           on the dense mesh, planned by the TP plan; the entry is dropped

As in transformers, EP rules take precedence: the TP plan's rules on an EP-planned module and its
parameters (``moe_tp_experts``, ``packed_colwise`` ...) are dropped when ep > 1, and everything
else (attention, router, shared experts, embeddings) stays as the TP plan and FSDP2 put it. The
experts' own forward is transformers' (any ``experts_implementation``), handed local tensors.
Checkpoints store the expert tensors in global coordinates ([Note: expert checkpoints] in the
core), so an EP run's checkpoint loads into a TP-plan run and back.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from shardbridge.ep import run_experts, shard_experts
from shardbridge.tp import local_view
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from shardbridge import ParallelDims, ParallelMesh, PrecisionPolicy

__all__ = ["EP_STYLES", "apply_ep", "check_ep_divides", "resolve_ep_plan", "without_experts"]

#: The expert-parallel styles of transformers' ``ParallelInterface`` this adapter runs on ``ep``.
EP_STYLES: tuple[str, ...] = ("grouped_gemm", "ep_dispatch_experts")

# TP styles an EP plan may name for a dense module (Gemma 4): dropped, the TP plan places it.
_DENSE_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "packed_colwise")


def resolve_ep_plan(model: nn.Module, plan: str | Mapping[str, str] = "auto") -> dict[str, tuple[str, ...]]:
    """The experts modules of ``model`` and the parameters its EP plan splits: ``{module FQN: names}``.

    Args:
        model: a transformers MoE model.
        plan: "auto" = ``model.ep_plan`` (``base_model_ep_plan`` + the class's ``_ep_plan``); or
            ``{pattern: style}``, patterns as in the TP plan (``*`` for one FQN component).

    Raises:
        ValueError: no EP plan; a pattern matching nothing (explicit plans); an experts module whose
            parameters are not all ``grouped_gemm``; a ``grouped_gemm`` parameter outside an
            ``ep_dispatch_experts`` module; experts of different sizes in one module.
        NotImplementedError: a style that is neither an EP style nor a dense TP style.

    Example:
        >>> resolve_ep_plan(qwen3_moe)["model.layers.0.mlp.experts"]  # doctest: +SKIP
        ('gate_up_proj', 'down_proj')
    """
    auto = isinstance(plan, str)
    if auto:
        if plan != "auto":
            raise ValueError(f"ep_plan={plan!r}: use 'auto' or a mapping {{pattern: style}}")
        plan = dict(getattr(model, "ep_plan", None) or {})
        if not plan:
            raise ValueError(
                f"{type(model).__name__} declares no expert-parallel plan (model.ep_plan is empty; transformers "
                ">= 5.21 gives MoE models base_model_ep_plan); set fsdp_config.shardbridge.ep_plan "
                "{'<experts module pattern>': 'ep_dispatch_experts', '<pattern>.<param>': 'grouped_gemm', ...}, "
                "or ep_size: 1 (the TP plan then shards the experts over tp)"
            )
    names = [n for n, _ in model.named_modules() if n] + [n for n, _ in model.named_parameters()]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in EP_STYLES and style not in _DENSE_STYLES:
            raise NotImplementedError(
                f"EP style {style!r} (for {pattern!r}) is not supported; an expert-parallel plan takes "
                f"{list(EP_STYLES)} (and TP styles on dense modules, which the TP plan places)"
            )
        regex = re.compile("^" + r"[^.]+".join(re.escape(p) for p in pattern.split("*")) + "$")
        matched = [n for n in names if regex.match(n)]
        if not matched and not auto:
            raise ValueError(
                f"ep_plan pattern {pattern!r} matches no module or parameter of {type(model).__name__}; patterns "
                "are FQNs relative to the top model, e.g. 'model.layers.*.mlp.experts'"
            )
        for name in matched:
            if style in EP_STYLES:
                resolved[name] = style
    modules = {n for n, s in resolved.items() if s == "ep_dispatch_experts"}
    out: dict[str, tuple[str, ...]] = {}
    for fqn in sorted(modules):
        module = model.get_submodule(fqn)
        own = [n for n, _ in module.named_parameters(recurse=False)]
        unplanned = [n for n in own if resolved.get(f"{fqn}.{n}") != "grouped_gemm"]
        if unplanned or not own:
            raise ValueError(
                f"ep_plan: {fqn} ({type(module).__name__}) is 'ep_dispatch_experts' but its parameter(s) "
                f"{unplanned or own} are not 'grouped_gemm': every parameter of an experts module must split by "
                "expert (dim 0); add them to the plan"
            )
        sizes = {n: p.shape[0] for n, p in module.named_parameters(recurse=False)}
        if len(set(sizes.values())) != 1:
            raise ValueError(f"ep_plan: {fqn}'s parameters hold different numbers of experts (dim 0): {sizes}")
        out[fqn] = tuple(own)
    orphans = [n for n, s in resolved.items() if s == "grouped_gemm" and n.rpartition(".")[0] not in modules]
    if orphans:
        raise ValueError(
            f"ep_plan splits {orphans[:3]} by expert ('grouped_gemm') outside an 'ep_dispatch_experts' module; "
            "shardbridge moves tokens to the experts (transformers' all_reduce masking on shared batches is not "
            "built): plan the owning experts module 'ep_dispatch_experts'"
        )
    return out


def check_ep_divides(model: nn.Module, experts: Mapping[str, tuple[str, ...]], dims: ParallelDims) -> None:
    """ValueError, naming ``fsdp_config.shardbridge.ep_size`` and the sizes that fit, unless ep divides every experts module.

    Each ep rank holds the same number of whole experts: ``ep`` must divide ``num_experts`` (and,
    as always, ``dp_shard * cp * tp``, which ``ParallelDims`` checks).
    """
    ranks = dims.dp_shard * dims.cp * dims.tp
    for fqn in experts:
        num_experts = int(next(model.get_submodule(fqn).parameters()).shape[0])
        if num_experts % dims.ep:
            fits = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and ranks % d == 0]
            raise ValueError(
                f"fsdp_config.shardbridge.ep_size={dims.ep} (ParallelDims.ep) does not divide the {num_experts} experts "
                f"of {fqn}: every ep rank holds the same number of whole experts; set ep_size to one of {fits} "
                f"(the divisors of {num_experts} that also divide dp_shard * cp * tp = {ranks})"
            )


def without_experts(tp_plan: Mapping[str, Any], experts: Mapping[str, Any]) -> dict[str, Any]:
    """``tp_plan`` minus its rules on the experts modules and their parameters (EP rules take precedence)."""
    return {
        name: style
        for name, style in tp_plan.items()
        if not any(name == fqn or name.startswith(fqn + ".") for fqn in experts)
    }


def apply_ep(
    model: nn.Module,
    pm: ParallelMesh,
    experts: Mapping[str, tuple[str, ...]],
    policy: PrecisionPolicy | None,
    *,
    dispatch: str = "auto",
) -> None:
    """Split each experts module over ``pm["ep"]`` (FSDP2 over ``efsdp``) and route its tokens there.

    Call after TP and before the dense FSDP units; see [Note: HF EP plan on the shardbridge mesh].
    """
    for fqn, params in experts.items():
        module = model.get_submodule(fqn)
        num_experts = int(next(module.parameters()).shape[0])
        shard_experts(module, pm, policy, params=params)
        _route_through_ep(module, pm, num_experts, dispatch)


def _route_through_ep(module: nn.Module, pm: ParallelMesh, num_experts: int, dispatch: str) -> None:
    """Replace ``module.forward(hidden_states, top_k_index, top_k_weights)`` by the EP dispatch."""
    experts_forward = module.forward  # transformers' own (with its experts_implementation dispatch)
    local = num_experts // pm.dims.ep
    # transformers' experts one-hot over num_experts (+ a sentinel): this rank's experts only.
    module.num_experts = local

    def run_local(rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        ids = torch.repeat_interleave(
            torch.arange(local, device=rows.device), torch.tensor(counts, device=rows.device)
        ).unsqueeze(-1)
        ones = rows.new_ones((rows.shape[0], 1))
        with _local_params(module):
            if rows.shape[0] == 0:
                # No rows here: run one zero row through expert 0 and keep none of it, so every rank's
                # experts get a gradient (FSDP2 reduce-scatters the same parameters everywhere). The
                # row is the sum of the empty rows (zeros), not a new tensor: it keeps the output
                # connected to the received rows, so autograd reaches this rank's side of the
                # backward exchange (all-to-all / reduce-scatter) that the other ranks wait in.
                zero_row = rows.sum(dim=0, keepdim=True)
                return experts_forward(zero_row, ids.new_zeros((1, 1)), ones.new_ones((1, 1)))[:0]
            return experts_forward(rows, ids, ones)

    def forward(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = run_experts(
            hidden_states, top_k_index, top_k_weights, run_local, num_experts=num_experts, mesh=pm, dispatch=dispatch
        )
        return out.to(hidden_states.dtype)

    module.forward = forward


@contextlib.contextmanager
def _local_params(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as local tensors for its own forward (gradients flow back as DTensors)."""
    originals = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
    module._parameters.update({n: local_view(p) for n, p in originals.items()})
    try:
        yield
    finally:
        module._parameters.update(originals)
