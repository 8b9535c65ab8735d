"""TransformerEngine FP8 under FSDP2 (GPU only; its wiring is checked on CPU by the structural tier).

[Note: TE FP8 never applied under FSDP2 (upstream bug 5)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Accelerate 1.15 (``_prepare_te``) swaps ``nn.Linear`` for ``te.Linear`` but, on the FSDP2
path, never wraps forward in ``fp8_autocast`` -- the layers run in high precision -- and has
no way to ask for FP8 parameters (accelerate #3710, PR #3585). shardbridge_hf:

- converts the Linears with Accelerate's own ``convert_model`` (before TP / FSDP),
- wraps the model's ``forward`` in ``te.pytorch.fp8_autocast(enabled=True, fp8_recipe=...)``
  with the recipe built from the yaml block (``amax_history_length`` etc., upstream bug 7),
- with ``fp8.fp8_params: true`` offers :func:`model_init_context` (TE's
  ``quantized_model_init``) for building the model, so the weights themselves are FP8.

TransformerEngine cannot be imported without CUDA (see docs/te.md: TE needs its compiled
extension). On CPU, ``integration_tests/test_hf_te_fp8_structural.py`` imports TE's real Python
code with the extension stood in and checks the wiring (te.Linear under FSDP2, FP8 enabled at
forward, the yaml's recipe); FP8 numerics are exercised on GPU machines only. TE Linear under
TP (tp > 1) is not supported here: torch's ``ColwiseParallel`` accepts only ``nn.Linear``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from shardbridge._compat import require_module
from torch import nn

if TYPE_CHECKING:
    from shardbridge_hf._config import FP8Config

__all__ = [
    "apply_fp8_autocast",
    "build_recipe",
    "check_te_model",
    "model_init_context",
    "remove_fp8_autocast",
    "require_te",
]


def require_te() -> Any:
    """``transformer_engine.pytorch``, or ImportError with the install hint."""
    return require_module(
        "transformer_engine.pytorch",
        hint='fp8 backend "te" needs TransformerEngine with CUDA: pip install "shardbridge[te]" on a GPU machine; '
        "on CPU use fp8.backend: torchao",
    )


def build_recipe(fp8: FP8Config) -> Any:
    """The TE recipe object for ``fp8`` (DelayedScaling or Float8CurrentScaling)."""
    require_te()
    from transformer_engine.common import recipe as te_recipe

    kwargs = fp8.te_recipe_kwargs()
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    if fp8.recipe == "delayed":
        return te_recipe.DelayedScaling(**kwargs)
    return te_recipe.Float8CurrentScaling(**kwargs)


def check_te_model(model: nn.Module) -> None:
    """Swap the model's ``nn.Linear`` for ``te.Linear`` (Accelerate's converter), before TP/FSDP."""
    require_te()
    from accelerate.utils.transformer_engine import convert_model

    # convert_model copies each weight into the new te.Linear with an in-place copy_, which
    # autograd refuses on a leaf that requires grad; Accelerate's _prepare_te runs it under
    # no_grad too.
    with torch.no_grad():
        convert_model(model, to_transformer_engine=True, _convert_linear=True, _convert_ln=False)


_UNDO_ATTR = "_shardbridge_undo_fp8_autocast"
"""Attribute on a model whose forward :func:`apply_fp8_autocast` wrapped: the undo."""


def apply_fp8_autocast(model: nn.Module, fp8: FP8Config) -> Callable[[], None]:
    """Run ``model.forward`` under ``te.pytorch.fp8_autocast`` with the configured recipe.

    Patch ``te_fp8_autocast`` ([Note: hf patch plan] in ``shardbridge_hf._patches``): gated on
    the accelerate version (RuntimeError outside the checked range), idempotent, and
    reversible: the undo is returned and kept on the model (:func:`remove_fp8_autocast`).

    Returns:
        The undo (restores the identical previous ``forward`` attribute of ``model``).
    """
    from shardbridge_hf import _patches

    _patches.gate("te_fp8_autocast")
    if _UNDO_ATTR in vars(model):
        return vars(model)[_UNDO_ATTR]
    te = require_te()
    recipe = build_recipe(fp8)
    forward = model.forward

    @functools.wraps(forward)
    def fp8_forward(*args: Any, **kwargs: Any) -> Any:
        with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
            return forward(*args, **kwargs)

    restore = _patches.patch_attr(model, "forward", fp8_forward)

    def undo() -> None:
        restore()
        vars(model).pop(_UNDO_ATTR, None)

    vars(model)[_UNDO_ATTR] = undo
    return undo


def remove_fp8_autocast(model: nn.Module) -> bool:
    """Undo :func:`apply_fp8_autocast` on ``model``; returns whether there was anything to undo."""
    undo = vars(model).get(_UNDO_ATTR)
    if undo is None:
        return False
    undo()
    return True


def model_init_context(fp8: FP8Config) -> contextlib.AbstractContextManager:
    """Context to BUILD the model in: FP8 weights with ``fp8_params``, else a no-op.

    Example:
        >>> with model_init_context(cfg.fp8):  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(hf_cfg)
    """
    if fp8.backend != "te" or not fp8.fp8_params:
        return contextlib.nullcontext()
    te = require_te()
    return te.quantized_model_init(enabled=True, recipe=build_recipe(fp8))
