"""FP8 training as one concept: a recipe (:class:`FP8Recipe`) and backends that run it.

Users set ``PrecisionPolicy(fp8=FP8Recipe(backend=..., name=...))``; adapters call
:func:`convert` before TP / FSDP and the after-step / after-load hooks, and ``apply_fsdp``
runs the backend's after-FSDP work. Backends: "torchao" (here; torchao imported lazily) and
"te" (``shardbridge_te``, found through the ``shardbridge.fp8_backends`` entry point). See
[Note: one FP8 recipe] and [Note: the FP8 backend protocol]. The checkpoint rule for FP8 tensor
subclasses lives in ``shardbridge`` itself (:func:`shardbridge.register_fp8_tensor_type`).

Public: the names in ``__all__``.
"""

from shardbridge.fp8._backend import (
    ENTRY_POINT_GROUP,
    Converted,
    FP8Backend,
    FP8BackendBase,
    after_fsdp,
    after_load,
    after_optimizer_step,
    backend_names,
    convert,
    converted_fqn,
    get_backend,
    install_step_hook,
    model_init_context,
    recipe_of,
    register_backend,
)
from shardbridge.fp8._recipe import FP8Recipe
from shardbridge.fp8._torchao import TorchaoBackend, default_module_filter
from shardbridge.fp8._tp_styles import MXFP8ColwiseParallel, MXFP8RowwiseParallel

register_backend(TorchaoBackend())

__all__ = [
    "ENTRY_POINT_GROUP",
    "Converted",
    "FP8Backend",
    "FP8BackendBase",
    "FP8Recipe",
    "MXFP8ColwiseParallel",
    "MXFP8RowwiseParallel",
    "TorchaoBackend",
    "after_fsdp",
    "after_load",
    "after_optimizer_step",
    "backend_names",
    "convert",
    "converted_fqn",
    "default_module_filter",
    "get_backend",
    "install_step_hook",
    "model_init_context",
    "recipe_of",
    "register_backend",
]
