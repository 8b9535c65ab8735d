"""Version probes for the host frameworks (one place, cached), and the install hint.

Every feature check of shardbridge_hf about accelerate / transformers lives here.
"""

from __future__ import annotations

import functools
import importlib.metadata

__all__ = [
    "accelerate_version",
    "has_replicate_parallel",
    "require_accelerate",
    "transformers_version",
]

_HINT = 'shardbridge_hf needs accelerate and transformers: pip install "shardbridge[hf]"'


@functools.cache
def require_accelerate() -> None:
    """ImportError with the install hint when accelerate or transformers is missing."""
    for name in ("accelerate", "transformers"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"{_HINT} ({name} is not installed)") from None


@functools.cache
def accelerate_version() -> tuple[int, ...]:
    """accelerate's version as a tuple of ints (release part only)."""
    return _parse(importlib.metadata.version("accelerate"))


@functools.cache
def transformers_version() -> tuple[int, ...]:
    """transformers' version as a tuple of ints (release part only)."""
    return _parse(importlib.metadata.version("transformers"))


@functools.cache
def has_replicate_parallel() -> bool:
    """Whether transformers still has ``ReplicateParallel`` (removed in 5.1; upstream bug 1)."""
    try:
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    except ImportError:
        return False
    return True


def _parse(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split("."):
        digits = "".join(c for c in part if c.isdigit())
        if not digits:
            break
        out.append(int(digits))
        if not part.isdigit():
            break
    return tuple(out)
