"""The FP8 recipe, and the backends that run one: what can be asked and who runs it.

One module because each needs the other: a recipe names a registered backend (checked when
it is built), and a backend's hooks take a recipe. See [Note: one FP8 recipe] and
[Note: the FP8 backend protocol].

[Note: one FP8 recipe]
~~~~~~~~~~~~~~~~~~~~~~
Users say what they want once: the recipe handed to :func:`shardbridge.fp8.convert` (in code), or
``fsdp_config.shardbridge.fp8`` in an Accelerate yaml::

    FP8Recipe(backend="torchao", name="rowwise")
    FP8Recipe(backend="te", name="delayed", params={"amax_history_len": 16}, fp8_params=True)

The recipe is plain data (JSON-able, no callables) and names no framework object. Its names
are checked here, once, against the one vocabulary below; a backend
(:class:`shardbridge.fp8.FP8Backend`, registered by name) turns it into framework objects
(torchao ``Float8LinearConfig`` / ``MXFP8TrainingOpConfig``, TE ``DelayedScaling`` ...) and
checks what it runs of it (``check``): a recipe or parameter it does not run is a ValueError
naming what it supports. Adapters never branch on the backend's name; they call its hooks.

Recipe names (one vocabulary for every backend)::

    tensorwise          per-tensor current scaling   torchao tensorwise, TE Float8CurrentScaling
    rowwise             per-row scaling, e4m3        torchao rowwise
    rowwise_with_gw_hp  rowwise, weight grad in high precision   torchao
    mxfp8               1x32 blocks, e8m0 scales     torchao MXFP8 training, TE MXFP8BlockScaling
    delayed             per-tensor delayed scaling   TE DelayedScaling
    blockwise           1x128 / 128x128 blocks       TE Float8BlockScaling
    nvfp4               fp4 with fp8 block scales    TE NVFP4BlockScaling

[Note: the FP8 backend protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An FP8 backend is a converter, as in torchtitan (``convert`` + ``post_optimizer_hook``): it
turns an :class:`~shardbridge.fp8.FP8Recipe` into a framework's modules BEFORE tensor
parallelism and FSDP, and keeps what it derives from the weights up to date afterwards. The
FSDP and TP code never asks for it: what a converted model needs from them is data the
conversion returns (:class:`Converted`: the TP styles of the converted modules, those it made
tensor-parallel itself). Four hooks, each with its callers::

    check(recipe)             is the recipe one this backend runs (ValueError /           fp8.convert, the hf yaml block,
                              NotImplementedError naming what it supports); pure          megatron's fp8_ddp_kwargs
    require_runtime()         ImportError with the install hint unless the backend's     `shardbridge launch` (before any
                              library imports on this machine                             process starts)
    convert(model, recipe,    swap the modules; register the checkpoint rule of the      fp8.convert
      mesh=, tp_plan=,        backend's FP8 tensors (see [Note: portable FP8
      module_filter=)         checkpoints]); whatever must wrap the forward (TE's
                              autocast) -> Converted(modules, tp_done, tp_styles)
    refresh(model, recipe)    the weights changed (parallelized, an optimizer step, a    fp8.refresh: the entry points after
                              load): recompute what derives from them (torchao           parallelizing, install_step_hook,
                              tensorwise: the per-tensor scales)                          loads

Adapters call the module functions of ``shardbridge.fp8`` (:func:`~shardbridge.fp8.convert`,
:func:`~shardbridge.fp8.refresh`, ...), which look the backend up by the recipe's name; no
adapter branches on a backend name. Backends register by name: the core's torchao backend at
import (torchao itself is imported lazily, on first use), others by :func:`register_backend`
when their package is imported, or through the ``shardbridge.fp8_backends`` entry-point group
(``te = "shardbridge_te._fp8:backend"``) so that an adapter can use a backend another adapter
provides without importing it.

What the protocol left behind (issue 24, measured against its callers): ``tp_styles`` is
``Converted.tp_styles``; ``register_plain_types`` is part of ``convert``; ``after_fsdp`` split
into TE's autocast (applied by ``convert``), the uint8 all-gather on gloo (every FSDP2 unit
``apply_fsdp`` makes on gloo: [Note: float8 all-gather on gloo] in ``shardbridge._wrap``) and
the first scales (``refresh``); ``after_optimizer_step`` and ``after_load`` are ``refresh``;
``model_init_context`` is TE's alone (``shardbridge_te.model_init_context``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from torch import nn

from shardbridge._extras import install_hint

if TYPE_CHECKING:
    from shardbridge._mesh import ParallelMesh

__all__ = [
    "ENTRY_POINT_GROUP",
    "Converted",
    "FP8Backend",
    "FP8BackendBase",
    "FP8Recipe",
    "backend_names",
    "get_backend",
    "is_known",
    "register_backend",
]

ENTRY_POINT_GROUP = "shardbridge.fp8_backends"
"""Entry-point group where installed packages declare FP8 backends (``name = "module:attr"``)."""


@dataclass(frozen=True, kw_only=True)
class FP8Recipe:
    """Which FP8 backend and scaling recipe to train with, and the recipe's parameters.

    Plain data: the backend (:func:`shardbridge.fp8.get_backend`) validates it and builds
    the framework's objects. See [Note: one FP8 recipe].

    Example:
        >>> FP8Recipe(name="rowwise").backend
        'torchao'
        >>> FP8Recipe(backend="te", name="current").name  # "current" is an alias
        'tensorwise'
    """

    NAMES: ClassVar[tuple[str, ...]] = (
        "tensorwise",
        "rowwise",
        "rowwise_with_gw_hp",
        "mxfp8",
        "delayed",
        "blockwise",
        "nvfp4",
    )
    ALIASES: ClassVar[Mapping[str, str]] = {
        "current": "tensorwise",
        "block_scaled": "blockwise",
        "block-scaled": "blockwise",
    }

    backend: str = "torchao"
    """Registered backend name: "torchao" (core, lazy import; CPU and GPU) or "te"
    (``shardbridge_te``; GPU). :func:`shardbridge.fp8.backend_names` lists what is available;
    another name is a ValueError here. A known backend whose library does not import on this
    machine is accepted (its ``require_runtime`` refuses it where the run starts)."""

    name: str = "tensorwise"
    """Scaling recipe, one of :attr:`NAMES` (aliases: "current" = "tensorwise",
    "block_scaled" = "blockwise")."""

    params: Mapping[str, Any] = field(default_factory=dict)
    """Recipe parameters the backend reads (plain JSON values), e.g. TE's
    ``{"amax_history_len": 16, "amax_compute_algo": "max", "fp8_format": "E4M3", "margin": 0}``.
    Unknown keys are a ValueError from the backend. Empty = the backend's defaults."""

    all_gather_fp8: bool | None = None
    """All-gather weights in FP8 (1 byte per element on the wire). None = what the recipe does
    by design (torchao tensorwise: True; rowwise recipes and torchao MXFP8: False, they all-gather
    in high precision). True where the recipe cannot is a ValueError from the backend."""

    fp8_params: bool = False
    """Keep the weights themselves quantized (TE ``quantized_model_init``). False = FP8 compute
    on high-precision weights."""

    def __post_init__(self) -> None:
        name = self.ALIASES.get(self.name, self.name)
        if name not in self.NAMES:
            raise ValueError(
                f"FP8Recipe.name={self.name!r} is not a known recipe; choose one of {list(self.NAMES)} "
                f"(aliases {dict(self.ALIASES)})"
            )
        object.__setattr__(self, "name", name)
        if not isinstance(self.backend, str) or not self.backend:
            raise ValueError(f"FP8Recipe.backend={self.backend!r} must be a backend name such as 'torchao' or 'te'")
        if not is_known(self.backend):
            # A known backend whose library is missing is accepted here: require_runtime() refuses it at launch.
            raise ValueError(
                f"FP8Recipe.backend={self.backend!r} is not a registered FP8 backend; choose one of "
                f"{list(backend_names())} (others register with shardbridge.fp8.register_backend or the "
                f"{ENTRY_POINT_GROUP!r} entry-point group; 'te' comes with shardbridge_te and TransformerEngine: "
                f"{install_hint('te')})"
            )
        if not isinstance(self.params, Mapping):
            raise ValueError(f"FP8Recipe.params={self.params!r} must be a mapping of parameter names to values")
        try:
            json.dumps(dict(self.params))
        except TypeError as e:
            raise ValueError(
                f"FP8Recipe.params={dict(self.params)!r} must hold plain values (numbers, strings, bools): {e}"
            ) from None
        object.__setattr__(self, "params", dict(self.params))
        if self.all_gather_fp8 is not None and not isinstance(self.all_gather_fp8, bool):
            raise ValueError(f"FP8Recipe.all_gather_fp8={self.all_gather_fp8!r} must be True, False or None")
        if not isinstance(self.fp8_params, bool):
            raise ValueError(f"FP8Recipe.fp8_params={self.fp8_params!r} must be True or False")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for JSON and checkpoint metadata); :meth:`from_dict` inverts it.

        Example:
            >>> FP8Recipe.from_dict(FP8Recipe(name="mxfp8").to_dict()) == FP8Recipe(name="mxfp8")
            True
        """
        return {
            "backend": self.backend,
            "name": self.name,
            "params": dict(self.params),
            "all_gather_fp8": self.all_gather_fp8,
            "fp8_params": self.fp8_params,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FP8Recipe:
        """Inverse of :meth:`to_dict`.

        Raises:
            ValueError: unknown keys (named) or bad values.
        """
        known = {"backend", "name", "params", "all_gather_fp8", "fp8_params"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"FP8Recipe has no field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))


@dataclass(frozen=True, kw_only=True)
class Converted:
    """What :meth:`FP8Backend.convert` did to a model."""

    modules: tuple[str, ...]
    """FQNs of the modules that now compute in FP8."""

    tp_done: tuple[str, ...] = ()
    """FQNs whose tensor parallelism the backend applied itself (e.g. TE modules built with
    ``tp_size`` and given DTensor parameters); the adapter's TP pass must leave them alone."""

    tp_styles: Mapping[str, type] | None = None
    """``{"colwise": cls, "rowwise": cls}``: the ParallelStyles for the converted modules
    (:func:`shardbridge.fp8.converted_fqn`); None = torch's ``ColwiseParallel`` / ``RowwiseParallel``."""


@runtime_checkable
class FP8Backend(Protocol):
    """An FP8 implementation the core can drive. See [Note: the FP8 backend protocol]."""

    name: str
    """The name recipes use (``FP8Recipe.backend``)."""

    recipes: tuple[str, ...]
    """Recipe names (``FP8Recipe.NAMES``) this backend runs."""

    def check(self, recipe: FP8Recipe) -> None:
        """Raise ValueError / NotImplementedError naming what is supported. Pure."""

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
        """Swap ``model``'s modules for FP8 ones, before TP and FSDP; register the checkpoint rule."""

    def refresh(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """The weights changed (parallelized, stepped, loaded): recompute what derives from them."""


class FP8BackendBase:
    """Defaults for :class:`FP8Backend`: every library imports, nothing derives from the weights.

    Subclasses set :attr:`name` and :attr:`recipes` and implement :meth:`convert`.
    """

    name: str = ""
    recipes: tuple[str, ...] = ()

    def check(self, recipe: FP8Recipe) -> None:
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

    def refresh(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """Nothing."""


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


def is_known(name: str) -> bool:
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
