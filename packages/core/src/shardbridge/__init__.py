"""shardbridge: FSDP2 x tensor parallelism with DCP checkpoints and FP8 parameters.

The core package imports torch and small pure-Python libraries only (docs/architecture.md).
Host-framework adapters live in ``shardbridge_te``, ``shardbridge_megatron_fsdp`` and
``shardbridge_hf``.

Public surface: the names in ``__all__`` (grouped below as configuration, entry points and
types, as torchao's ``float8`` does). Public subpackages and modules with their own ``__all__``:
``shardbridge.checkpoint``, ``shardbridge.fp8`` (FP8 recipes, backends, portable FP8 tensors),
``shardbridge.layout`` (the layout algebra), ``shardbridge.models``, ``shardbridge.pretrained``,
``shardbridge.testing``, and for adapters ``shardbridge.patching`` and ``shardbridge.cli``.
Modules whose names start with ``_`` are implementation details; ``shardbridge._compat`` is the
designated home of torch's private names, shared with the adapters (see [Note: upstream
internals] there).
"""

import importlib as _importlib
import warnings as _warnings

from shardbridge._clip import clip_grad_norm_
from shardbridge._cp import (
    check_cp_seq_len,
    cp_attention,
    cp_cross_entropy,
    cp_positions,
    cp_split,
    cp_unsplit,
)
from shardbridge._distributed import DistributedEnv, init_distributed
from shardbridge._ep import (
    EPDispatch,
    choose_dispatch,
    expert_shard_dim,
    load_balancing_loss,
    router_statistics,
    run_experts,
    shard_experts,
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
from shardbridge._mesh import EXPERT_AXES, FLATTENED_AXES, MESH_AXES, ParallelDims, ParallelMesh
from shardbridge._optim import param_group_fqns, rebind_param_groups
from shardbridge._precision import PrecisionPolicy
from shardbridge._tp import (
    TPMode,
    check_tp_divides,
    convert_module_params,
    local_view,
    to_dtensor_param,
    tp_placements,
    unview_tp_output,
)
from shardbridge._version import __version__  # written once, in _version.py
from shardbridge._wrap import (
    FP8_DTYPES,
    FSDPUnit,
    SupportsFSDPUnits,
    Uint8AllGather,
    apply_fsdp,
    fsdp_unit_params,
    use_uint8_all_gather,
)
from shardbridge.extras import UntestedVersionWarning
from shardbridge.fp8 import FP8Recipe, is_fp8_tensor, plain_state_dict, register_fp8_tensor_type, to_plain

__all__ = [
    "__version__",
    "UntestedVersionWarning",
    # -- configuration ---------------------------------------------------------------------
    "FP8Recipe",
    "FusedSpec",
    "ParallelDims",
    "PrecisionPolicy",
    # -- entry points ----------------------------------------------------------------------
    # joining the job, mesh and TP
    "init_distributed",
    "check_tp_divides",
    "convert_module_params",
    "local_view",
    "to_dtensor_param",
    "tp_placements",
    "unview_tp_output",
    # FSDP2 wrapping, clipping, optimizer groups
    "apply_fsdp",
    "clip_grad_norm_",
    "fsdp_unit_params",
    "param_group_fqns",
    "rebind_param_groups",
    # context parallelism
    "check_cp_seq_len",
    "cp_attention",
    "cp_cross_entropy",
    "cp_positions",
    "cp_split",
    "cp_unsplit",
    # expert parallelism
    "choose_dispatch",
    "expert_shard_dim",
    "load_balancing_loss",
    "router_statistics",
    "run_experts",
    "shard_experts",
    # fused parameters
    "fused_params",
    "merge_fused",
    "register_fused",
    "shard_fused",
    "split_fused",
    "split_local",
    "tp_local_fused",
    # FP8 parameters
    "is_fp8_tensor",
    "plain_state_dict",
    "register_fp8_tensor_type",
    "to_plain",
    "use_uint8_all_gather",
    # -- types and constants ---------------------------------------------------------------
    "ComponentPiece",
    "DistributedEnv",
    "EPDispatch",
    "EXPERT_AXES",
    "FLATTENED_AXES",
    "FP8_DTYPES",
    "FSDPUnit",
    "FUSED_SPECS_ATTR",
    "FusedSegment",
    "MESH_AXES",
    "ParallelMesh",
    "SupportsFSDPUnits",
    "TPMode",
    "Uint8AllGather",
]

# Layout helpers moved to shardbridge.layout in 0.1.0; the old top-level names keep working
# until the next release (a DeprecationWarning each time one is read).
_MOVED_TO_LAYOUT = frozenset(
    {
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
    }
)


# Renamed in 0.1.0, with the same deprecation: torch's FSDP2 has a different class called MixedPrecisionPolicy
# (torch.distributed.fsdp.MixedPrecisionPolicy); one name for two classes invited import mistakes.
_RENAMED = {"MixedPrecisionPolicy": "PrecisionPolicy"}


def __getattr__(name: str):  # PEP 562: deprecated aliases
    if name in _RENAMED:
        new = _RENAMED[name]
        _warnings.warn(
            f"shardbridge.{name} is now shardbridge.{new} (torch.distributed.fsdp.{name} is another class); "
            "the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[new]
    if name in _MOVED_TO_LAYOUT:
        _warnings.warn(
            f"shardbridge.{name} moved to shardbridge.layout.{name}; the old name goes away in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return getattr(_importlib.import_module("shardbridge.layout"), name)
    raise AttributeError(f"module 'shardbridge' has no attribute {name!r}")


def _check_torch_version() -> None:
    """One UntestedVersionWarning for a torch outside TORCH_CHECKED ([Note: version policy] in shardbridge.extras)."""
    from shardbridge._compat import TORCH_CHECKED, torch_version
    from shardbridge.extras import warn_if_untested

    warn_if_untested("torch", torch_version()[:3], TORCH_CHECKED)


_check_torch_version()
