"""shardbridge.fused: fused parameters (SwiGLU ``[gate; up]``, QKV, N-way) in global item coordinates.

Describe a fused weight with a :class:`FusedSpec` (its segments: :class:`FusedSegment`) and register it on
its module (:func:`register_fused`, read back by :func:`fused_params`; stored under
:data:`FUSED_SPECS_ATTR`); checkpoints then store its components and reshard them across TP
sizes. :func:`shard_fused` distributes a fused weight over ``tp``; :func:`split_fused` /
:func:`merge_fused` convert full tensors, :func:`tp_local_fused` a TP-local one,
:func:`split_local` any contiguous local shard (into :class:`ComponentPiece` objects). See [Note: item
coordinates] in ``_fused.py``; docs/concepts/fused-parameters.md.
"""

from shardbridge._fused import (
    FUSED_SPECS_ATTR,
    ComponentPiece,
    FusedSegment,
    FusedSpec,
    fused_params,
    merge_fused,
    register_fused,
    shard_fused,
    split_fused,
    split_local,
    tp_local_fused,
)

__all__ = [
    # -- configuration ---------------------------------------------------------------------
    "FusedSpec",
    "FusedSegment",
    "register_fused",
    "fused_params",
    "FUSED_SPECS_ATTR",
    # -- conversions -----------------------------------------------------------------------
    "shard_fused",
    "split_fused",
    "merge_fused",
    "tp_local_fused",
    "split_local",
    "ComponentPiece",
]
