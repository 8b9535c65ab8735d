"""torch ``ParallelStyle``s for the transformers TP styles torch has no ready-made style for.

[Note: HF styles beyond colwise / rowwise]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every style makes its parameters DTensors on the ``tp`` mesh (so FSDP2 composes, the core
checkpoint reshards them, clipping sees one parameter), and changes only what the forward
must see::

    HF style                        parameters (tp mesh)             forward
    sequence_parallel               Replicate                        torch SequenceParallel, local output
    packed_colwise                  _StridedShard(out dim, sf=2)     local params; input grad all-reduced
    packed_rowwise                  _StridedShard(-1, sf=2)          (a parameter style, used under moe_tp_experts)
    moe_tp_experts                  (its parameters' own entries)    local params; input and routing-weight
                                                                     grads all-reduced; output all-reduced
    local_params                    (its parameters' own entries)    forward with local params
    all_reduce                      (its parameters' own entries)    local params; input grads all-reduced;
                                                                     output Partial -> Replicate (all-reduce)
    mla_kv_a_proj                   -                                rope part of the output: grad all-reduced
    moe_identity_expert             -                                input / tp (moe_tp_experts sums it tp times)

``replicated_with_grad_allreduce`` (``shardbridge_hf._partial``): Replicate parameters whose
gradient is all-reduced over tp exactly when the data flow makes it partial ([Note: partial
gradients over tp]); transformers all-reduces it always, which doubles it at tp=2 where the
input is replicated (DeepSeek-V2's ``kv_a_layernorm`` without q-LoRA).

"Local params" = for the duration of the module's forward its DTensor parameters are swapped
for ``to_local()`` views (differentiable: the gradient comes back as a DTensor with the same
placements), as transformers' ``_use_local_dtensor_params`` does; the original objects are put
back afterwards, so FSDP2's unsharded parameters stay the ones it manages.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Placement, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

from shardbridge_hf._partial import GRAD_SUMMED_ATTR, OUTPUT_SUMMED_ATTR

__all__ = [
    "AllReduceOutput",
    "LocalParamsForward",
    "MlaKvAProjParallel",
    "MoeExpertsParallel",
    "MoeIdentityParallel",
    "PackedColwiseParallel",
    "ParamPlacement",
    "RowwiseOwnOutput",
    "distribute_param",
]


def distribute_param(module: nn.Module, name: str, placement: Placement, mesh: Any, src_data_rank: int | None) -> None:
    """Replace ``module.<name>`` by a DTensor parameter with ``placement`` on the 1-D ``mesh`` (in place)."""
    param = module._parameters[name]
    if param is None or isinstance(param, DTensor):
        return
    dt = distribute_tensor(param.data, mesh, [placement], src_data_rank=src_data_rank)
    module._parameters[name] = nn.Parameter(dt, requires_grad=param.requires_grad)


def packed_placement(ndim: int, dim: int) -> Placement:
    """``[gate; up]`` packed along ``dim``: each TP rank holds its slice of EACH half."""
    if ndim == 1:
        return _StridedShard(0, split_factor=2)
    return _StridedShard(dim % ndim, split_factor=2)


class ParamPlacement(ParallelStyle):
    """Give parameters of the module placements by name (no forward change).

    ``placements`` maps a parameter name (of this module, not recursive) to a placement, or
    to a callable ``ndim -> placement``; ``"*"`` is the default for every other parameter.
    """

    def __init__(self, placements: dict[str, Any]) -> None:
        super().__init__()
        self.placements = placements

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            spec = self.placements.get(name, self.placements.get("*"))
            if spec is None or param is None:
                continue
            placement = spec(param.ndim) if callable(spec) else spec
            distribute_param(module, name, placement, device_mesh, self.src_data_rank)
        return module


class RowwiseOwnOutput(RowwiseParallel):
    """torch's ``RowwiseParallel`` whose local output is its own tensor, not a view made by ``to_local()``.

    Models add into it in place (Llama 4's MoE: ``out = shared_expert(x); out.add_(routed)``),
    which autograd forbids on the view ``to_local()`` returns from a custom Function.
    """

    @staticmethod
    def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any):
        out = RowwiseParallel._prepare_output_fn(output_layouts, False, mod, outputs, device_mesh)
        return out.to_local().clone() if use_local_output else out


class _LocalParams:
    """Swap a module's DTensor parameters for differentiable local views during its forward."""

    def __init__(self) -> None:
        self.saved: dict[int, dict[str, DTensor]] = {}

    def pre(self, module: nn.Module, args: Any) -> None:
        originals = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
        for name, p in originals.items():
            module._parameters[name] = p.to_local()  # differentiable: the grad returns as a DTensor
        self.saved[id(module)] = originals

    def post(self, module: nn.Module, args: Any, output: Any) -> Any:
        module._parameters.update(self.saved.pop(id(module), {}))
        return output

    def install(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self.pre)
        module.register_forward_hook(self.post)


class LocalParamsForward(ParallelStyle):
    """``local_params``: run the module's forward with its own (sharded) parameters as local tensors."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        _LocalParams().install(module)
        return module


class _AllReduceForward(torch.autograd.Function):
    """Sum over the group in forward; identity backward (the output is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        setattr(ctx, OUTPUT_SUMMED_ATTR, True)  # replicated output: see [Note: partial gradients over tp]
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None


class _AllReduceBackward(torch.autograd.Function):
    """Identity forward; sum the (partial) gradient over the group in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        setattr(ctx, GRAD_SUMMED_ATTR, True)  # full input gradient: see [Note: partial gradients over tp]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _grad_allreduce(x: Any, group: Any) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad and torch.is_grad_enabled():
        return _AllReduceBackward.apply(x, group)
    return x


class PackedColwiseParallel(ParallelStyle):
    """``packed_colwise`` on a module (a fused ``[gate; up]`` Linear): strided rows, local forward."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            distribute_param(module, name, packed_placement(param.ndim, -2), device_mesh, self.src_data_rank)
        group = device_mesh.get_group()
        local = _LocalParams()

        def pre(mod: nn.Module, args: Any) -> Any:
            local.pre(mod, args)
            x, *rest = args
            return (_grad_allreduce(x, group), *rest)  # replicated input, partial input gradient

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(local.post)
        return module


class MoeExpertsParallel(ParallelStyle):
    """``moe_tp_experts``: every rank runs its slice of every expert; partial outputs are summed.

    Expects ``forward(hidden_states, top_k_index, top_k_weights, ...)`` (transformers' experts
    modules). The parameters get their placements from their own plan entries.
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        local = _LocalParams()

        def pre(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            local.pre(mod, args)
            args = list(args)
            if args:
                args[0] = _grad_allreduce(args[0], group)
            if len(args) >= 3:
                args[2] = _grad_allreduce(args[2], group)  # routing weights: partial gradient
            elif "top_k_weights" in kwargs:
                kwargs["top_k_weights"] = _grad_allreduce(kwargs["top_k_weights"], group)
            if "hidden_states" in kwargs:
                kwargs["hidden_states"] = _grad_allreduce(kwargs["hidden_states"], group)
            return tuple(args), kwargs

        def post(mod: nn.Module, args: Any, output: Any) -> Any:
            local.post(mod, args, output)
            return _AllReduceForward.apply(output, group)  # partial sums over the expert slices -> full

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post)
        return module


class MoeIdentityParallel(ParallelStyle):
    """``moe_identity_expert``: divide the input by tp (the experts' all-reduce sums it tp times)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        size = device_mesh.size()
        module.register_forward_pre_hook(lambda mod, args: (args[0] / size, *args[1:]))
        return module


class AllReduceOutput(ParallelStyle):
    """``all_reduce``: the module's output is a partial sum; all-reduce it (identity backward).

    Its sharded parameters (their own plan entries, e.g. Inkling's shared experts: bare 3-D
    ``colwise`` / ``rowwise`` parameters used in ``torch.bmm``) are local tensors during the
    forward, and the gradients of its (replicated) tensor inputs, partial per rank's slice,
    are all-reduced -- as under ``moe_tp_experts``.
    """

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group = device_mesh.get_group()
        local = _LocalParams()

        def pre(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
            local.pre(mod, args)
            args = tuple(_grad_allreduce(a, group) for a in args)
            return args, {k: _grad_allreduce(v, group) for k, v in kwargs.items()}

        def post(mod: nn.Module, args: Any, output: Any) -> Any:
            local.post(mod, args, output)
            return None if output is None else _AllReduceForward.apply(output, group)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post)
        return module


class MlaKvAProjParallel(ParallelStyle):
    """``mla_kv_a_proj``: the rope part of the (replicated) output bypasses the colwise ``kv_b_proj``.

    Its gradient is partial over tp (each rank's attention saw its heads only): all-reduce it.
    """

    def __init__(self, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        group, rope = device_mesh.get_group(), self.rope_dim

        def post(mod: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            passed, rot = output.split([output.shape[-1] - rope, rope], dim=-1)
            return torch.cat([passed, _grad_allreduce(rot, group)], dim=-1)

        module.register_forward_hook(post)
        return module
