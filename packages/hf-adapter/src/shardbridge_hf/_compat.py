"""Version probes for the host frameworks (one place, cached), and the install hint.

Every feature check of shardbridge_hf about accelerate / transformers lives here.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from shardbridge._compat import parse_version
from shardbridge.extras import install_hint, warn_if_untested

__all__ = [
    "TRANSFORMERS_CHECKED",
    "accelerate_version",
    "accelerator_models",
    "accelerator_schedulers",
    "enable_activation_checkpointing",
    "has_replicate_parallel",
    "init_module_buffers",
    "no_split_modules",
    "require_accelerate",
    "transformers_version",
]

_HINT = f"shardbridge_hf needs accelerate and transformers: {install_hint('hf')}"


TRANSFORMERS_CHECKED = ((5, 0), (5, 24))
"""Oldest and newest transformers the hf matrix (noxfile.py HF_MATRIX) and CI ran, inclusive; each
bound admits its patch releases. Outside: one UntestedVersionWarning ([Note: version policy] in the
core's ``shardbridge.extras``). accelerate's range is its patch plan's (``_patches._CHECKED``), which refuses."""


@functools.cache
def require_accelerate() -> None:
    """ImportError with the install hint when accelerate or transformers is missing.

    Also warns once when the installed transformers lies outside :data:`TRANSFORMERS_CHECKED`.
    """
    for name in ("accelerate", "transformers"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            raise ImportError(f"{_HINT} ({name} is not installed)") from None
    warn_if_untested("transformers", transformers_version(), TRANSFORMERS_CHECKED)


@functools.cache
def accelerate_version() -> tuple[int, ...]:
    """accelerate's version as a tuple of ints (release part only)."""
    return parse_version(importlib.metadata.version("accelerate"))


@functools.cache
def transformers_version() -> tuple[int, ...]:
    """transformers' version as a tuple of ints (release part only)."""
    return parse_version(importlib.metadata.version("transformers"))


@functools.cache
def has_replicate_parallel() -> bool:
    """Whether transformers still has ``ReplicateParallel`` (removed in 5.1; upstream bug 1)."""
    try:
        from transformers.integrations.tensor_parallel import ReplicateParallel  # noqa: F401
    except ImportError:
        return False
    return True


def enable_activation_checkpointing(model: Any) -> None:
    """transformers' own per-decoder-layer checkpointing, non-reentrant (FSDP2 needs that).

    transformers 5.23 names it ``activation_checkpointing_enable`` (``gradient_checkpointing_enable``
    is its deprecated alias); 5.0 has only ``gradient_checkpointing_enable``.

    Raises:
        ValueError: the model does not support it.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"fsdp_config.shardbridge.activation_checkpointing: {type(model).__name__} does not support activation "
            "checkpointing (supports_gradient_checkpointing is False); set it to false"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# -- Accelerate / torchao internals (checked against accelerate 1.10.1-1.15.0, torchao 0.18.0) --


def accelerator_models(accelerator: Any) -> list:
    """``Accelerator._models``: the models ``save_state`` / ``register_for_checkpointing`` see."""
    return accelerator._models


def accelerator_schedulers(accelerator: Any) -> list:
    """``Accelerator._schedulers``: the prepared LR schedulers, in prepare order."""
    return accelerator._schedulers


def init_module_buffers(model: Any, module: Any) -> None:
    """transformers' own initialisation of one module (``PreTrainedModel._init_weights``).

    Used to recompute non-persistent buffers (RoPE ``inv_freq``) of a model built on ``meta``:
    transformers 5.x recomputes every ``*RotaryEmbedding``'s buffers there. Checked: 5.0 .. 5.23.
    """
    init = getattr(model, "_init_weights", None)
    if init is not None:
        init(module)


def no_split_modules(model: Any) -> list[str]:
    """Class names of the blocks transformers never splits (``PreTrainedModel._no_split_modules``).

    The decoder-layer classes, e.g. ``["LlamaDecoderLayer"]``; [] when the model has none.
    Checked: transformers 5.0 .. 5.23.
    """
    return list(getattr(model, "_no_split_modules", None) or [])
