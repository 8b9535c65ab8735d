"""The version policy: one line naming a host-framework version no CI or nox run has checked.

[Note: version policy]
~~~~~~~~~~~~~~~~~~~~~~
torch and transformers have no upper bound in ``pyproject.toml``: pip would otherwise downgrade
a user's newer torch (and pull a multi-GB CUDA build) just to install shardbridge. Instead the
newest versions a CI or nox run passed are written down here and in the adapters (torch:
``shardbridge._compat.TORCH_CHECKED``; transformers: ``shardbridge_hf._compat.TRANSFORMERS_CHECKED``),
and importing shardbridge with a version outside that range gives ONE
:class:`UntestedVersionWarning` naming the package, its version and the checked range (once per
process; silence it with ``warnings.filterwarnings("ignore", category=UntestedVersionWarning)``).
Where running outside the checked range would silently train differently, an adapter's patch
plan refuses instead (accelerate: ``shardbridge_hf._patches``, and the ``<1.16`` bound of the
``hf`` extra; TransformerEngine and megatron-fsdp likewise). docs/testing.md, "Version policy",
lists the ranges and the runs behind them.
"""

from __future__ import annotations

import functools
import warnings

__all__ = ["UntestedVersionWarning", "warn_if_untested"]


class UntestedVersionWarning(UserWarning):
    """A host framework's installed version lies outside the range shardbridge's CI and nox runs checked."""


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache
def warn_if_untested(package: str, installed: tuple[int, ...], checked: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Warn once (per package and version) when ``installed`` lies outside ``checked`` (inclusive).

    Each bound is compared on its own length: ``(5, 24)`` admits every 5.24.x.

    Returns:
        Whether the version is outside the range (and the warning was given).

    Example:
        >>> warn_if_untested("torch", (2, 13, 0), ((2, 11, 0), (2, 15, 0)))
        False
    """
    low, high = checked
    if low <= installed[: len(low)] and installed[: len(high)] <= high:
        return False
    # warn_explicit: one line ("shardbridge:0: UntestedVersionWarning: ..."), not the caller's source line too
    warnings.warn_explicit(
        f"{package} {_fmt(installed)} is untested with shardbridge: its CI and nox runs checked {package} "
        f"{_fmt(low)} .. {_fmt(high)} (docs/testing.md, Version policy)",
        UntestedVersionWarning,
        filename="shardbridge",
        lineno=0,
    )
    return True
