"""shardbridge_te: TransformerEngine modules under FSDP2 x TP with DCP checkpoints.

The ``te`` extra (TransformerEngine; README.md, Install). One call gives every TE module (Linear, LayerNormLinear,
LayerNormMLP, LayerNorm, RMSNorm, DotProductAttention, GroupedLinear, and those inside
MultiheadAttention / TransformerLayer) DTensor TP parameters, the TP group and the ``weight``
mesh as amax-reduction group; :func:`parallelize` also shards with FSDP2 and materializes.
Checkpoints go through ``shardbridge.checkpoint`` (FP8 parameters saved as plain tensors,
``_extra_state`` loadable at any layout). GroupedLinear experts join the core's ``ep`` axis
(:func:`shard_grouped_experts`) and are checkpointed as global ``[E, out, in]`` expert tensors
(:class:`ExpertStateDicts`). Guide: docs/te.md.

Public: the names in ``__all__``. ``_``-prefixed modules are private; the placement table
(``shardbridge_te._placements``) and patch plan (``shardbridge_te._patches``) import without TE.
Every change to TE objects is a version-gated, reversible entry of the patch plan
(``PATCHES``; :func:`unpatch` undoes them). Importing this package does not import TE; the functions do (``ImportError`` with the install
hint when it is missing).
"""

from shardbridge.fp8 import register_backend as _register_backend

from shardbridge_te._apply import TEModuleState, set_device_mesh
from shardbridge_te._checkpoint import register_te_fp8_types
from shardbridge_te._compat import te_version
from shardbridge_te._cp import CP_COMM_TYPES, set_context_parallel
from shardbridge_te._experts import ExpertStateDicts, shard_grouped_experts
from shardbridge_te._fp8 import TEBackend, build_recipe, model_init_context, recipe_spec, remove_autocast
from shardbridge_te._fp8 import backend as _backend
from shardbridge_te._lifecycle import default_units, materialize, parallelize
from shardbridge_te._patches import PATCHES, Patch, patch_plan, unpatch
from shardbridge_te._placements import tp_mode

__all__ = [
    "CP_COMM_TYPES",
    "ExpertStateDicts",
    "PATCHES",
    "Patch",
    "TEBackend",
    "TEModuleState",
    "default_units",
    "materialize",
    "model_init_context",
    "parallelize",
    "patch_plan",
    "register_te_fp8_types",
    "set_context_parallel",
    "set_device_mesh",
    "shard_grouped_experts",
    "build_recipe",
    "recipe_spec",
    "remove_autocast",
    "te_version",
    "tp_mode",
    "unpatch",
]

_register_backend(_backend)  # FP8Recipe(backend="te"); also declared as an entry point
