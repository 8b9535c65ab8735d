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
from shardbridge.adapters import install_hint

__all__ = ["INSTALL_HINT", "grouped_linear_params", "parse_version", "te_pytorch", "te_recipes", "te_version"]

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


def grouped_linear_params(module: object) -> dict[str, tuple[str, ...]]:
    """A GroupedLinear's per-GEMM parameter names: ``{"weight": ("weight0", ...), "bias": (...)}``.

    TE 2.x registers ``weight{i}`` (and ``bias{i}`` with ``bias=True``) for ``i < num_gemms``
    (``module/grouped_linear.py``); with ``bias=False`` the ``bias{i}`` are empty tensors, not
    parameters. ``single_grouped_weight`` / ``single_grouped_bias`` (TE 2.20: experimental, gated
    by ``NVTE_GROUPED_LINEAR_SINGLE_PARAM``, CUDA-only grouped-tensor path) register ONE
    ``weight`` / ``bias`` instead.

    Raises:
        NotImplementedError: single grouped parameters.
        ValueError: a ``weight{i}`` that is not a parameter (a TE whose GroupedLinear changed).
    """
    name = type(module).__name__
    if getattr(module, "single_grouped_weight", False) or getattr(module, "single_grouped_bias", False):
        raise NotImplementedError(
            f"{name}(single_grouped_weight/single_grouped_bias=True) holds one GroupedTensor parameter; "
            "experts on the ep axis are supported with TE's per-GEMM parameters (weight0, weight1, ...): "
            "build it with single_grouped_weight=False, single_grouped_bias=False"
        )
    params = module._parameters  # type: ignore[attr-defined]
    num = int(module.num_gemms)  # type: ignore[attr-defined]
    groups = {"weight": tuple(f"weight{i}" for i in range(num))}
    if getattr(module, "use_bias", False):
        groups["bias"] = tuple(f"bias{i}" for i in range(num))
    for names in groups.values():
        absent = [n for n in names if params.get(n) is None]
        if absent:
            raise ValueError(
                f"{name} has no parameters {absent[:3]}: not TE 2.x's per-GEMM GroupedLinear layout "
                f"(checked on TE 2.8-2.20); parameters: {list(params)[:6]}"
            )
    return groups
