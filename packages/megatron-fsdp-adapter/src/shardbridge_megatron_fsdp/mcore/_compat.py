"""Version probes and megatron.core private names for the Megatron-Core path, in one place.

Supported: ``megatron-core>=0.16.1,<0.17`` (the ``megatron-core`` extra; 0.16.1 is the newest
release for Python 3.11). Megatron-Core bundles its own copy of Megatron-FSDP
(``megatron.core.distributed.fsdp.src.megatron_fsdp``); this subpackage never imports the
standalone ``megatron_fsdp`` package, which must not be installed beside megatron-core
(see [Note: megatron-core beside megatron-fsdp] in ``shardbridge_megatron_fsdp._compat``).

Every private megatron.core name the subpackage reads is read here (checked against 0.16.1).
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from shardbridge._compat import local_tensor, parse_version
from shardbridge._extras import install_hint

__all__ = [
    "INSTALL_HINT",
    "MAX_VERSION",
    "MIN_VERSION",
    "bundled_fsdp",
    "chunk_offsets",
    "fix_missing_te_linear",
    "megatron_core_version",
    "optimizer_named_parameters",
    "require_megatron_core",
    "replace_params_with_distributed",
]

MIN_VERSION = (0, 16, 1)
MAX_VERSION = (0, 17, 0)  # exclusive
INSTALL_HINT = install_hint("megatron-core")  # [Note: install hints] in shardbridge/_extras.py


@functools.cache
def megatron_core_version() -> tuple[int, ...]:
    """The installed megatron-core version as a tuple, after checking it is supported.

    Raises:
        ImportError: megatron-core missing or outside [0.16.1, 0.17) (with the install hint).
    """
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(
            f"shardbridge_megatron_fsdp.mcore needs megatron-core; install it with {INSTALL_HINT}"
        ) from None
    parsed = parse_version(version)
    if not MIN_VERSION <= parsed < MAX_VERSION:
        raise ImportError(
            f"megatron-core {version} is not supported by shardbridge_megatron_fsdp.mcore (needs >=0.16.1,<0.17); "
            f"install a supported version with {INSTALL_HINT}"
        )
    return parsed


def require_megatron_core() -> Any:
    """Import and return ``megatron.core`` after the version check."""
    megatron_core_version()
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE) .*not installed.*")
        warnings.filterwarnings("ignore", message=".*Falling back to Torch Norm.*")
        import megatron.core

    return megatron.core


def bundled_fsdp() -> Any:
    """Megatron-Core's bundled Megatron-FSDP package (``...distributed.fsdp.src.megatron_fsdp``)."""
    require_megatron_core()
    from megatron.core.distributed.fsdp.src import megatron_fsdp

    return megatron_fsdp


# -- megatron_fsdp (bundled copy) internals, as in the standalone adapter's _compat -----------


def chunk_offsets(param: Any) -> tuple[int, ...]:
    """Global offsets of a distributed parameter's local tensor, from Megatron-FSDP's chunk metadata."""
    chunk_list = getattr(local_tensor(param), "__create_chunk_list__", None)
    if chunk_list is not None:
        meta = chunk_list()[0]
    else:  # no_shard parameters carry no chunk metadata: Megatron-FSDP's own gather (a collective)
        from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
            gather_and_compute_chunk_metadata,
        )

        meta = gather_and_compute_chunk_metadata(param)
    return tuple(int(o) for o in meta.offsets)


def optimizer_named_parameters(inner: Any) -> list[tuple[str, Any]]:
    """``(fqn, distributed DTensor)`` pairs of a (bundled) ``MegatronFSDP`` module."""
    return list(inner.param_and_grad_buffer.optimizer_named_parameters)


def replace_params_with_distributed(inner: Any) -> None:
    """Make the module's parameters the distributed DTensors (idempotent)."""
    inner._replace_param_with_distributed_if_needed()


class _NoTELinear:
    """Stands for ``TELinear`` when Transformer Engine is not installed: no module is one."""


def fix_missing_te_linear() -> bool:
    """Make ``FullyShardedDataParallel`` constructible without Transformer Engine (0.16.1 bug).

    ``mcore_fsdp_adapter._fix_tensor_parallel_attributes`` runs ``isinstance(m, (TELinear,))``
    for every module when TP > 1, and without Transformer Engine ``TELinear`` is not a class
    (megatron.core stubs the missing ``transformer_engine`` with a MagicMock): a TypeError, on CPU and GPU alike, for every local-spec (non-TE) model. The module global is
    replaced by a class nothing is an instance of, which is what "no TELinear" means there.
    Does nothing when TE is installed.

    Returns:
        Whether the placeholder is in place.
    """
    require_megatron_core()
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter

    if not isinstance(mcore_fsdp_adapter.TELinear, type):
        mcore_fsdp_adapter.TELinear = _NoTELinear
    return mcore_fsdp_adapter.TELinear is _NoTELinear
