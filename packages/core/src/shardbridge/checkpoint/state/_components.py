"""Fused parameters stored as their components, in component-global coordinates.

[Note: component names]
~~~~~~~~~~~~~~~~~~~~~~~
A fused parameter (``shardbridge._fused``) is stored as one tensor per component, named by
:func:`component_fqn`: when the parameter's own name is ``weight`` or ``bias``, the fused
MODULE's name is replaced by the component name; otherwise the parameter's name is::

    layers.0.feed_forward.gate_up.weight -> layers.0.feed_forward.gate_proj.weight
                                            layers.0.feed_forward.up_proj.weight
    layers.0.attention.qkv.bias          -> layers.0.attention.{q,k,v}_proj.bias
    blocks.0.mixer.in_proj_packed        -> blocks.0.mixer.{q,k,v,beta}

Optimizer entries follow: ``state.<fused>.exp_avg`` -> ``state.<component>.exp_avg``. A
state shaped like the parameter (DTensor, full plain tensor, or a plain tensor holding exactly
this rank's local shard) is split like the parameter, in component-global coordinates; any
other entry (``step``, ``param_groups.*``) is stored once per component with the same value.
So a model with separate ``gate_proj``/``up_proj`` modules reads the same checkpoint.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard

from shardbridge._compat import local_tensor
from shardbridge._fused import FusedSpec, split_local
from shardbridge.checkpoint.state._chunks import LocalChunks, Origin
from shardbridge.checkpoint.state._repair import Box, box_rule, dtensor_origin, local_box

__all__ = ["ParamInfo", "component_fqn", "fused_tp_size", "param_box", "split_fused_value"]


def component_fqn(fused_fqn: str, component: str) -> str:
    """The FQN a fused parameter's component is stored under. See [Note: component names].

    Example:
        >>> component_fqn("layers.0.feed_forward.gate_up.weight", "up_proj")
        'layers.0.feed_forward.up_proj.weight'
        >>> component_fqn("mixer.in_proj_packed", "beta")
        'mixer.beta'
    """
    parts = fused_fqn.split(".")
    if len(parts) >= 2 and parts[-1] in ("weight", "bias"):
        parts[-2] = component
    else:
        parts[-1] = component
    return ".".join(parts)


def fused_tp_size(fqn: str, t: DTensor, spec: FusedSpec) -> int:
    """TP degree that interleaves ``t``'s items: the mesh axes named "tp" that Shard spec.dim."""
    mesh = t.device_mesh
    names = mesh.mesh_dim_names
    if names is None:
        if mesh.ndim == 1 and isinstance(t.placements[0], Shard):
            raise ValueError(
                f"fused parameter {fqn!r} is sharded on an unnamed 1-D mesh, so shardbridge cannot tell "
                "TP from FSDP; name the mesh axes (ParallelDims.build_mesh does, or "
                "init_device_mesh(..., mesh_dim_names=('tp',)))"
            )
        names = tuple("" for _ in range(mesh.ndim - 1)) + ("tp",)
    tp = 1
    for name, size, p in zip(names, mesh.shape, t.placements):
        if name == "tp" and type(p) is Shard and p.dim == spec.dim:
            tp *= size
    return tp


def _fused_pieces(
    spec: FusedSpec, local: torch.Tensor, box: Box, tp_size: int
) -> dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]:
    """Component name -> (component-global offsets, view) pieces of this rank's box."""
    sizes, offsets = box
    out: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {n: [] for n in spec.names}
    if 0 in sizes:
        return out
    for piece in split_local(local, spec, tp_size, offsets[spec.dim]):
        piece_offsets = list(offsets)
        piece_offsets[spec.dim] = piece.component_offset
        out[piece.name].append((tuple(piece_offsets), piece.view))
    return out


@dataclass(frozen=True)
class ParamInfo:
    """Layout of one parameter that its state entries are compared against."""

    fqn: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtensor: DTensor | None
    spec: FusedSpec | None
    box: Box | None = None
    """The local box a :class:`StateDictProvider` gave (None: from the placements)."""

    def holds_like_param(self, value: DTensor) -> bool:
        """Whether a DTensor state is laid out like the parameter (its box applies)."""
        return tuple(value.shape) == self.shape and tuple(local_tensor(value).shape) == self.local_shape


def param_box(info: ParamInfo) -> Box:
    """This rank's box of the DTensor parameter: the provider's, else the layout algebra's."""
    assert info.dtensor is not None
    return info.box if info.box is not None else local_box(info.fqn, info.dtensor)


def split_fused_value(info: ParamInfo, value: Any) -> dict[str, LocalChunks] | None:
    """Per component, the chunk object of a param-shaped tensor; None for other values."""
    spec = info.spec
    assert spec is not None
    if not isinstance(value, torch.Tensor):
        return None
    whole: Origin | None = None  # the layout of the fused tensor on every rank, when known
    if isinstance(value, DTensor):
        if tuple(value.shape) != info.shape:
            return None
        # Always explicit boxes: DCP's own description of the fused tensor is never used.
        local = local_tensor(value).detach()
        tp_size = fused_tp_size(info.fqn, value, spec)
        if info.box is not None and info.holds_like_param(value):
            box = info.box
        else:
            box, rule = box_rule(info.fqn, value)
            whole = dtensor_origin(value, rule)
    elif tuple(value.shape) == info.shape:
        # A full plain tensor, in the parameter's item coordinates ([gate; up] without TP).
        box, local = (tuple(value.shape), (0,) * value.dim()), value.detach()
        tp_size = 1 if info.dtensor is None else fused_tp_size(info.fqn, info.dtensor, spec)
        whole = Origin(tuple(value.shape), value.dtype)  # every rank holds all of it
    elif info.dtensor is not None and tuple(value.shape) == info.local_shape:
        # A plain tensor holding exactly this rank's local shard of the DTensor param.
        box = param_box(info)
        local, tp_size = value.detach(), fused_tp_size(info.fqn, info.dtensor, spec)
        if info.box is None:
            whole = dtensor_origin(info.dtensor, box_rule(info.fqn, info.dtensor)[1])
    else:
        return None
    pieces = _fused_pieces(spec, local, box, tp_size)
    return {
        name: LocalChunks(
            spec.component_shape(name, info.shape),
            pieces[name],
            origin=None if whole is None else dataclasses.replace(whole, dtype=local.dtype, fused=(spec, tp_size, name)),
        )
        for name in spec.names
    }
