"""The FP8 backend protocol and its registry: how a framework's FP8 plugs into the core.

[Note: the FP8 backend protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An FP8 backend turns an :class:`~shardbridge.fp8.FP8Recipe` into a framework's modules and
keeps them right through training. Every step of a run calls one hook::

    check(recipe, tp=)              validate at the boundary (ValueError / NotImplementedError
                                     naming what the backend supports)
    convert(model, recipe, ...)     swap modules BEFORE tensor parallelism and FSDP; may apply
                                     TP itself (TE: its own TP modules) -> Converted.tp_done
    tp_styles(recipe)               ParallelStyles for converted modules (None = torch's)
    after_fsdp(model, mesh, recipe) FSDP2 all-gather hooks (uint8 on gloo), first scales,
                                     forward autocast
    after_optimizer_step(model, r)  e.g. recompute per-tensor scales (torchao tensorwise)
    after_load(model, recipe)       the weights changed: same as after a step
    model_init_context(recipe)      context to BUILD the model in (TE FP8 parameters)
    register_plain_types()          the checkpoint rule: each FP8 tensor subclass -> plain
                                     high-precision tensor (see [Note: portable FP8 checkpoints])

Adapters call the module functions here (:func:`convert`, :func:`after_optimizer_step`, ...),
which look the backend up by the recipe's name; no adapter branches on a backend name.
:func:`convert` marks every module it converted (:func:`converted_fqn`): exactly those take
the backend's ``tp_styles`` (no test of a class name), and shardbridge's own marks on a module
(fused-weight specs) are carried over when a backend swaps the module for another class.
Backends register by name: the core's torchao backend at import (torchao itself is imported
lazily, on first use), others by :func:`register_backend` when their package is imported, or
through the ``shardbridge.fp8_backends`` entry-point group (``te = "shardbridge_te._fp8:backend"``)
so that an adapter can use a backend another adapter provides without importing it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn

from shardbridge._extras import install_hint
from shardbridge.fp8._recipe import FP8Recipe

if TYPE_CHECKING:
    from shardbridge._mesh import ParallelMesh

__all__ = [
    "ENTRY_POINT_GROUP",
    "Converted",
    "FP8Backend",
    "FP8BackendBase",
    "after_fsdp",
    "after_load",
    "after_optimizer_step",
    "backend_names",
    "convert",
    "converted_fqn",
    "get_backend",
    "install_step_hook",
    "model_init_context",
    "recipe_of",
    "register_backend",
]

ENTRY_POINT_GROUP = "shardbridge.fp8_backends"
"""Entry-point group where installed packages declare FP8 backends (``name = "module:attr"``)."""

_RECIPE_ATTR = "_shardbridge_fp8_recipe"
"""Attribute on a converted model: the :class:`FP8Recipe` it was converted with."""


@dataclass(frozen=True, kw_only=True)
class Converted:
    """What :meth:`FP8Backend.convert` did to a model."""

    modules: tuple[str, ...]
    """FQNs of the modules that now compute in FP8."""

    tp_done: tuple[str, ...] = ()
    """FQNs whose tensor parallelism the backend applied itself (e.g. TE modules built with
    ``tp_size`` and given DTensor parameters); the adapter's TP pass must leave them alone."""


@runtime_checkable
class FP8Backend(Protocol):
    """An FP8 implementation the core can drive. See [Note: the FP8 backend protocol]."""

    name: str
    """The name recipes use (``FP8Recipe.backend``)."""

    recipes: tuple[str, ...]
    """Recipe names (``FP8Recipe.NAMES``) this backend runs."""

    def check(self, recipe: FP8Recipe, *, tp: int = 1) -> None:
        """Raise ValueError / NotImplementedError naming what is supported."""

    def require_runtime(self) -> None:
        """Raise ImportError (with the install hint) unless the backend's library imports here."""

    def convert(
        self,
        model: nn.Module,
        recipe: FP8Recipe,
        *,
        mesh: ParallelMesh | None = None,
        tp_plan: Mapping[str, str] | None = None,
        module_filter: Callable[[nn.Module, str], bool] | None = None,
    ) -> Converted:
        """Swap ``model``'s modules for FP8 ones, before TP and FSDP."""

    def tp_styles(self, recipe: FP8Recipe) -> Mapping[str, type] | None:
        """``{"colwise": cls, "rowwise": cls}`` for converted modules; None = torch's styles."""

    def after_fsdp(self, model: nn.Module, mesh: ParallelMesh, recipe: FP8Recipe) -> None:
        """After ``fully_shard``: all-gather hooks, first scales, forward autocast."""

    def after_optimizer_step(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """After every optimizer step."""

    def after_load(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """After a checkpoint load into ``model``."""

    def model_init_context(self, recipe: FP8Recipe) -> contextlib.AbstractContextManager:
        """Context to build the model in (FP8 parameters), or a no-op."""

    def register_plain_types(self) -> tuple[type, ...]:
        """Register the backend's FP8 tensor subclasses with ``register_fp8_tensor_type``."""


class FP8BackendBase:
    """Defaults for :class:`FP8Backend`: nothing to do after FSDP, steps and loads; no TP styles.

    Subclasses set :attr:`name` and :attr:`recipes` and implement :meth:`convert`.
    """

    name: str = ""
    recipes: tuple[str, ...] = ()

    def check(self, recipe: FP8Recipe, *, tp: int = 1) -> None:
        """ValueError unless ``recipe.name`` is one of :attr:`recipes`."""
        if recipe.name not in self.recipes:
            raise ValueError(
                f"fp8 recipe {recipe.name!r} is not supported by backend {self.name!r}; it supports "
                f"{list(self.recipes)}" + _others_hint(recipe.name, self.name)
            )

    def require_runtime(self) -> None:
        """Nothing to import (subclasses whose library may be missing override it)."""

    def convert(self, model: nn.Module, recipe: FP8Recipe, **kwargs: Any) -> Converted:
        """Subclasses implement it."""
        raise NotImplementedError(f"FP8 backend {self.name!r} does not implement convert")

    def tp_styles(self, recipe: FP8Recipe) -> Mapping[str, type] | None:
        """None: converted modules take torch's ``ColwiseParallel`` / ``RowwiseParallel``."""
        return None

    def after_fsdp(self, model: nn.Module, mesh: ParallelMesh, recipe: FP8Recipe) -> None:
        """Nothing."""

    def after_optimizer_step(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """Nothing."""

    def after_load(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """Nothing."""

    def model_init_context(self, recipe: FP8Recipe) -> contextlib.AbstractContextManager:
        """No-op context."""
        return contextlib.nullcontext()

    def register_plain_types(self) -> tuple[type, ...]:
        """Nothing to register."""
        return ()


_BACKENDS: dict[str, FP8Backend] = {}


def register_backend(backend: FP8Backend) -> None:
    """Make ``backend`` available as ``FP8Recipe(backend=backend.name)`` (replaces one of that name).

    Raises:
        ValueError: ``backend`` does not implement :class:`FP8Backend`.

    Example:
        >>> class Mine(FP8BackendBase):
        ...     name, recipes = "mine", ("tensorwise",)
        >>> register_backend(Mine())
        >>> "mine" in backend_names()
        True
        >>> unregister = _BACKENDS.pop("mine")
    """
    if not isinstance(backend, FP8Backend) or not isinstance(getattr(backend, "name", None), str) or not backend.name:
        raise ValueError(
            f"register_backend: {backend!r} does not implement shardbridge.fp8.FP8Backend (a name and the hooks; "
            "subclass FP8BackendBase)"
        )
    _BACKENDS[backend.name] = backend


def _entry_points() -> dict[str, metadata.EntryPoint]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> tuple[str, ...]:
    """Registered backends plus those installed packages declare (not imported by this call)."""
    return tuple(sorted(set(_BACKENDS) | set(_entry_points())))


def _is_known(name: str) -> bool:
    """``name`` is registered or declared by an installed package's entry point (nothing imported)."""
    return name in _BACKENDS or name in _entry_points()


def get_backend(name: str) -> FP8Backend:
    """The backend registered as ``name`` (loading its entry point on first use).

    Raises:
        ValueError: no such backend; the message lists the available ones and the install hint.
        ImportError: the backend's package is declared but cannot be imported (its own hint).
    """
    if name not in _BACKENDS:
        ep = _entry_points().get(name)
        if ep is not None:
            loaded = ep.load()
            register_backend(loaded() if isinstance(loaded, type) else loaded)
    if name not in _BACKENDS:
        hint = f" (on a GPU machine: {install_hint('te')}; then import shardbridge_te)" if name == "te" else ""
        raise ValueError(f"fp8 backend {name!r} is not available; available: {list(backend_names())}{hint}")
    return _BACKENDS[name]


def _others_hint(recipe_name: str, this: str) -> str:
    others = []
    for name in backend_names():
        try:
            if name != this and recipe_name in get_backend(name).recipes:
                others.append(name)
        except (ImportError, ValueError):  # a declared backend that does not load: not a suggestion
            continue
    return f"; backend(s) {others} run {recipe_name!r}" if others else ""


def recipe_of(model: nn.Module) -> FP8Recipe | None:
    """The recipe ``model`` was converted with by :func:`convert`, or None."""
    return vars(model).get(_RECIPE_ATTR)


def convert(
    model: nn.Module,
    recipe: FP8Recipe,
    *,
    mesh: ParallelMesh | None = None,
    tp_plan: Mapping[str, str] | None = None,
    module_filter: Callable[[nn.Module, str], bool] | None = None,
) -> Converted:
    """Convert ``model`` for ``recipe`` with its backend. Call BEFORE tensor parallelism and FSDP.

    Args:
        model: the model (high-precision ``nn.Linear`` layers, or the backend's own modules).
        recipe: what to run (usually ``policy.fp8``).
        mesh: the run's mesh; a backend that applies TP itself needs it.
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
    backend.check(recipe, tp=1 if mesh is None else mesh.dims.tp)
    backend.register_plain_types()
    # shardbridge's own marks on modules (fused-weight specs, ...) survive a backend that swaps
    # the module for another class (torchao's Float8Linear.from_float builds a new module).
    marks = {fqn: _marks(m) for fqn, m in model.named_modules()}
    done = backend.convert(model, recipe, mesh=mesh, tp_plan=tp_plan, module_filter=module_filter)
    vars(model)[_RECIPE_ATTR] = recipe
    for fqn in done.modules:  # each converted module knows it (TP styles: converted_fqn)
        module = model.get_submodule(fqn)
        for key, value in marks.get(fqn, {}).items():
            vars(module).setdefault(key, value)
        vars(module)[_CONVERTED_ATTR] = fqn
    return done


def _marks(module: nn.Module) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if k.startswith("_shardbridge_")}


_CONVERTED_ATTR = "_shardbridge_fp8_fqn"
"""Attribute on each module :func:`convert` converted: its FQN in the converted model."""


def converted_fqn(module: nn.Module) -> str | None:
    """The FQN under which :func:`convert` converted ``module`` (``Converted.modules``), or None.

    Adapters give exactly these modules the backend's ``tp_styles`` (no backend-name or class-name test).
    """
    return vars(module).get(_CONVERTED_ATTR)


def _converted_recipe(model: nn.Module, recipe: FP8Recipe | None, what: str) -> FP8Recipe | None:
    have = recipe_of(model)
    if recipe is not None and have != recipe:
        raise ValueError(
            f"{what}: policy.fp8={recipe} but the model was "
            + ("not converted" if have is None else f"converted for {have}")
            + "; call shardbridge.fp8.convert(model, policy.fp8) before tensor parallelism and apply_fsdp"
        )
    return have


def after_fsdp(model: nn.Module, mesh: ParallelMesh, recipe: FP8Recipe | None = None) -> None:
    """The backend's after-FSDP work (``apply_fsdp`` calls it when ``policy.fp8`` is set).

    Raises:
        ValueError: ``recipe`` given and the model was not converted for it.
    """
    have = _converted_recipe(model, recipe, "apply_fsdp")
    if have is not None:
        get_backend(have.backend).after_fsdp(model, mesh, have)


def after_optimizer_step(model: nn.Module) -> None:
    """The backend's after-step work for a converted model; nothing for others."""
    have = recipe_of(model)
    if have is not None:
        get_backend(have.backend).after_optimizer_step(model, have)


def after_load(model: nn.Module) -> None:
    """The backend's after-load work for a converted model (scales from the loaded weights)."""
    have = recipe_of(model)
    if have is not None:
        get_backend(have.backend).after_load(model, have)


def model_init_context(recipe: FP8Recipe | None) -> contextlib.AbstractContextManager:
    """Context to build the model in for ``recipe`` (TE FP8 parameters); a no-op for None."""
    if recipe is None:
        return contextlib.nullcontext()
    backend = get_backend(recipe.backend)
    backend.check(recipe)
    return backend.model_init_context(recipe)


def install_step_hook(optimizer: Any, model: nn.Module) -> Any:
    """Run :func:`after_optimizer_step` after every step of ``optimizer``.

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
    return inner.register_step_post_hook(lambda *_args, **_kwargs: after_optimizer_step(model))
