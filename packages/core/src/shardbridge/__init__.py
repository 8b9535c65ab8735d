"""shardbridge: FSDP2 x tensor parallelism with DCP checkpoints and FP8 parameters.

The core package imports torch only. Host-framework adapters live in ``shardbridge_te``,
``shardbridge_megatron_fsdp`` and ``shardbridge_hf``.

Public surface: the names in ``__all__``. Modules whose names start with ``_`` are
implementation details; ``shardbridge.checkpoint``, ``shardbridge.models`` and
``shardbridge.testing`` are public subpackages with their own ``__all__``.
"""

from shardbridge._clip import clip_grad_norm_
from shardbridge._fp8 import (
    FP8_DTYPES,
    Uint8AllGather,
    is_fp8_tensor,
    plain_state_dict,
    register_fp8_tensor_type,
    to_plain,
    use_uint8_all_gather,
)
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
from shardbridge._layout import (
    LayoutMismatch,
    chunk_box,
    dcp_chunk,
    find_dcp_mismatches,
    fsdp_chunk,
    fsdp_placements,
    fsdp_tp_chunk,
    local_chunk,
)
from shardbridge._layout_text import parse_mesh, parse_placements, render_layout
from shardbridge._mesh import FLATTENED_AXES, MESH_AXES, ParallelDims, ParallelMesh
from shardbridge._optim import param_group_fqns, rebind_param_groups
from shardbridge._precision import FP8Recipe, MixedPrecisionPolicy
from shardbridge._tp import (
    TPMode,
    check_tp_divides,
    convert_module_params,
    local_view,
    to_dtensor_param,
    tp_placements,
)
from shardbridge._wrap import FSDPUnit, SupportsFSDPUnits, apply_fsdp, fsdp_unit_params

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "FLATTENED_AXES",
    "MESH_AXES",
    "ParallelDims",
    "ParallelMesh",
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
    "TPMode",
    "check_tp_divides",
    "convert_module_params",
    "local_view",
    "to_dtensor_param",
    "tp_placements",
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
    "FP8Recipe",
    "FP8_DTYPES",
    "Uint8AllGather",
    "is_fp8_tensor",
    "plain_state_dict",
    "register_fp8_tensor_type",
    "to_plain",
    "use_uint8_all_gather",
    "MixedPrecisionPolicy",
    "FSDPUnit",
    "SupportsFSDPUnits",
    "apply_fsdp",
    "clip_grad_norm_",
    "fsdp_unit_params",
    "param_group_fqns",
    "rebind_param_groups",
]
