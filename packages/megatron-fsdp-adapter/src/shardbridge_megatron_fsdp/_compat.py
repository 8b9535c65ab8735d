"""Version probes for megatron-fsdp, in one place (cached).

Supported: ``megatron-fsdp>=0.6.1,<0.7`` (the range of the ``megatron`` extra). Megatron-FSDP
0.6.1 is the ``megatron_fsdp`` package of Megatron-LM core_r0.19.0.

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
from collections.abc import Iterator, Mapping
from typing import Any

from shardbridge._compat import local_tensor, parse_version
from shardbridge._extras import install_hint

__all__ = [
    "INSTALL_HINT",
    "MAX_VERSION",
    "MIN_VERSION",
    "attached_main_grads",
    "chunk_offsets",
    "disable_grad_div_fusion",
    "fsdp_tensor_spec",
    "fully_shard_model",
    "has_local_data",
    "install_distributed_params",
    "is_fp8_parameter",
    "megatron_core_version",
    "megatron_fsdp_version",
    "optimizer_named_parameters",
    "parameter_groups",
    "raw_parameters",
    "require_megatron_fsdp",
]

MIN_VERSION = (0, 6, 1)
MAX_VERSION = (0, 7, 0)  # exclusive
INSTALL_HINT = install_hint("megatron")  # [Note: install hints] in shardbridge/_extras.py


def megatron_core_version() -> str | None:
    """The installed megatron-core version, or None when ``megatron.core`` is not importable."""
    try:
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return None
    except (ImportError, ValueError):
        return None
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


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
    try:
        version = importlib.metadata.version("megatron-fsdp")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"shardbridge_megatron_fsdp needs megatron-fsdp; install it with {INSTALL_HINT}") from None
    parsed = parse_version(version)
    if not MIN_VERSION <= parsed < MAX_VERSION:
        raise ImportError(
            f"megatron-fsdp {version} is not supported by shardbridge_megatron_fsdp (needs >=0.6.1,<0.7); "
            f"install a supported version with {INSTALL_HINT}"
        )
    _check_megatron_core()
    return parsed


def _check_megatron_core() -> None:
    core = megatron_core_version()
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


# -- megatron_fsdp internals (checked against megatron-fsdp 0.6.1) ----------------------------
# MegatronFSDP exposes no public accessor for its buffers or distributed parameters; every
# attribute below is read here and nowhere else in the adapter.


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


def chunk_offsets(param: Any) -> tuple[int, ...]:
    """Global offsets of a distributed parameter's local tensor, as Megatron-FSDP records them.

    Read from the chunk metadata on the local tensor, or (``no_shard`` parameters carry none)
    computed with megatron_fsdp's own gather: a collective in that case.
    """
    chunk_list = getattr(local_tensor(param), "__create_chunk_list__", None)
    if chunk_list is not None:
        meta = chunk_list()[0]
    else:
        from megatron_fsdp.uneven_dtensor import gather_and_compute_chunk_metadata

        meta = gather_and_compute_chunk_metadata(param)
    return tuple(int(o) for o in meta.offsets)
