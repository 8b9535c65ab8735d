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

import dataclasses
import functools
import importlib.metadata
import importlib.util

__all__ = [
    "INSTALL_HINT",
    "MAX_VERSION",
    "MIN_VERSION",
    "megatron_core_version",
    "megatron_fsdp_version",
    "require_megatron_fsdp",
]

MIN_VERSION = (0, 6, 1)
MAX_VERSION = (0, 7, 0)  # exclusive
INSTALL_HINT = 'pip install "shardbridge[megatron]"'


def _parse(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = ""
        for ch in piece:  # leading digits only: "1rc2" -> 1
            if not ch.isdigit():
                break
            digits += ch
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


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
    parsed = _parse(version)
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
