"""shardbridge: FSDP2 x tensor parallelism with DCP checkpoints and FP8 parameters.

The core package imports torch only. Host-framework adapters live in ``shardbridge_te``,
``shardbridge_megatron_fsdp`` and ``shardbridge_hf``.

Public surface: the names in ``__all__``. Modules whose names start with ``_`` are
implementation details; ``shardbridge.checkpoint``, ``shardbridge.models`` and
``shardbridge.testing`` are public subpackages with their own ``__all__``.
"""

__version__ = "0.1.0"

__all__: list[str] = ["__version__"]

# --- mesh ---------------------------------------------------------------
from shardbridge._mesh import FLATTENED_AXES, MESH_AXES, ParallelDims, ParallelMesh

__all__ += ["FLATTENED_AXES", "MESH_AXES", "ParallelDims", "ParallelMesh"]
# --- end mesh -----------------------------------------------------------

# --- layout -------------------------------------------------------------
from shardbridge._layout import (
    LayoutMismatch,
    chunk_box,
    dcp_chunk,
    find_dcp_mismatches,
    fsdp_chunk,
    fsdp_placements,
    fsdp_tp_chunk,
    local_chunk,
    parse_mesh,
    parse_placements,
    render_layout,
)

__all__ += [
    "LayoutMismatch",
    "chunk_box",
    "dcp_chunk",
    "find_dcp_mismatches",
    "fsdp_chunk",
    "fsdp_placements",
    "fsdp_tp_chunk",
    "local_chunk",
    "parse_mesh",
    "parse_placements",
    "render_layout",
]
# --- end layout ---------------------------------------------------------

# --- tp -----------------------------------------------------------------
from shardbridge._tp import TPMode, convert_module_params, local_view, to_dtensor_param, tp_placements

__all__ += ["TPMode", "convert_module_params", "local_view", "to_dtensor_param", "tp_placements"]
# --- end tp -------------------------------------------------------------

# --- fused --------------------------------------------------------------
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

__all__ += [
    "FUSED_SPECS_ATTR",
    "ComponentPiece",
    "FusedSegment",
    "FusedSpec",
    "fused_params",
    "merge_fused",
    "register_fused",
    "shard_fused",
    "split_fused",
    "split_local",
    "tp_local_fused",
]
# --- end fused ----------------------------------------------------------

# --- precision ----------------------------------------------------------
from shardbridge._precision import FP8Recipe, MixedPrecisionPolicy

__all__ += ["FP8Recipe", "MixedPrecisionPolicy"]
# --- end precision ------------------------------------------------------

# --- wrap ---------------------------------------------------------------
from shardbridge._wrap import FSDPUnit, SupportsFSDPUnits, apply_fsdp, fsdp_unit_params

__all__ += ["FSDPUnit", "SupportsFSDPUnits", "apply_fsdp", "fsdp_unit_params"]
# --- end wrap -----------------------------------------------------------
