"""Driving a backend: convert a model before TP and FSDP, refresh it after its weights change.

The functions here are what adapters and users call (see [Note: the FP8 backend protocol] in
``_recipe.py``); each looks the backend up by the recipe's name. A converted model remembers
its conversion (:func:`recipe_of`, :func:`converted`), and each converted module its FQN
(:func:`converted_fqn`): exactly those modules take the backend's TP styles, with no test of a
class or backend name anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from shardbridge._checks import checked_args
from shardbridge._mesh import ParallelMesh
from shardbridge.fp8._recipe import Converted, FP8Recipe, get_backend

__all__ = ["convert", "converted", "converted_fqn", "install_step_hook", "recipe_of", "refresh"]

_RECIPE_ATTR = "_shardbridge_fp8_recipe"
"""Attribute on a converted model: the :class:`FP8Recipe` it was converted with."""
_CONVERTED_ATTR = "_shardbridge_fp8_converted"
"""Attribute on a converted model: the backend's :class:`Converted`."""
_FQN_ATTR = "_shardbridge_fp8_fqn"
"""Attribute on each module :func:`convert` converted: its FQN in the converted model."""


def recipe_of(model: nn.Module) -> FP8Recipe | None:
    """The recipe ``model`` was converted with by :func:`convert`, or None."""
    return vars(model).get(_RECIPE_ATTR)


def converted(model: nn.Module) -> Converted | None:
    """What :func:`convert` did to ``model`` (modules, TP done, TP styles), or None."""
    return vars(model).get(_CONVERTED_ATTR)


def converted_fqn(module: nn.Module) -> str | None:
    """The FQN under which :func:`convert` converted ``module`` (``Converted.modules``), or None.

    Adapters give exactly these modules ``Converted.tp_styles`` (no backend-name or class-name test).
    """
    return vars(module).get(_FQN_ATTR)


@checked_args(model=nn.Module, recipe=FP8Recipe, mesh=(ParallelMesh, None))
def convert(
    model: nn.Module,
    recipe: FP8Recipe,
    *,
    mesh: ParallelMesh | None = None,
    tp_plan: Mapping[str, str] | None = None,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
) -> Converted:
    """Convert ``model`` for ``recipe`` with its backend. Call BEFORE tensor parallelism and FSDP.

    Then parallelize (``parallelize_llama``, or TP with ``Converted.tp_styles`` for the converted
    modules, then ``apply_fsdp``) and call :func:`refresh` once (the first scales of torchao's
    tensorwise recipe); :func:`install_step_hook` keeps it up to date after every step.

    Args:
        model: the model (high-precision ``nn.Linear`` layers, or the backend's own modules).
        recipe: what to run.
        mesh: the run's mesh: a backend that applies TP itself needs it (TE), and TE's FP8
            autocast reduces amaxes over its ``weight`` axis (None: TE's default group).
        tp_plan: ``{module FQN: "colwise" | "rowwise" | ...}``: the adapter's TP plan, for a
            backend that applies TP itself.
        module_filter: ``(module, fqn) -> bool``: which modules to convert (None = the
            backend's default: Linears with dims divisible by 16, the output head excluded).

    Returns:
        :class:`Converted`.

    Raises:
        ValueError: a recipe the backend does not run, or a model converted before.

    Example:
        >>> from shardbridge import fp8  # doctest: +SKIP
        >>> fp8.convert(model, FP8Recipe(name="rowwise")).modules[:1]  # doctest: +SKIP
        ('model.layers.0.self_attn.q_proj',)
    """
    if recipe_of(model) is not None:
        raise ValueError(f"the model was already converted for {recipe_of(model)}; convert once, before TP and FSDP")
    backend = get_backend(recipe.backend)
    backend.check(recipe)
    # shardbridge's own marks on modules (fused-weight specs, ...) survive a backend that swaps
    # the module for another class (torchao's Float8Linear.from_float builds a new module).
    marks = {fqn: _marks(m) for fqn, m in model.named_modules()}
    done = backend.convert(model, recipe, mesh=mesh, tp_plan=tp_plan, module_filter=module_filter)
    vars(model)[_RECIPE_ATTR] = recipe
    vars(model)[_CONVERTED_ATTR] = done
    for fqn in done.modules:  # each converted module knows it (TP styles: converted_fqn)
        module = model.get_submodule(fqn)
        for key, value in marks.get(fqn, {}).items():
            vars(module).setdefault(key, value)
        vars(module)[_FQN_ATTR] = fqn
    return done


def _marks(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k.startswith("_shardbridge_")}


def refresh(model: nn.Module) -> None:
    """The weights of a converted model changed: its backend recomputes what derives from them.

    Call once after the model is parallelized (``parallelize_llama`` and the adapters do) and
    after loading weights into it; :func:`install_step_hook` calls it after every optimizer step.
    torchao tensorwise: every weight's scale from the new weights, one all-reduce. Nothing for a
    model that was not converted.
    """
    have = recipe_of(model)
    if have is not None:
        get_backend(have.backend).refresh(model, have)


def install_step_hook(optimizer: Any, model: nn.Module) -> Any:
    """Run :func:`refresh` after every step of ``optimizer``.

    ``optimizer`` may wrap the torch optimizer (Accelerate's ``AcceleratedOptimizer`` has no
    ``_optimizer_step_post_hooks``, accelerate 1.15): the hook goes on the innermost
    ``torch.optim.Optimizer``.

    Returns:
        The hook handle (``.remove()`` detaches it).

    Raises:
        ValueError: ``optimizer`` is not and wraps no ``torch.optim.Optimizer``.
    """
    inner = optimizer
    # Wrappers (AcceleratedOptimizer subclasses Optimizer without its __init__) hold the real one.
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(
            f"install_step_hook: {type(optimizer).__name__} wraps no torch.optim.Optimizer; pass the optimizer "
            "that steps the model's parameters"
        )
    return inner.register_step_post_hook(lambda *_args, **_kwargs: refresh(model))
