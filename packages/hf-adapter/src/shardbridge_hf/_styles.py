"""The transformers TP styles torch has no ready-made style for, and the partial-gradient rule.

The rule decides, from the data flow, which replicated parameters' gradients are partial over tp.

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

``replicated_with_grad_allreduce`` (:class:`ReplicatedGradParallel`, below): Replicate parameters whose
gradient is all-reduced over tp exactly when the data flow makes it partial ([Note: partial
gradients over tp]); transformers all-reduces it always, which doubles it at tp=2 where the
input is replicated (DeepSeek-V2's ``kv_a_layernorm`` without q-LoRA).

"Local params" = for the duration of the module's forward its DTensor parameters are swapped
for ``to_local()`` views (differentiable: the gradient comes back as a DTensor with the same
placements), as transformers' ``_use_local_dtensor_params`` does; the original objects are put
back afterwards, so FSDP2's unsharded parameters stay the ones it manages.

[Note: partial gradients over tp]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A parameter replicated over the ``tp`` axis (a norm, a learnable activation, a small Linear the
plan leaves alone) must end the backward with the SAME gradient on every tp rank, the one a
single process computes. Its per-rank gradient is *partial* -- this rank's share of the sum, to
be all-reduced -- exactly when its values mix with rank-local data on the way to the loss, and
no collective of the plan sums that gradient first::

    Qwen3 q_norm            q_proj (colwise, local heads) -> q_norm -> attention -> o_proj
                            input local: dW partial                          -> all-reduce dW
    DeepSeek-V2 (no q-LoRA) kv_a_proj (replicated) -> kv_a_layernorm -> kv_b_proj (colwise)
      kv_a_layernorm        input replicated, output into a colwise layer whose input gradient
                            torch already all-reduces: dW complete           -> leave dW alone
    dots3 k_rope_only_...   kv_a_proj's rope part -> norm -> attention on local heads
                            input replicated, output mixed with local heads  -> all-reduce dW

Module names and neighbours do not decide this (the MLA rows differ only in data flow), so the
rule reads the data flow of the actual forward: the autograd graph. Each such parameter runs
its forward as a local view through :class:`_ReplicatedGrad` (identity forward; backward
all-reduces over tp iff its cell says "partial"). After the first forward with autograd of the
block holding them (the parent of the planned layers, e.g. ``self_attn``), the block's graph
between its inputs and outputs is walked once and every cell decided:

- *local* (rank-dependent values): the output of a DTensor -> local boundary
  (``to_local``) whose placements are not all ``Replicate`` (a colwise layer's local heads, a
  sharded parameter's local view), and every op with a local input; ``Replicate`` boundaries
  (a rowwise layer's all-reduced output) and the block's inputs are not local (every colwise
  layer of the block takes them as ``Replicate``).
- *partial gradient* of a tensor: some consumer of it is a local op, or (transitively) has a
  partial gradient itself -- except consumers that sum the gradient over tp on the way back:
  a local -> DTensor boundary with ``Replicate`` placements (a colwise layer's input: its
  backward all-reduces) and the adapter's own gradient all-reduces (``_AllReduceBackward``,
  e.g. ``mla_kv_a_proj``'s rope part). A ``Shard`` local -> DTensor boundary counts as local.

The walk is per node (an op), not per element: a tensor split into a part that reaches local
data and a part that does not counts as reaching it. The blocks' inputs are assumed replicated
over tp (no sequence parallelism between blocks: no transformers 5.24 plan uses it). The
architecture sweep (``packages/hf-adapter/tests/hf_sweep.py``) checks every parameter's
gradient against one process on every architecture with a TP plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from shardbridge._compat import dtensor_boundary
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = [
    "AllReduceOutput",
    "GRAD_SUMMED_ATTR",
    "GradCell",
    "LocalParamsForward",
    "MlaKvAProjParallel",
    "MoeExpertsParallel",
    "MoeIdentityParallel",
    "OUTPUT_SUMMED_ATTR",
    "PackedColwiseParallel",
    "ParamPlacement",
    "ReplicatedGradParallel",
    "RowwiseOwnOutput",
    "decide",
    "distribute_param",
    "install_decider",
]

# Attributes the adapter's own autograd Functions set on their ctx (= their graph node), read by the walk.
_CELL_ATTR = "sb_grad_cell"  # _ReplicatedGrad: the parameter's decision
GRAD_SUMMED_ATTR = "sb_grad_summed"
"""Set on a node whose backward all-reduces its input gradient over tp (it stops partial-ness)."""
OUTPUT_SUMMED_ATTR = "sb_output_summed"
"""Set on a node whose forward all-reduces its output over tp (the output is not local)."""


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


# -- replicated_with_grad_allreduce: the data-flow rule ([Note: partial gradients over tp]) --------


class GradCell:
    """One replicated parameter's decision: ``partial`` is None until its block's graph was read."""

    __slots__ = ("name", "partial")

    def __init__(self, name: str) -> None:
        self.name = name
        self.partial: bool | None = None


class _ReplicatedGrad(torch.autograd.Function):
    """Identity forward of a replicated parameter's local view; backward sums it over tp iff partial."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cell: GradCell, group: Any) -> torch.Tensor:
        ctx.group = group
        setattr(ctx, _CELL_ATTR, cell)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        cell: GradCell = getattr(ctx, _CELL_ATTR)
        if cell.partial is None:
            raise RuntimeError(
                f"shardbridge_hf: the tp gradient rule for {cell.name} was never decided (its block's forward "
                "ran without autograd, then a backward reached it); see [Note: partial gradients over tp]"
            )
        if cell.partial:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        return grad, None, None


class ReplicatedGradParallel(ParallelStyle):
    """Replicated parameters of a module (recursively) whose tp gradient rule the data flow decides.

    Installed by ``apply_tp`` for ``replicated_with_grad_allreduce`` (transformers' name: "all-reduce
    the gradient"; here: all-reduce it iff it is partial, [Note: partial gradients over tp]).
    The parameters become ``Replicate`` DTensors on the tp mesh (FSDP2, clipping and checkpoints
    see ordinary parameters); during the module's forward they are local views through
    :class:`_ReplicatedGrad`, and the forward itself runs on plain local tensors.
    """

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn
        self.cells: list[GradCell] = []
        """One per parameter, filled by ``_apply``; :func:`install_decider` on the block decides them."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        from shardbridge_hf._styles import distribute_param

        owners = [
            (f"{self.fqn}.{prefix}" if prefix else self.fqn, sub)
            for prefix, sub in module.named_modules()
            if any(p is not None for p in sub._parameters.values())
        ]
        if not owners:
            return module  # weightless (Gemma 3n's v_norm): nothing to reduce, runs as it is
        cells: dict[tuple[int, str], GradCell] = {}
        for fqn, sub in owners:
            for name in [n for n, p in sub._parameters.items() if p is not None]:
                distribute_param(sub, name, Replicate(), device_mesh, self.src_data_rank)
                cells[(id(sub), name)] = GradCell(f"{fqn}.{name}")
        self.cells = list(cells.values())
        group = device_mesh.get_group()
        saved: list[tuple[nn.Module, str, Any]] = []

        def pre(mod: nn.Module, args: Any) -> None:
            for _, sub in owners:
                for name, p in list(sub._parameters.items()):
                    if isinstance(p, DTensor):
                        saved.append((sub, name, p))
                        sub._parameters[name] = _ReplicatedGrad.apply(p.to_local(), cells[(id(sub), name)], group)

        def post(mod: nn.Module, args: Any, output: Any) -> Any:
            while saved:
                sub, name, p = saved.pop()
                sub._parameters[name] = p
            return output

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)
        return module


def install_decider(block: nn.Module, cells: Iterable[GradCell]) -> None:
    """Decide ``cells`` from ``block``'s autograd graph after its forwards with autograd.

    The walk runs after each such forward until every cell is decided, or until a forward
    decided none that were left: a parameter off every differentiable path to the block's
    outputs (DeepSeek's DSA indexer behind a top-k) never gets a gradient from it. Should a later
    backward reach an undecided cell, its backward raises instead of guessing.
    """
    pending = {id(c): c for c in cells}
    inputs: list[Any] = []

    def pre(mod: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        inputs[:] = _grad_fns((args, kwargs)) if pending and torch.is_grad_enabled() else []

    def post(mod: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        if not pending or not torch.is_grad_enabled():
            return
        roots = _grad_fns(output)
        if not roots:
            return
        decided = [cell_id for cell_id in decide(roots, stops=inputs) if cell_id in pending]
        for cell_id in decided:
            pending.pop(cell_id)
        if not decided:
            pending.clear()  # the rest are off this block's differentiable paths

    block.register_forward_pre_hook(pre, with_kwargs=True)
    block.register_forward_hook(post, with_kwargs=True)


def _grad_fns(obj: Any) -> list[Any]:
    """The autograd nodes of every tensor in a (nested) forward input / output (ModelOutput is a dict)."""
    out: list[Any] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.grad_fn is not None:
                out.append(item.grad_fn)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return out


def decide(roots: list[Any], stops: list[Any]) -> list[int]:
    """Walk the graph from ``roots`` down to ``stops``; set every reached cell; return their ids.

    See [Note: partial gradients over tp] for the rules.
    """
    stop_ids = {id(n) for n in stops}
    consumers: dict[int, list[Any]] = {}
    order: list[Any] = []  # post-order: a node after everything it consumes
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        if id(node) in stop_ids:
            continue
        for child, _ in node.next_functions:
            if child is None:
                continue
            consumers.setdefault(id(child), []).append(node)
            if id(child) not in seen:
                stack.append((child, False))

    local: dict[int, bool] = {}
    for node in order:
        local[id(node)] = _is_local(node, stop_ids, local)
    partial: dict[int, bool] = {}
    decided: list[int] = []
    for node in reversed(order):  # consumers before what they consume
        partial[id(node)] = any(_passes_partial(c, local, partial) for c in consumers.get(id(node), ()))
        cell = getattr(node, _CELL_ATTR, None)
        if isinstance(cell, GradCell):
            cell.partial = partial[id(node)]
            decided.append(id(cell))
    return decided


def _is_local(node: Any, stop_ids: set[int], local: dict[int, bool]) -> bool:
    if id(node) in stop_ids or getattr(node, OUTPUT_SUMMED_ATTR, False):
        return False
    boundary = dtensor_boundary(node)
    if boundary is not None:
        kind, placements = boundary
        return kind == "to_local" and any(not isinstance(p, Replicate) for p in placements)
    return any(local.get(id(child), False) for child, _ in node.next_functions if child is not None)


def _passes_partial(consumer: Any, local: dict[int, bool], partial: dict[int, bool]) -> bool:
    """Does ``consumer`` hand a partial gradient back to what it consumes?"""
    if getattr(consumer, GRAD_SUMMED_ATTR, False):
        return False
    boundary = dtensor_boundary(consumer)
    if boundary is not None and boundary[0] == "from_local":
        # Replicate: the DTensor gradient is redistributed (all-reduced) to Replicate on the way back.
        return any(not isinstance(p, Replicate) for p in boundary[1])
    return local.get(id(consumer), False) or partial.get(id(consumer), False)
