"""Version probes for the host frameworks (one place, cached), and the install hint.

Every feature check of shardbridge_hf about accelerate / transformers lives here.
"""

from __future__ import annotations

import functools
import importlib.metadata
from typing import Any

from shardbridge._compat import parse_version
from shardbridge.adapters import install_hint, warn_if_untested

__all__ = [
    "TRANSFORMERS_CHECKED",
    "WeightConversion",
    "accelerate_version",
    "accelerator_models",
    "accelerator_schedulers",
    "enable_activation_checkpointing",
    "has_replicate_parallel",
    "init_module_buffers",
    "no_split_modules",
    "rename_checkpoint_keys",
    "require_accelerate",
    "transformers_version",
]

_HINT = f"shardbridge_hf needs accelerate and transformers: {install_hint('hf')}"


TRANSFORMERS_CHECKED = ((5, 0), (5, 24))
"""Oldest and newest transformers the hf matrix (noxfile.py HF_MATRIX) and CI ran, inclusive; each
bound admits its patch releases. Outside: one UntestedVersionWarning ([Note: version policy] in the
core's ``shardbridge._extras``). accelerate's range is its patch plan's (``_patches._CHECKED``), which refuses."""


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


# -- transformers' weight conversion while loading (core_model_loading, conversion_mapping) ------


class WeightConversion:
    """What transformers does to one checkpoint key while loading (``from_pretrained``).

    ``target``: the model name it lands in; ``converter``: None for a plain rename, else the
    ``WeightConverter`` that merges it (its ``operations``, ``source_patterns``); ``component``:
    the index of the converter's source pattern that matched (the order of a concatenation);
    ``expert``: the number the pattern's ``*`` matched (the expert index), or None.
    Checked: transformers 5.24 (the transforms came in 5.0).
    """

    __slots__ = ("component", "converter", "expert", "target")

    def __init__(self, target: str, converter: Any = None, component: int = 0, expert: int | None = None) -> None:
        self.target, self.converter, self.component, self.expert = target, converter, component, expert


def rename_checkpoint_keys(model: Any, keys: list[str]) -> dict[str, WeightConversion]:
    """``{checkpoint key: WeightConversion}`` with transformers' own renaming rules for ``model``.

    Uses ``transformers.conversion_mapping.get_model_conversion_mapping`` and
    ``transformers.core_model_loading.rename_source_key``, as ``from_pretrained`` does: every
    ``WeightRenaming`` in turn, then at most one ``WeightConverter``, then the base-model prefix.
    transformers without a conversion mapping: every key maps to itself.
    """
    import re

    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, apply_renamings, rename_source_key
    except ImportError:
        return {k: WeightConversion(k) for k in keys}
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(model.state_dict(keep_vars=True), True)
    prefix = getattr(model, "base_model_prefix", None) or None
    out = {}
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is None:
            out[key] = WeightConversion(target)
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        expert = None
        if pattern.count("*.") == 1:
            # transformers' patterns are regexes whose "*." reads ".*\." (WeightTransform.__init__):
            # here the number it matched, the expert index.
            match = re.search(pattern.replace("*.", r"(\d+)\."), apply_renamings(key, renamings))
            expert = int(match.group(1)) if match else None
        out[key] = WeightConversion(target, converter, converter.source_patterns.index(pattern), expert)
    return out
