"""FP8 tensors in checkpoints: what every framework's FP8 weight needs from the core.

The core does not quantize. A framework's FP8 weight is a tensor subclass (torchao's
``WeightWithDynamicFloat8CastTensor``, TransformerEngine's ``Float8Tensor``, ...) that brings its
own FSDP2 hooks (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``: 1 byte per element on the
wire). What the core adds here is the checkpoint rule, :func:`register_fp8_tensor_type` +
:func:`to_plain` (see [Note: portable FP8 checkpoints]); each backend's ``convert`` registers its
subclasses. Two more framework-neutral pieces live where they act: float8 all-gathers on gloo
(:func:`shardbridge.fp8.use_uint8_all_gather`, [Note: float8 all-gather on gloo] in
``shardbridge._wrap``), and the amax-reduction group for per-tensor current scaling, the core's
``weight`` mesh (``ParallelMesh["weight"]``: every rank holding a different piece of a weight),
which adapters hand to their framework.

[Note: portable FP8 checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
DCP pickles the class of every tensor it saves. A checkpoint of a torchao or TE FP8 model
therefore holds ``torchao...WeightWithDynamicFloat8CastTensor`` / ``transformer_engine...
Float8Tensor`` objects, and a reader without that package (or with ``weights_only``) fails
("Unsupported global"; torchtitan#651). shardbridge never saves a subclass::

    live param   DTensor(local = FP8Subclass(...))
        | to_plain: the registered function of the subclass
    saved        DTensor(local = plain tensor, high precision)   <- any torch reads it
        | load: DCP fills the plain tensor; set_state_dict copies it into the param
    live param   param.copy_(plain)   (the subclass re-quantizes, or writes its inner tensor)

A subclass that wraps a high-precision tensor (torchao) returns a VIEW of it, so DCP's in-place
load writes the live weight directly; a subclass that stores quantized bytes (TE) returns a
dequantized copy, and ``copy_`` re-quantizes it. An unregistered tensor subclass in a state
dict is an error at save time, never a checkpoint only some readers can open.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardbridge._compat import local_tensor

__all__ = [
    "is_fp8_tensor",
    "plain_state_dict",
    "register_fp8_tensor_type",
    "registered_fp8_tensor_types",
    "to_plain",
]

ToPlain = Callable[[torch.Tensor], torch.Tensor]
_TO_PLAIN: dict[type, ToPlain] = {}


def register_fp8_tensor_type(cls: type, to_plain: ToPlain) -> None:
    """Declare how a framework's FP8 tensor subclass is checkpointed.

    Args:
        cls: the tensor subclass (a parameter's local tensor, or an optimizer state, of this
            type is converted; subclasses of ``cls`` too).
        to_plain: returns a plain ``torch.Tensor`` with the high-precision values and the same
            shape: a view of the wrapped tensor where the subclass holds one (loads then write
            in place), else a dequantized copy (loads then go through ``param.copy_``).

    See [Note: portable FP8 checkpoints].

    Example:
        >>> from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # doctest: +SKIP
        >>> register_fp8_tensor_type(WeightWithDynamicFloat8CastTensor, lambda t: t._tensor)  # doctest: +SKIP
    """
    if not (isinstance(cls, type) and issubclass(cls, torch.Tensor)):
        raise ValueError(f"register_fp8_tensor_type: cls={cls!r} must be a torch.Tensor subclass")
    if not callable(to_plain):
        raise ValueError(f"register_fp8_tensor_type: to_plain={to_plain!r} must be callable")
    _TO_PLAIN[cls] = to_plain


def registered_fp8_tensor_types() -> tuple[type, ...]:
    """The subclasses registered with :func:`register_fp8_tensor_type`."""
    return tuple(_TO_PLAIN)


def _converter(t: torch.Tensor) -> ToPlain | None:
    for cls in type(t).__mro__:
        if cls in _TO_PLAIN:
            return _TO_PLAIN[cls]
    return None


def _is_plain(t: torch.Tensor) -> bool:
    return type(t) in (torch.Tensor, nn.Parameter)


def is_fp8_tensor(t: Any) -> bool:
    """Whether ``t`` (or a DTensor's local tensor) is of a registered FP8 subclass."""
    if isinstance(t, DTensor):
        t = local_tensor(t)
    return isinstance(t, torch.Tensor) and _converter(t) is not None


def to_plain(t: Any, *, key: str = "<tensor>") -> Any:
    """``t`` with any registered FP8 subclass replaced by its plain high-precision tensor.

    DTensors keep mesh, placements, global shape and stride; only the local tensor changes.
    Non-tensors and plain tensors are returned as they are.

    Raises:
        ValueError: ``t`` is a tensor subclass nobody registered (DCP would pickle its class and
            only readers with that package could load the checkpoint).
    """
    if not isinstance(t, torch.Tensor):
        return t
    local = local_tensor(t) if isinstance(t, DTensor) else t
    if _is_plain(local):
        return t
    convert = _converter(local)
    if convert is None:
        raise ValueError(
            f"{key}: tensor subclass {type(local).__module__}.{type(local).__qualname__} in the state dict; DCP "
            "would pickle it and a reader without that package could not load the checkpoint. Register how to "
            "save it as a plain tensor: shardbridge.fp8.register_fp8_tensor_type(cls, to_plain)"
        )
    plain = convert(local)
    if not _is_plain(plain) or tuple(plain.shape) != tuple(local.shape):
        raise ValueError(
            f"{key}: to_plain for {type(local).__qualname__} returned {type(plain).__qualname__} of shape "
            f"{tuple(plain.shape)}; it must return a plain torch.Tensor of shape {tuple(local.shape)}"
        )
    plain = plain.detach()
    if not isinstance(t, DTensor):
        return plain
    return DTensor.from_local(plain, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())


def plain_state_dict(sd: dict[str, Any]) -> dict[str, Any]:
    """A state dict with every FP8 subclass value made plain (keys and order kept)."""
    return {k: to_plain(v, key=k) for k, v in sd.items()}
