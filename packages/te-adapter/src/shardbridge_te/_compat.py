"""TransformerEngine version probes: the only place the adapter imports TE.

Everything TE-specific is looked up here, once (cached), so the rest of the adapter asks
"which TE is this and what does it have" instead of scattering ``try: import`` blocks.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

from shardbridge._compat import parse_version as core_parse_version
from shardbridge._compat import require_module
from shardbridge.extras import install_hint

__all__ = ["INSTALL_HINT", "parse_version", "te_pytorch", "te_recipes", "te_version"]

INSTALL_HINT = install_hint("te")  # [Note: install hints] in shardbridge/extras.py


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.20.2"`` / ``"2.8.0.dev0+abc"`` -> ``(2, 20, 2)`` / ``(2, 8, 0)`` (the core's parser, padded).

    Example:
        >>> parse_version("2.20.2+cu12")
        (2, 20, 2)
    """
    try:
        version = core_parse_version(text)
    except ValueError:
        version = ()
    if len(version) < 2:
        raise ValueError(f"TransformerEngine version {text!r} is not of the form MAJOR.MINOR[.PATCH]")
    return (*version[:3], 0)[:3]  # type: ignore[return-value]


@functools.cache
def te_pytorch() -> ModuleType:
    """``transformer_engine.pytorch``, imported once.

    Raises:
        ImportError: TE (with its PyTorch extension) is not importable; the message carries
            the install hint and TE's own error.
    """
    return require_module(
        "transformer_engine.pytorch",
        hint=f"shardbridge_te needs TransformerEngine with its PyTorch extension: {INSTALL_HINT} "
        "(on a machine with CUDA; see docs/te.md)",
    )


@functools.cache
def te_recipes() -> ModuleType:
    """``transformer_engine.common.recipe`` (the recipe classes), after :func:`te_pytorch` (the install hint)."""
    te_pytorch()
    return importlib.import_module("transformer_engine.common.recipe")


@functools.cache
def te_version() -> tuple[int, int, int]:
    """The installed TE version as a tuple (imports TE)."""
    te = te_pytorch()
    root = importlib.import_module("transformer_engine")
    text = getattr(root, "__version__", None) or getattr(te, "__version__", None)
    if text is None:
        from importlib import metadata

        text = metadata.version("transformer_engine")
    return parse_version(str(text))
