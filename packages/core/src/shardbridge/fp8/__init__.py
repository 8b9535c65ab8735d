"""FP8 training as one concept: a recipe, backends that convert a model for it, portable FP8 tensors.

Convert BEFORE tensor parallelism and FSDP, refresh after the weights change; the FSDP and TP
code never asks for FP8 (torchtitan's converter shape)::

    done = fp8.convert(model, FP8Recipe(backend="torchao", name="tensorwise"), mesh=pm)
    parallelize_llama(model, pm, policy)          # TP with done.tp_styles, FSDP2 units, fp8.refresh
    fp8.install_step_hook(optimizer, model)       # fp8.refresh after every optimizer step

Backends: "torchao" (here; torchao imported lazily) and "te" (``shardbridge_te``, found through
the ``shardbridge.fp8_backends`` entry point). See [Note: one FP8 recipe], [Note: the FP8 backend
protocol] and [Note: portable FP8 checkpoints].

Public: the names in ``__all__``, in three groups: configuration, what adapters and users call,
and what a backend implements or registers.
"""

from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr
from shardbridge._wrap import use_uint8_all_gather
from shardbridge.fp8._convert import convert, converted, converted_fqn, install_step_hook, recipe_of, refresh
from shardbridge.fp8._recipe import (
    ENTRY_POINT_GROUP,
    Converted,
    FP8Backend,
    FP8BackendBase,
    FP8Recipe,
    backend_names,
    get_backend,
    register_backend,
)
from shardbridge.fp8._tensors import (
    is_fp8_tensor,
    plain_state_dict,
    register_fp8_tensor_type,
    to_plain,
)
from shardbridge.fp8._torchao import TorchaoBackend, default_module_filter
from shardbridge.fp8._tp_styles import MXFP8ColwiseParallel, MXFP8RowwiseParallel

register_backend(TorchaoBackend())

__all__ = [
    # -- configuration ---------------------------------------------------------------------
    "FP8Recipe",
    # -- convert, refresh, checkpoint ------------------------------------------------------
    "convert",
    "converted",
    "converted_fqn",
    "install_step_hook",
    "is_fp8_tensor",
    "plain_state_dict",
    "recipe_of",
    "refresh",
    "to_plain",
    "use_uint8_all_gather",
    # -- backends --------------------------------------------------------------------------
    "ENTRY_POINT_GROUP",
    "Converted",
    "FP8Backend",
    "FP8BackendBase",
    "MXFP8ColwiseParallel",
    "MXFP8RowwiseParallel",
    "TorchaoBackend",
    "backend_names",
    "default_module_filter",
    "get_backend",
    "register_backend",
    "register_fp8_tensor_type",
]

# Folded into refresh() in 0.1.0 (issue 24): the same hook ran after a step and after a load
# ([Note: deprecated aliases] in shardbridge/_deprecation.py).
_DEPRECATED = {"after_load": "shardbridge.fp8.refresh", "after_optimizer_step": "shardbridge.fp8.refresh"}
__getattr__ = _deprecated_getattr(__name__, _DEPRECATED)
