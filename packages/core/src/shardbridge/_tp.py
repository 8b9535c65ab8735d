"""Local tensor-parallel shards <-> DTensor parameters.

TransformerEngine and Megatron modules hold their TP shard as a plain ``nn.Parameter``.
FSDP2 and DCP need the global view: a DTensor parameter on the TP mesh whose placement says
how the shard sits in the global tensor. This module builds those parameters (uneven-safe:
the global shape is explicit or gathered, never assumed from ``local * tp``) and hands the
framework its local tensor in forward with the gradient re-wrapped as a DTensor.

Public: :class:`TPMode`, :func:`tp_placements`, :func:`to_dtensor_param`,
:func:`local_view`, :func:`convert_module_params`, :func:`unview_tp_output`. Everything else here is private.

[Note: TP placements]
~~~~~~~~~~~~~~~~~~~~~
``nn.Linear`` stores ``weight [out, in]``::

    column parallel: out split   -> Shard(0)    rank j holds rows   chunk_j(out)
    row parallel:    in split    -> Shard(1)    rank j holds cols   chunk_j(in)
    none:            replicated  -> Replicate() every rank holds all of it

Uneven sizes follow ``torch.chunk`` (what DTensor's ``Shard`` does): 9 rows over tp=2 is
``[5, 4]``; 7 over tp=4 is ``[2, 2, 2, 1]``; 3 over tp=4 is ``[1, 1, 1, 0]``.

[Note: TP outputs are not views]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's TP styles end a module's forward with ``DTensor.to_local()``, which returns
``local.view_as(local)`` (``_ToTorchTensor``: a fresh tensor object for autograd's metadata): a
VIEW. When that module's output is also an FSDP2 unit's output (the embedding unit, the
``[norm, output]`` unit and the root, which returns the logits), FSDP2 (torch 2.13,
``_fsdp_state._register_pre_backward_hook``) warns "FSDP2-wrapped module (...) returned a view
tensor ... An in-place op on this view ... can cause backward to fail or produce wrong
gradients": 3 warnings per rank per run of README's train_core.py. Measured on the reference
Llama (dp_shard=2 x tp=2, gloo): out of place, the gradients are right; an in-place op on the
logits (``logits.mul_(2)``) raises autograd's RuntimeError ("Output 0 of _ToTorchTensor is a
view and is being modified inplace ... created inside a custom Function"). So the views were
never silently wrong, but they made every run print an alarm and refused a legal in-place op.

:func:`unview_tp_output` removes the cause: a forward hook, after the TP style's own output hook
and before FSDP2's, hands on the same storage as a tensor of its own (``_compat.unview``:
``aten._unsafe_view``, no copy). The DTensor whose local tensor it aliases is a temporary of the
TP hook that nothing else holds, so no other tensor sees the storage change. FSDP2 then sees no
view and keeps its pre-backward hook under in-place ops (a hook registered before an in-place op
still runs); ``test_models.py::test_reference_train_step_warns_nothing_and_allows_in_place_logits``
checks both, the gradients against an out-of-place run.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from shardbridge._checks import checked_args
from shardbridge._compat import dtensor_to_local, unview

__all__ = [
    "TPMode",
    "check_tp_divides",
    "convert_module_params",
    "local_view",
    "to_dtensor_param",
    "tp_placements",
    "unview_tp_output",
]


class TPMode(str, enum.Enum):
    """How a parameter is split over the TP mesh. See [Note: TP placements].

    ``"replicated"`` and ``"replicate"`` are accepted as aliases of ``"none"``.

    Example:
        >>> TPMode("column"), TPMode("replicated")
        (<TPMode.COLUMN: 'column'>, <TPMode.NONE: 'none'>)
    """

    COLUMN = "column"
    """Output features split: ``Shard(0)``."""
    ROW = "row"
    """Input features split: ``Shard(1)``."""
    NONE = "none"
    """Not split: ``Replicate()``."""

    @classmethod
    def _missing_(cls, value: object) -> TPMode | None:
        if isinstance(value, str) and value.lower() in ("replicated", "replicate"):
            return cls.NONE
        if isinstance(value, str) and value.lower() != value:
            return cls(value.lower())
        return None


def _mode(mode: TPMode | str) -> TPMode:
    try:
        return TPMode(mode)
    except ValueError:
        raise ValueError(f"TP mode {mode!r} is not one of {[m.value for m in TPMode]} (or 'replicated')") from None


def tp_placements(mode: TPMode | str) -> tuple[Placement]:
    """The DTensor placements on a 1-D TP mesh for ``mode``.

    Example:
        >>> tp_placements("row")
        (Shard(dim=1),)
    """
    mode = _mode(mode)
    if mode is TPMode.COLUMN:
        return (Shard(0),)
    if mode is TPMode.ROW:
        return (Shard(1),)
    return (Replicate(),)


def _chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """Sizes of ``torch.chunk(tensor_of(size), num_chunks)`` padded with zeros to num_chunks."""
    chunk = -(-size // num_chunks)
    return [max(0, min(chunk, size - i * chunk)) for i in range(num_chunks)]


def _gather_local_shapes(local: torch.Tensor, tp_mesh: DeviceMesh) -> list[tuple[int, ...]]:
    """All-gather every TP rank's local shape (a collective over tp_mesh)."""
    mine = torch.tensor(list(local.shape), dtype=torch.int64, device=tp_mesh.device_type)
    gathered = [torch.empty_like(mine) for _ in range(tp_mesh.size())]
    dist.all_gather(gathered, mine, group=tp_mesh.get_group())
    return [tuple(int(x) for x in t.tolist()) for t in gathered]


def _check_local_shape(
    local_shape: torch.Size, global_shape: torch.Size, placement: Placement, tp_size: int, tp_rank: int
) -> None:
    expected = list(global_shape)
    if isinstance(placement, Shard):
        expected[placement.dim] = _chunk_sizes(global_shape[placement.dim], tp_size)[tp_rank]
    if tuple(local_shape) != tuple(expected):
        if isinstance(placement, Shard):
            d = placement.dim
            fix = (
                f"the TP shard along dim {d} must follow torch.chunk: sizes "
                f"{_chunk_sizes(global_shape[d], tp_size)} for {global_shape[d]} over tp={tp_size}; "
                "pass the right global_shape, or re-split the full tensor with torch.chunk"
            )
        else:
            fix = "a replicated parameter's local shape is its global shape"
        raise ValueError(
            f"local parameter shape {tuple(local_shape)} on tp rank {tp_rank} does not match global shape "
            f"{tuple(global_shape)} with placement {placement!r} over tp={tp_size} (expected "
            f"{tuple(expected)}); {fix}"
        )


@checked_args(local=torch.Tensor, tp_mesh=DeviceMesh)
def to_dtensor_param(
    local: torch.Tensor,
    tp_mesh: DeviceMesh,
    mode: TPMode | str,
    *,
    global_shape: Sequence[int] | None = None,
    requires_grad: bool | None = None,
) -> nn.Parameter:
    """Wrap this rank's local TP shard as a DTensor ``nn.Parameter`` on ``tp_mesh``.

    The parameter shares storage with ``local``, has the placements of
    :func:`tp_placements`, an explicit global shape and a contiguous global stride. Python
    attributes of ``local`` (e.g. ``_shardbridge_*``, Megatron's ``tensor_model_parallel``)
    are copied onto the new parameter.

    Args:
        local: this rank's shard, split along the mode's dim as ``torch.chunk`` splits it.
        tp_mesh: the 1-D TP mesh.
        mode: ``"column"``, ``"row"`` or ``"none"`` (see :class:`TPMode`).
        global_shape: the full shape. None = infer it by ALL-GATHERING the local shapes over
            ``tp_mesh``: a collective, so every TP rank must convert the same parameters in
            the same order. Pass it when known (it is also cheaper).
        requires_grad: None = ``local.requires_grad``.

    Raises:
        ValueError: ``local``'s shape is not this rank's ``torch.chunk`` piece of
            ``global_shape``, or the mode does not fit the tensor (row mode on a 1-D tensor).

    Example:
        >>> # rank j of tp=2 holds rows chunk_j of a [9, 4] weight: [5, 4] or [4, 4]
        >>> # w = to_dtensor_param(linear.weight, tp_mesh, "column", global_shape=(9, 4))
        >>> # w.full_tensor().shape == (9, 4)
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"tp_mesh must be 1-D, got a {tp_mesh.ndim}-D mesh {tp_mesh}; pass mesh['tp']")
    (placement,) = tp_placements(mode)
    if isinstance(placement, Shard) and placement.dim >= local.dim():
        raise ValueError(
            f"TP mode {_mode(mode).value!r} shards dim {placement.dim}, but the parameter has shape "
            f"{tuple(local.shape)}; use 'none' (Replicate) for a row-parallel bias or 1-D param"
        )
    tp_size, tp_rank = tp_mesh.size(), tp_mesh.get_local_rank()
    if global_shape is None:
        if isinstance(placement, Shard):
            shapes = _gather_local_shapes(local, tp_mesh)
            d = placement.dim
            inferred = list(local.shape)
            inferred[d] = sum(s[d] for s in shapes)
            global_shape = torch.Size(inferred)
            other = {s[:d] + s[d + 1 :] for s in shapes}
            if len(other) != 1:
                raise ValueError(
                    f"TP ranks hold local shapes {shapes} that differ outside the sharded dim {d}; "
                    "every rank must hold a torch.chunk piece of the same global tensor"
                )
        else:
            global_shape = local.shape
    global_shape = torch.Size(global_shape)
    _check_local_shape(local.shape, global_shape, placement, tp_size, tp_rank)

    if requires_grad is None:
        requires_grad = local.requires_grad
    stride = torch.empty(global_shape, device="meta").stride()
    # local shard -> DTensor with `placement` on tp (no data movement)
    dtensor = DTensor.from_local(
        local.detach(), tp_mesh, [placement], run_check=False, shape=global_shape, stride=stride
    )
    param = nn.Parameter(dtensor, requires_grad=requires_grad)
    for key, value in vars(local).items():
        if key != "_is_param":
            setattr(param, key, value)
    return param


def local_view(param: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor parameter for a framework's forward.

    The result keeps ``requires_grad``; its gradient flows back to ``param`` as a DTensor
    gradient with ``param``'s placements (the local gradient is this rank's shard of the
    global gradient). Plain tensors are returned unchanged.

    Example:
        >>> # inside a TE/Megatron forward, with self.weight a DTensor parameter:
        >>> # out = torch.nn.functional.linear(x, local_view(self.weight))
    """
    if isinstance(param, DTensor):
        # DTensor -> local tensor; grad: local -> DTensor with param.placements
        return dtensor_to_local(param, param.placements)  # torch 2.11 needs the workaround
    return param


@checked_args(module=nn.Module)
def unview_tp_output(module: nn.Module) -> nn.Module:
    """Make ``module``'s TP output a tensor of its own, not a view: see [Note: TP outputs are not views].

    Call after the module's TP style is applied (``parallelize_module``) and before
    ``fully_shard`` wraps it: for the modules whose output leaves an FSDP2 unit (embeddings, the
    output projection). No copy; a plain (non-view) output passes unchanged.

    Returns:
        ``module``.

    Example:
        >>> parallelize_module(model, pm["tp"], {"tok_embeddings": RowwiseParallel()})  # doctest: +SKIP
        >>> unview_tp_output(model.tok_embeddings)  # doctest: +SKIP
    """

    def hook(_module: nn.Module, _args: Any, output: Any) -> Any:
        return unview(output) if isinstance(output, torch.Tensor) else output

    module.register_forward_hook(hook)
    return module


@checked_args(module=nn.Module, tp_mesh=DeviceMesh)
def convert_module_params(
    module: nn.Module,
    tp_mesh: DeviceMesh,
    modes: Mapping[str, TPMode | str],
    global_shapes: Mapping[str, Sequence[int]] | None = None,
) -> nn.Module:
    """Replace named local-shard parameters of ``module`` with DTensor parameters, in place.

    Names are relative to ``module`` and may be dotted (``"fc1.weight"``). Each parameter
    goes through :func:`to_dtensor_param`, keeping ``requires_grad`` and its Python
    attributes. Without a global shape for a sharded parameter the conversion all-gathers
    local shapes: every TP rank must pass the same ``modes`` in the same order.

    Returns:
        ``module``.

    Example:
        >>> # convert_module_params(te_linear, mesh["tp"], {"weight": "column", "bias": "column"},
        >>> #                       global_shapes={"weight": (9, 4), "bias": (9,)})
    """
    global_shapes = dict(global_shapes or {})
    unknown = set(global_shapes) - set(modes)
    if unknown:
        raise ValueError(f"global_shapes names {sorted(unknown)} are not in modes {list(modes)}; give a mode for each")
    for name, mode in modes.items():
        owner_name, _, param_name = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        local = owner._parameters.get(param_name)
        if local is None:
            raise ValueError(
                f"{type(module).__name__} has no parameter {name!r}; its parameters are "
                f"{[n for n, _ in module.named_parameters()]}"
            )
        if isinstance(local, DTensor):
            raise ValueError(f"parameter {name!r} is already a DTensor ({local.placements}); convert it once")
        new = to_dtensor_param(local, tp_mesh, mode, global_shape=global_shapes.get(name))
        setattr(owner, param_name, new)
    return module


def check_tp_divides(sizes: Mapping[str, int | None], tp: int, *, owner: str = "", fix: str = "") -> None:
    """ValueError naming the first of ``sizes`` that ``tp`` does not divide (None = absent).

    The one TP divisibility rule of every adapter and model: tensor parallelism splits whole
    attention heads and whole MLP rows, so each named size must be a multiple of ``tp``.

    Args:
        sizes: config field name -> size, checked in order.
        tp: the TP degree (1 checks nothing).
        owner: prefix for the field names in the message, e.g. ``"LlamaConfig."``.
        fix: what the user should change, appended to the message; default: choose a tp
            dividing the field.

    Example:
        >>> check_tp_divides({"num_kv_heads": 4, "intermediate_size": 96}, 2)
        >>> check_tp_divides({"num_kv_heads": 4}, 3, owner="LlamaConfig.")
        Traceback (most recent call last):
        ...
        ValueError: LlamaConfig.num_kv_heads(4) is not divisible by tp(3); tensor parallelism splits whole heads and MLP rows: choose tp dividing num_kv_heads (tp values that divide num_kv_heads: [1, 2, 4])
    """
    if tp == 1:
        return
    given = {name: value for name, value in sizes.items() if value is not None}
    for name, value in given.items():
        if value % tp:
            common = math.gcd(*given.values())
            valid = [d for d in range(1, common + 1) if common % d == 0]
            raise ValueError(
                f"{owner}{name}({value}) is not divisible by tp({tp}); tensor parallelism splits whole heads and "
                f"MLP rows: {fix or f'choose tp dividing {name}'} (tp values that divide {', '.join(given)}: {valid})"
            )
