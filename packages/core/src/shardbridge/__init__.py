"""shardbridge: FSDP2 x tensor parallelism with DCP checkpoints and FP8 parameters.

The core package imports torch and small pure-Python libraries only (docs/architecture.md).
Host-framework adapters live in ``shardbridge_te``, ``shardbridge_megatron_fsdp`` and
``shardbridge_hf``.

Public surface: the names in ``__all__`` (the mesh, the precision policy, FSDP2 units; grouped
below as torchao's ``float8`` does), and one public namespace per concept, each with its own
``__all__``: ``shardbridge.checkpoint``, ``shardbridge.fp8`` (FP8 recipes, backends, portable
FP8 tensors), ``shardbridge.tp`` (local TP shards as DTensor parameters), ``shardbridge.cp``
(context parallelism), ``shardbridge.ep`` (expert parallelism), ``shardbridge.fused`` (fused
parameters), ``shardbridge.layout`` (the layout algebra), ``shardbridge.models``,
``shardbridge.pretrained``, ``shardbridge.testing``; for adapters only, ``shardbridge.adapters``.
Every public name lives in exactly one of them (``packages/core/tests/test_public_surface.py``).
Modules whose names start with ``_`` are implementation details; ``shardbridge._compat`` is the
designated home of torch's private names, shared with the adapters (see [Note: upstream
internals] there).
"""

from shardbridge._clip import clip_grad_norm_
from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr
from shardbridge._distributed import DistributedEnv, init_distributed
from shardbridge._extras import UntestedVersionWarning
from shardbridge._mesh import EXPERT_AXES, FLATTENED_AXES, MESH_AXES, ParallelDims, ParallelMesh
from shardbridge._optim import param_group_fqns, rebind_param_groups
from shardbridge._precision import PrecisionPolicy
from shardbridge._version import __version__  # written once, in _version.py
from shardbridge._wrap import FSDPUnit, SupportsFSDPUnits, apply_fsdp, fsdp_unit_params

__all__ = [
    "__version__",
    "UntestedVersionWarning",
    # -- configuration ---------------------------------------------------------------------
    "ParallelDims",
    "PrecisionPolicy",
    # -- entry points ----------------------------------------------------------------------
    # joining the job
    "init_distributed",
    # FSDP2 wrapping, clipping, optimizer groups
    "apply_fsdp",
    "clip_grad_norm_",
    "fsdp_unit_params",
    "param_group_fqns",
    "rebind_param_groups",
    # -- types and constants ---------------------------------------------------------------
    "DistributedEnv",
    "EXPERT_AXES",
    "FLATTENED_AXES",
    "FSDPUnit",
    "MESH_AXES",
    "ParallelMesh",
    "SupportsFSDPUnits",
]

# Old names that keep working until the next release, each read warning where the name went
# ([Note: deprecated aliases] in _deprecation.py).
_DEPRECATED = {
    # renamed: torch's FSDP2 has another class called MixedPrecisionPolicy
    "MixedPrecisionPolicy": "shardbridge.PrecisionPolicy",
    # the layout algebra
    "LayoutMismatch": "shardbridge.layout.LayoutMismatch",
    "chunk_box": "shardbridge.layout.chunk_box",
    "dcp_chunk": "shardbridge.layout.dcp_chunk",
    "find_dcp_mismatches": "shardbridge.layout.find_dcp_mismatches",
    "fsdp_chunk": "shardbridge.layout.fsdp_chunk",
    "fsdp_placements": "shardbridge.layout.fsdp_placements",
    "fsdp_tp_chunk": "shardbridge.layout.fsdp_tp_chunk",
    "local_chunk": "shardbridge.layout.local_chunk",
    "parse_mesh": "shardbridge.layout.parse_mesh",
    "parse_placements": "shardbridge.layout.parse_placements",
    "render_layout": "shardbridge.layout.render_layout",
    # one namespace per concept (issue 41)
    "TPMode": "shardbridge.tp.TPMode",
    "check_tp_divides": "shardbridge.tp.check_tp_divides",
    "convert_module_params": "shardbridge.tp.convert_module_params",
    "local_view": "shardbridge.tp.local_view",
    "to_dtensor_param": "shardbridge.tp.to_dtensor_param",
    "tp_placements": "shardbridge.tp.tp_placements",
    "check_cp_seq_len": "shardbridge.cp.check_cp_seq_len",
    "cp_attention": "shardbridge.cp.cp_attention",
    "cp_cross_entropy": "shardbridge.cp.cp_cross_entropy",
    "cp_positions": "shardbridge.cp.cp_positions",
    "cp_split": "shardbridge.cp.cp_split",
    "cp_unsplit": "shardbridge.cp.cp_unsplit",
    "EPDispatch": "shardbridge.ep.EPDispatch",
    "choose_dispatch": "shardbridge.ep.choose_dispatch",
    "expert_shard_dim": "shardbridge.ep.expert_shard_dim",
    "load_balancing_loss": "shardbridge.ep.load_balancing_loss",
    "router_statistics": "shardbridge.ep.router_statistics",
    "run_experts": "shardbridge.ep.run_experts",
    "shard_experts": "shardbridge.ep.shard_experts",
    "FUSED_SPECS_ATTR": "shardbridge.fused.FUSED_SPECS_ATTR",
    "ComponentPiece": "shardbridge.fused.ComponentPiece",
    "FusedSegment": "shardbridge.fused.FusedSegment",
    "FusedSpec": "shardbridge.fused.FusedSpec",
    "fused_params": "shardbridge.fused.fused_params",
    "merge_fused": "shardbridge.fused.merge_fused",
    "register_fused": "shardbridge.fused.register_fused",
    "shard_fused": "shardbridge.fused.shard_fused",
    "split_fused": "shardbridge.fused.split_fused",
    "split_local": "shardbridge.fused.split_local",
    "tp_local_fused": "shardbridge.fused.tp_local_fused",
    "FP8Recipe": "shardbridge.fp8.FP8Recipe",
    "is_fp8_tensor": "shardbridge.fp8.is_fp8_tensor",
    "plain_state_dict": "shardbridge.fp8.plain_state_dict",
    "register_fp8_tensor_type": "shardbridge.fp8.register_fp8_tensor_type",
    "to_plain": "shardbridge.fp8.to_plain",
    "use_uint8_all_gather": "shardbridge.fp8.use_uint8_all_gather",
    # no longer public: what use_uint8_all_gather installs
    "FP8_DTYPES": "shardbridge._wrap.FP8_DTYPES",
    "Uint8AllGather": "shardbridge._wrap.Uint8AllGather",
}
__getattr__ = _deprecated_getattr(
    __name__, _DEPRECATED, {"MixedPrecisionPolicy": "torch.distributed.fsdp.MixedPrecisionPolicy is another class"}
)


def _check_torch_version() -> None:
    """One UntestedVersionWarning for a torch outside TORCH_CHECKED ([Note: version policy] in shardbridge._extras)."""
    from shardbridge._compat import TORCH_CHECKED, torch_version
    from shardbridge._extras import warn_if_untested

    warn_if_untested("torch", torch_version()[:3], TORCH_CHECKED)


_check_torch_version()
