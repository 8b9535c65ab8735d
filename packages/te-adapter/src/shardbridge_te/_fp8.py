"""The TransformerEngine FP8 backend (``FP8Recipe(backend="te")``), registered with the core.

Registered under the name "te" when ``shardbridge_te`` is imported and through the
``shardbridge.fp8_backends`` entry point, so the hf adapter drives it through
``shardbridge.fp8`` without importing this package. This module imports no TE at import time
(TE is reached through ``_compat`` only): :meth:`TEBackend.check` and :func:`recipe_spec` are
pure; the other hooks import TE. What only TE has, FP8 parameters built inside
``te.quantized_model_init``, is :func:`model_init_context` here, not a hook of the core's protocol.

[Note: TE recipes]
~~~~~~~~~~~~~~~~~~
::

    FP8Recipe.name   TE recipe object (transformer_engine.common.recipe)   params (defaults)
    tensorwise       Float8CurrentScaling     fp8_format (HYBRID)
    delayed          DelayedScaling           fp8_format (HYBRID), amax_history_len (1024),
                                              amax_compute_algo (most_recent), margin (0)
    mxfp8            MXFP8BlockScaling        fp8_format (E4M3), margin (0)
    blockwise        Float8BlockScaling       fp8_format (E4M3)
    nvfp4            NVFP4BlockScaling        (none)

[Note: TE modules with TE's own TP, from nn.Linear]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's ``ColwiseParallel`` accepts only ``nn.Linear``, so a ``te.Linear`` cannot be sharded by
a model's torch TP plan. :meth:`TEBackend.convert` builds each converted Linear as TE builds a
tensor-parallel layer instead: ``te.Linear(..., tp_size=tp, parallel_mode="column" | "row")``
holding this rank's ``torch.chunk`` piece of the weight (``colwise`` -> column, ``rowwise`` ->
row; a Linear the plan does not shard -> ``parallel_mode=None``, replicated), and then
:func:`shardbridge_te.set_device_mesh` gives it DTensor parameters on ``mesh["tp"]``, the TP
group, the ``weight`` mesh as amax group and a local-tensor forward. The adapter's TP pass
skips these modules (``Converted.tp_done``); FSDP2 shards them like any DTensor parameter.
Linears with a style TE has no mode for (``colwise_gather_output``: TE's column mode never
gathers its output) stay ``nn.Linear`` under torch TP, in high precision.

[Note: TE FP8 autocast from convert]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
TE computes in FP8 only inside ``te.autocast``, and Accelerate's FSDP2 path never enters it
(accelerate #3710). :meth:`TEBackend.convert` therefore also runs the model's ``forward`` under
``te.autocast(recipe, amax_reduction_group=<the weight mesh's group>)``: the conversion is the
one place that knows the recipe, and FSDP's pre/post-forward hooks run outside ``forward``
either way (an instance attribute, kept by ``fully_shard``'s class swap). Without a mesh the
group is TE's default (None: the default process group). :func:`remove_autocast` undoes it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from shardbridge.adapters import did_you_mean
from shardbridge.fp8 import Converted, FP8BackendBase, FP8Recipe
from torch import nn

from shardbridge_te._compat import te_pytorch, te_recipes

if TYPE_CHECKING:
    from shardbridge import ParallelMesh

__all__ = ["RECIPE_CLASSES", "TEBackend", "backend", "build_recipe", "model_init_context", "recipe_spec", "remove_autocast"]

RECIPE_CLASSES: dict[str, str] = {
    "tensorwise": "Float8CurrentScaling",
    "delayed": "DelayedScaling",
    "mxfp8": "MXFP8BlockScaling",
    "blockwise": "Float8BlockScaling",
    "nvfp4": "NVFP4BlockScaling",
}
"""FP8Recipe.name -> TE recipe class. See [Note: TE recipes]."""

_DEFAULTS: dict[str, dict[str, Any]] = {
    "tensorwise": {"fp8_format": "HYBRID"},
    "delayed": {"fp8_format": "HYBRID", "amax_history_len": 1024, "amax_compute_algo": "most_recent", "margin": 0},
    "mxfp8": {"fp8_format": "E4M3", "margin": 0},
    "blockwise": {"fp8_format": "E4M3"},
    "nvfp4": {},
}
_CHOICES: dict[str, tuple[Any, ...]] = {
    "fp8_format": ("HYBRID", "E4M3"),
    "amax_compute_algo": ("max", "most_recent"),
}
_MODES = {"colwise": "column", "rowwise": "row"}
_UNDO_ATTR = "_shardbridge_te_fp8_autocast_undo"


def recipe_spec(recipe: FP8Recipe) -> tuple[str, dict[str, Any]]:
    """``(TE recipe class name, keyword arguments)`` for ``recipe``; enums as member names. Pure.

    Raises:
        ValueError: a parameter the TE recipe does not take, or a bad value (named).

    Example:
        >>> recipe_spec(FP8Recipe(backend="te", name="delayed", params={"amax_history_len": 16}))
        ('DelayedScaling', {'fp8_format': 'HYBRID', 'amax_history_len': 16, 'amax_compute_algo': 'most_recent', 'margin': 0})
    """
    defaults = _DEFAULTS[recipe.name]
    for key, value in recipe.params.items():
        if key not in defaults:
            raise ValueError(
                f"fp8.params.{key}: TE recipe {recipe.name!r} ({RECIPE_CLASSES[recipe.name]}) takes "
                f"{sorted(defaults) or 'no parameters'}; remove {key!r}{did_you_mean(key, defaults)}"
            )
        if key in _CHOICES and value not in _CHOICES[key]:
            raise ValueError(f"fp8.params.{key}={value!r}: choose one of {list(_CHOICES[key])}")
        if key in ("amax_history_len", "margin") and (
            isinstance(value, bool) or not isinstance(value, int) or value < (1 if key == "amax_history_len" else 0)
        ):
            raise ValueError(f"fp8.params.{key}={value!r} must be an int >= {1 if key == 'amax_history_len' else 0}")
    return RECIPE_CLASSES[recipe.name], {**defaults, **recipe.params}


def build_recipe(recipe: FP8Recipe) -> Any:
    """The TE recipe object for ``recipe`` (imports TE's ``common.recipe``)."""
    te_recipe = te_recipes()
    cls_name, kwargs = recipe_spec(recipe)
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    return getattr(te_recipe, cls_name)(**kwargs)


def _default_filter(module: nn.Module, fqn: str) -> bool:
    # FP8 GEMMs need both dims divisible by 16 (TE checks it at forward).
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _piece(full: torch.Tensor, mode: str | None, dim: int, tp: int, rank: int) -> torch.Tensor:
    return full if mode is None else torch.chunk(full, tp, dim=dim)[rank]


class TEBackend(FP8BackendBase):
    """TransformerEngine FP8: recipes of [Note: TE recipes], TE's own TP, FP8 autocast, TE FP8 params."""

    name = "te"
    recipes = tuple(RECIPE_CLASSES)

    def require_runtime(self) -> None:
        """ImportError with the install hint unless ``transformer_engine.pytorch`` imports."""
        te_pytorch()

    def check(self, recipe: FP8Recipe) -> None:
        """Pure: recipe name, parameters; ``all_gather_fp8`` is a property of TE's FP8 params."""
        super().check(recipe)
        recipe_spec(recipe)
        if recipe.all_gather_fp8 and not recipe.fp8_params:
            raise ValueError(
                "fp8.all_gather_fp8=true with backend te needs fp8_params: true (TE all-gathers FP8 only for FP8 "
                "parameters, quantized_model_init); set fp8_params: true or leave all_gather_fp8 unset"
            )

    def convert(
        self,
        model: nn.Module,
        recipe: FP8Recipe,
        *,
        mesh: ParallelMesh | None = None,
        tp_plan: Mapping[str, str] | None = None,
        module_filter: Callable[[nn.Module, str], bool] | None = None,
    ) -> Converted:
        """``nn.Linear`` -> ``te.Linear`` with TE's own TP, forward under FP8 autocast.

        See [Note: TE modules with TE's own TP, from nn.Linear] and [Note: TE FP8 autocast from
        convert]; TE's FP8 tensor classes are registered for checkpoints (``register_te_fp8_types``).
        """
        from shardbridge_te._apply import set_device_mesh
        from shardbridge_te._checkpoint import register_te_fp8_types

        te = te_pytorch()
        register_te_fp8_types()
        tp = 1 if mesh is None else mesh.dims.tp
        rank = 0 if tp == 1 else mesh["tp"].get_local_rank()
        plan = dict(tp_plan or {})
        chosen = module_filter or _default_filter
        init = te.quantized_model_init(enabled=True, recipe=build_recipe(recipe)) if recipe.fp8_params else None
        names = []
        for fqn, linear in list(model.named_modules()):
            if type(linear) is not nn.Linear or not chosen(linear, fqn):
                continue
            style = plan.get(fqn)
            if tp > 1 and style is not None and style not in _MODES:
                continue  # see the Note: torch TP keeps it, in high precision
            mode = _MODES.get(style) if tp > 1 else None
            with init if init is not None else contextlib.nullcontext():
                new = te.Linear(
                    linear.in_features,
                    linear.out_features,
                    bias=linear.bias is not None,
                    params_dtype=linear.weight.dtype,
                    device=linear.weight.device,
                    tp_size=tp if mode else 1,
                    parallel_mode=mode,
                )
            with torch.no_grad():
                if not linear.weight.is_meta:
                    new.weight.copy_(_piece(linear.weight, mode, 0 if mode == "column" else 1, tp, rank))
                    if linear.bias is not None:
                        new.bias.copy_(_piece(linear.bias, mode if mode == "column" else None, 0, tp, rank))
            parent, _, child = fqn.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
            names.append(fqn)
        if mesh is not None and names:
            # DTensor TP params, TP group, weight-mesh amax group. A model of TE modules already given
            # its mesh (shardbridge_te.parallelize) converts nothing here and is left as it is.
            set_device_mesh(model, mesh)
        _autocast_forward(model, mesh, recipe)
        return Converted(modules=tuple(names), tp_done=tuple(names) if tp > 1 else ())


def _autocast_forward(model: nn.Module, mesh: ParallelMesh | None, recipe: FP8Recipe) -> None:
    """Run ``model.forward`` under ``te.autocast(recipe, amax_reduction_group=weight mesh)``.

    See [Note: TE FP8 autocast from convert]. Idempotent; :func:`remove_autocast` restores the
    identical previous ``forward``.
    """
    if _UNDO_ATTR in vars(model):
        return
    te = te_pytorch()
    te_recipe = build_recipe(recipe)
    forward = model.forward
    # The amax-reduction group of the recipe's scaling: the weight mesh (dp_shard_cp x tp).
    group = mesh["weight"].get_group() if mesh is not None and dist.is_initialized() else None
    # te.fp8_autocast in older TE; te.autocast (same arguments renamed) in 2.20.
    autocast = getattr(te, "autocast", None)

    @functools.wraps(forward)
    def fp8_forward(*args: Any, **kwargs: Any) -> Any:
        ctx = (
            autocast(enabled=True, recipe=te_recipe, amax_reduction_group=group)
            if autocast is not None
            else te.fp8_autocast(enabled=True, fp8_recipe=te_recipe, fp8_group=group)
        )
        with ctx:
            return forward(*args, **kwargs)

    had = "forward" in vars(model)
    previous = vars(model).get("forward")
    model.forward = fp8_forward

    def undo() -> None:
        if had:
            model.forward = previous
        else:
            vars(model).pop("forward", None)
        vars(model).pop(_UNDO_ATTR, None)

    vars(model)[_UNDO_ATTR] = undo


def model_init_context(recipe: FP8Recipe | None) -> contextlib.AbstractContextManager:
    """Where to build a TE model for ``recipe``: ``te.quantized_model_init`` when ``fp8_params``, else a no-op.

    TE FP8 parameters (``FP8Recipe(backend="te", fp8_params=True)``) exist only for TE modules
    built inside this context; :func:`~shardbridge_te.materialize` quantizes each local shard.

    Example:
        >>> with torch.device("meta"), model_init_context(recipe):  # doctest: +SKIP
        ...     model = MyTEModel()
    """
    if recipe is None or not recipe.fp8_params:
        return contextlib.nullcontext()
    if recipe.backend != backend.name:
        raise ValueError(
            f"model_init_context: {recipe} asks for FP8 parameters of backend {recipe.backend!r}; only TE builds "
            "FP8 parameters (FP8Recipe(backend='te', fp8_params=True))"
        )
    backend.check(recipe)
    return te_pytorch().quantized_model_init(enabled=True, recipe=build_recipe(recipe))


def remove_autocast(model: nn.Module) -> bool:
    """Undo the FP8 autocast wrap :meth:`TEBackend.convert` put on ``model.forward``; whether there was one."""
    undo = vars(model).get(_UNDO_ATTR)
    if undo is None:
        return False
    undo()
    return True


backend = TEBackend()
"""The instance the entry point names and ``shardbridge_te`` registers."""
