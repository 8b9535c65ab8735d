"""Version probes and upstream internals of both Megatron-FSDP hosts, in one place (cached).

The adapter has two entry points over one Megatron-FSDP: the standalone ``megatron_fsdp``
package (``megatron-fsdp>=0.6.1,<0.7``, the ``megatron`` extra; 0.6.1 is the package of
Megatron-LM core_r0.19.0) and the copy megatron-core bundles
(``megatron.core.distributed.fsdp.src.megatron_fsdp``; ``megatron-core>=0.16.1,<0.17``, the
``megatron-core`` extra; 0.16.1 is the newest release for Python 3.11). They never share an
environment (see the Note). :func:`megatron_fsdp_version` and :func:`megatron_core_version`
have one contract: the checked version as a tuple, or ImportError with the install hint.
Every private name of either copy (and of megatron.core) the adapter reads is read here;
:data:`COPIES` names the two package roots, and :func:`megatron_fsdp_module` finds which copy
wrapped a model.

[Note: megatron-core beside megatron-fsdp]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``megatron_fsdp.fully_shard`` prefers ``megatron.core``'s ``DistributedDataParallelConfig``
over its own when ``megatron.core`` imports (``try: from megatron.core.distributed...``).
megatron-core 0.16.x (the newest for Python 3.11) has the older config class, without the
fields megatron-fsdp 0.6 passes (``megatron_fsdp_use_decoupled_grad`` ...), so ``fully_shard``
dies with a TypeError deep inside. :func:`megatron_fsdp_version` refuses that pairing up front;
a megatron-core that ships the same config (core_r0.19.0 and newer) is accepted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util
import sys
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from shardbridge._compat import local_tensor, parse_version
from shardbridge.adapters import fmt_version, install_hint

__all__ = [
    "BUNDLED",
    "COPIES",
    "INSTALL_HINT",
    "MCORE_INSTALL_HINT",
    "STANDALONE",
    "STRATEGIES",
    "attached_main_grads",
    "bundled_fsdp",
    "chunk_offsets",
    "disable_grad_div_fusion",
    "fix_missing_te_linear",
    "fix_missing_te_router_gemm",
    "fsdp_tensor_spec",
    "fully_shard_model",
    "has_local_data",
    "install_distributed_params",
    "is_fp8_parameter",
    "megatron_core_version",
    "megatron_fsdp_module",
    "megatron_fsdp_version",
    "optimizer_named_parameters",
    "parameter_groups",
    "raw_parameters",
    "require_megatron_core",
    "require_megatron_fsdp",
]

STANDALONE = "megatron_fsdp"
"""Package root of the standalone Megatron-FSDP (``pip install megatron-fsdp``)."""
BUNDLED = "megatron.core.distributed.fsdp.src.megatron_fsdp"
"""Package root of the Megatron-FSDP copy inside megatron-core."""
COPIES = (STANDALONE, BUNDLED)
"""Both copies: the same modules (``megatron_fsdp``, ``param_and_grad_buffer``, ``uneven_dtensor``, ...) under two roots."""

STRATEGIES: tuple[str, ...] = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP sharding strategies (0..3): what is sharded over ``dp_shard``."""

INSTALL_HINT = install_hint("megatron")  # [Note: install hints] in shardbridge/extras.py
MCORE_INSTALL_HINT = install_hint("megatron-core")

# (distribution, checked range [low, high), install hint, who needs it)
_SUPPORTED: dict[str, tuple[tuple[int, ...], tuple[int, ...], str, str]] = {
    "megatron-fsdp": ((0, 6, 1), (0, 7, 0), INSTALL_HINT, "shardbridge_megatron_fsdp"),
    "megatron-core": ((0, 16, 1), (0, 17, 0), MCORE_INSTALL_HINT, "shardbridge_megatron_fsdp.mcore"),
}


def _checked_version(distribution: str) -> tuple[int, ...]:
    """The installed version of ``distribution`` as a tuple; ImportError (with the hint) when missing or unsupported."""
    low, high, hint, owner = _SUPPORTED[distribution]
    try:
        version = importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"{owner} needs {distribution}; install it with {hint}") from None
    parsed = parse_version(version)
    if not low <= parsed < high:
        raise ImportError(
            f"{distribution} {version} is not supported by {owner} (needs >={fmt_version(low)},<{fmt_version(high)}); "
            f"install a supported version with {hint}"
        )
    return parsed


@functools.cache
def megatron_fsdp_version() -> tuple[int, ...]:
    """The installed megatron-fsdp version as a tuple, after checking it is usable.

    Raises:
        ImportError: megatron-fsdp is missing or outside the supported range (the message
            carries the install hint), or megatron-core sits beside it with an incompatible
            config class (see [Note: megatron-core beside megatron-fsdp]).

    Example:
        >>> megatron_fsdp_version() >= (0, 6, 1)  # doctest: +SKIP
        True
    """
    parsed = _checked_version("megatron-fsdp")
    _check_megatron_core()
    return parsed


@functools.cache
def megatron_core_version() -> tuple[int, ...]:
    """The installed megatron-core version as a tuple, after checking it is supported.

    Raises:
        ImportError: megatron-core missing or outside [0.16.1, 0.17) (with the install hint).

    Example:
        >>> megatron_core_version() >= (0, 16, 1)  # doctest: +SKIP
        True
    """
    return _checked_version("megatron-core")


def _importable_megatron_core() -> str | None:
    """The megatron-core beside megatron-fsdp: its version ("unknown" from a source tree), None when absent."""
    try:
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _check_megatron_core() -> None:
    core = _importable_megatron_core()
    if core is None:
        return
    from megatron.core.distributed.distributed_data_parallel_config import (  # type: ignore[import-not-found]
        DistributedDataParallelConfig as CoreConfig,
    )

    needed = {"outer_dp_sharding_strategy", "megatron_fsdp_use_decoupled_grad", "megatron_fsdp_cuda_graph_mode"}
    have = {f.name for f in dataclasses.fields(CoreConfig)}
    if not needed <= have:
        raise ImportError(
            f"megatron-core {core} is installed beside megatron-fsdp: megatron_fsdp.fully_shard then uses "
            f"megatron-core's older DistributedDataParallelConfig (missing {sorted(needed - have)}) and fails "
            "with a TypeError. Uninstall megatron-core (pip uninstall megatron-core) or use a megatron-core "
            "that ships Megatron-FSDP 0.6 itself (core_r0.19.0 or newer); see docs/megatron-fsdp.md"
        )


def require_megatron_fsdp():
    """Import and return the ``megatron_fsdp`` module after the version checks.

    Raises:
        ImportError: see :func:`megatron_fsdp_version`.
    """
    megatron_fsdp_version()
    import warnings

    with warnings.catch_warnings():
        # "Transformer Engine and Apex are not installed. Falling back to local implementations"
        warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
        import megatron_fsdp
    return megatron_fsdp


def require_megatron_core() -> Any:
    """Import and return ``megatron.core`` after the version check."""
    megatron_core_version()
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE) .*not installed.*")
        warnings.filterwarnings("ignore", message=".*Falling back to Torch Norm.*")
        import megatron.core

    return megatron.core


def bundled_fsdp() -> ModuleType:
    """Megatron-Core's bundled Megatron-FSDP package (:data:`BUNDLED`), after the version check."""
    require_megatron_core()
    return importlib.import_module(BUNDLED)


def megatron_fsdp_module(model: Any) -> tuple[Any, ModuleType] | None:
    """``(MegatronFSDP module, its package)`` of a wrapped model, or None.

    ``model`` is the standalone ``MegatronFSDP`` (``shard_model``) or Megatron-Core's
    ``FullyShardedDataParallel``, whose ``.module`` is the bundled copy's ``MegatronFSDP``
    (``mcore.shard_model``). Only copies already imported are asked: a model one of them
    wrapped implies it is imported.
    """
    for candidate in (model, getattr(model, "module", None)):
        for root in COPIES:
            impl = sys.modules.get(f"{root}.megatron_fsdp")
            if impl is not None and isinstance(candidate, impl.MegatronFSDP):
                return candidate, sys.modules[root]
    return None


def fully_shard_model(mfsdp: Any, ddp_config_fields: Mapping[str, Any], **kwargs: Any) -> Any:
    """``mfsdp.fully_shard_model(**kwargs)`` whose ``DistributedDataParallelConfig`` also gets ``ddp_config_fields``.

    [Note: DistributedDataParallelConfig fields fully_shard_model does not take]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    megatron-fsdp 0.6.1's ``fully_shard_model`` builds its ``DistributedDataParallelConfig``
    itself from its own arguments and has no argument for ``fp8_param_gather`` (the switch
    Megatron-LM sets for FP8 parameters). For the duration of the call, the config class that
    ``megatron_fsdp.fully_shard`` looks up (megatron-fsdp's own, or megatron-core's when that
    imports) is replaced by a factory that builds the same class with ``ddp_config_fields``
    added; the real class is restored afterwards, also on error. A field that a future
    ``fully_shard_model`` takes as an argument is passed as one instead. With no fields this
    is the plain call.

    Raises:
        NotImplementedError: a field the installed config class does not have.
    """
    if not ddp_config_fields:
        return mfsdp.fully_shard_model(**kwargs)
    import inspect

    taken = inspect.signature(mfsdp.fully_shard_model).parameters
    as_args = {k: v for k, v in ddp_config_fields.items() if k in taken}
    rest = {k: v for k, v in ddp_config_fields.items() if k not in taken}
    with _ddp_config_fields(rest):
        return mfsdp.fully_shard_model(**kwargs, **as_args)


@contextlib.contextmanager
def _ddp_config_fields(fields: Mapping[str, Any]) -> Iterator[None]:
    if not fields:
        yield
        return
    module = importlib.import_module("megatron_fsdp.fully_shard")
    config_cls = module.DistributedDataParallelConfig
    missing = sorted(set(fields) - {f.name for f in dataclasses.fields(config_cls)})
    if missing:
        raise NotImplementedError(
            f"{config_cls.__module__}.DistributedDataParallelConfig has no field(s) {missing} in this "
            f"megatron-fsdp ({importlib.metadata.version('megatron-fsdp')}); shardbridge_megatron_fsdp was checked "
            "against megatron-fsdp 0.6.1, where fp8_param_gather exists"
        )

    def build(*args: Any, **kw: Any) -> Any:
        return config_cls(*args, **{**kw, **fields})

    module.DistributedDataParallelConfig = build
    try:
        yield
    finally:
        module.DistributedDataParallelConfig = config_cls


def is_fp8_parameter(param: Any) -> bool:
    """Whether Megatron-FSDP treats ``param`` as an FP8 parameter (a TE quantized tensor).

    ``megatron_fsdp.mixed_precision.is_float8tensor``: False whenever TransformerEngine does
    not import.
    """
    from megatron_fsdp.mixed_precision import is_float8tensor
    from torch.distributed.tensor import DTensor

    return bool(is_float8tensor(local_tensor(param) if isinstance(param, DTensor) else param))


# -- Megatron-FSDP internals (checked against megatron-fsdp 0.6.1 and megatron-core 0.16.1's copy) --
# MegatronFSDP exposes no public accessor for its buffers or distributed parameters; every
# attribute below is read here and nowhere else in the adapter, the same in both copies.


def parameter_groups(wrapped: Any) -> list[Any]:
    """``wrapped.param_and_grad_buffer.parameter_groups`` (one per dtype/bucket)."""
    return list(wrapped.param_and_grad_buffer.parameter_groups)


def optimizer_named_parameters(wrapped: Any) -> list[tuple[str, Any]]:
    """``(fqn, distributed DTensor parameter)`` pairs the optimizer steps, in a fixed order."""
    return list(wrapped.param_and_grad_buffer.optimizer_named_parameters)


def fsdp_tensor_spec(pgb: Any, param: Any, dist_index: Any, *, is_sharded_param: bool, is_expert_param: bool) -> Any:
    """``(mesh, placements)`` Megatron-FSDP gives a parameter's distributed DTensor.

    ``pgb`` is the ``param_and_grad_buffer`` module of either Megatron-FSDP copy (its private
    ``_get_fsdp_tensor_spec``; same signature in megatron-fsdp 0.6.1 and megatron-core 0.16.1).
    """
    return pgb._get_fsdp_tensor_spec(
        param, dist_index, is_sharded_param=is_sharded_param, is_expert_param=is_expert_param
    )


def raw_parameters(wrapped: Any) -> list[Any]:
    """The parameters the wrapped module computes with (``wrapped.raw_param``, by FQN order)."""
    return list(wrapped.raw_param.values())


def attached_main_grads(wrapped: Any) -> dict[Any, Any]:
    """The distributed main-gradient DTensors Megatron-FSDP attaches after a backward."""
    return wrapped.param_and_grad_buffer.dist_main_grad


def has_local_data(t: Any) -> bool:
    """Whether a Megatron-FSDP DTensor has local data attached (``_local_tensor`` is set)."""
    return local_tensor(t) is not None


def install_distributed_params(wrapped: Any) -> None:
    """Make the module's parameters the distributed DTensors (idempotent in 0.6.1)."""
    wrapped._replace_param_with_distributed_if_needed()


def disable_grad_div_fusion(wrapped: Any) -> None:
    """Scale, then SUM (gloo has no PREMUL_SUM): Megatron-FSDP's own fallback path."""
    wrapped.ddp_config.gradient_reduce_div_fusion = False


def chunk_offsets(param: Any, package: ModuleType) -> tuple[int, ...]:
    """Global offsets of a distributed parameter's local tensor, as Megatron-FSDP records them.

    Read from the chunk metadata on the local tensor, or (``no_shard`` parameters carry none)
    computed with the gather of ``package`` (the copy that made ``param``): a collective then.
    """
    chunk_list = getattr(local_tensor(param), "__create_chunk_list__", None)
    if chunk_list is not None:
        meta = chunk_list()[0]
    else:
        uneven = importlib.import_module(f"{package.__name__}.uneven_dtensor")
        meta = uneven.gather_and_compute_chunk_metadata(param)
    return tuple(int(o) for o in meta.offsets)


class _NoTELinear:
    """Stands for ``TELinear`` when Transformer Engine is not installed: no module is one."""


def fix_missing_te_linear() -> bool:
    """Make megatron-core's ``FullyShardedDataParallel`` constructible without Transformer Engine (0.16.1 bug).

    ``mcore_fsdp_adapter._fix_tensor_parallel_attributes`` runs ``isinstance(m, (TELinear,))``
    for every module when TP > 1, and without Transformer Engine ``TELinear`` is not a class
    (megatron.core stubs the missing ``transformer_engine`` with a MagicMock): a TypeError, on
    CPU and GPU alike, for every local-spec (non-TE) model. The module global is replaced by a
    class nothing is an instance of, which is what "no TELinear" means there. Does nothing when
    TE is installed.

    Returns:
        Whether the placeholder is in place.
    """
    require_megatron_core()
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    if not isinstance(mcore_fsdp_adapter.TELinear, type):
        mcore_fsdp_adapter.TELinear = _NoTELinear
    return mcore_fsdp_adapter.TELinear is _NoTELinear


def fix_missing_te_router_gemm() -> bool:
    """Make megatron-core's MoE router run without Transformer Engine (0.16.1 bug).

    ``transformer/moe/moe_utils.py`` imports ``te_general_gemm`` inside ``try: import
    transformer_engine`` and binds nothing in the ``except ImportError``, so
    ``RouterGatingLinearFunction.forward`` (``if te_general_gemm is not None``, line 1192)
    raises ``NameError: name 'te_general_gemm' is not defined`` in every MoE router forward of
    a model built without TE, on CPU and GPU alike. Binding the name to None selects the
    torch ``mm`` path right after that test, which is what the code means without TE. Does
    nothing when TE is installed (the name is bound).

    Returns:
        Whether the router runs its torch path (the name is None).
    """
    require_megatron_core()
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return moe_utils.te_general_gemm is None
