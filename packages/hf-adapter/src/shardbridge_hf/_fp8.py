"""torchao float8 training for Hugging Face models under FSDP2 x TP, on NCCL and on gloo.

The order torchao needs, and the one Accelerate gets wrong (it converts AFTER its TP pass and
hangs the scale hook on the wrapper optimizer)::

    nn.Linear                          convert()      BEFORE TP / FSDP
    Float8Linear(weight=WeightWithDynamicFloat8CastTensor)
        | TP with tp_styles() (Float8ColwiseParallel / Float8RowwiseParallel)
        | fully_shard (core apply_fsdp), then after_fsdp(): uint8 all-gather on gloo,
        |   scales precomputed once
    train: FSDP all-gathers float8 bytes (1 byte / element); after every optimizer step
           after_optimizer_step() recomputes the per-tensor scales (one all-reduce over the
           weight mesh); after a checkpoint load after_load() does the same.

Checkpoints stay portable: the wrapper subclass is registered with the core
(:func:`shardbridge.register_fp8_tensor_type`), which saves its high-precision tensor as a plain
tensor. See [Note: portable FP8 checkpoints] in ``shardbridge/_fp8.py``.

[Note: Accelerate's torchao hook (upstream bug 6)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``Accelerator._prepare_ao`` (accelerate 1.15) calls ``optimizer.register_step_post_hook`` on
the ``AcceleratedOptimizer`` that ``_prepare_tp`` already returned. ``AcceleratedOptimizer``
never runs ``torch.optim.Optimizer.__init__``, so it has no ``_optimizer_step_post_hooks``:
``AttributeError``. :func:`install_step_hook` registers on the wrapped torch optimizer instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from shardbridge import ParallelMesh, register_fp8_tensor_type, use_uint8_all_gather
from torch import nn

from shardbridge_hf._compat import float8_weight_data

__all__ = [
    "RECIPES",
    "after_fsdp",
    "after_load",
    "after_optimizer_step",
    "convert",
    "default_module_filter",
    "float8_linears",
    "install_step_hook",
    "tp_styles",
]

RECIPES: tuple[str, ...] = ("tensorwise",)
"""Recipes with float8 all-gather under FSDP2 (torchao: only per-tensor dynamic scaling)."""

_SKIP_NAMES = ("lm_head", "output", "embed")


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """Convert a Linear unless it is the output head or a dim is not a multiple of 16.

    float8 matmuls need both dims divisible by 16; the output head stays in high precision
    for stability (as torchtitan and Accelerate do).
    """
    if not isinstance(module, nn.Linear):
        return False
    if any(part in _SKIP_NAMES for part in fqn.split(".")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def require_torchao() -> None:
    """ImportError with the install hint when torchao's float8 is missing."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ImportError('fp8 backend "torchao" needs torchao: pip install "shardbridge[fp8]"') from e


@functools.cache
def _register_portable() -> None:
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    # The wrapper holds the high-precision weight: saving a view of it keeps loads in place.
    register_fp8_tensor_type(WeightWithDynamicFloat8CastTensor, float8_weight_data)


def convert(
    model: nn.Module,
    recipe: str = "tensorwise",
    *,
    module_filter: Callable[[nn.Module, str], bool] = default_module_filter,
) -> list[str]:
    """Swap ``model``'s Linears for torchao ``Float8Linear`` with float8 FSDP all-gather.

    Call BEFORE tensor parallelism and ``fully_shard``.

    Args:
        model: a model with ``nn.Linear`` layers (on any device but meta).
        recipe: the FP8 recipe name; only "tensorwise" all-gathers float8 under FSDP2.
        module_filter: ``(module, fqn) -> bool``: which Linears to convert.

    Returns:
        The FQNs of the converted Linears.

    Raises:
        ValueError: an unknown recipe.
        ImportError: torchao missing (``pip install "shardbridge[fp8]"``).

    Example:
        >>> names = convert(model)  # doctest: +SKIP
        >>> names[:2]  # doctest: +SKIP
        ['model.layers.0.self_attn.q_proj', 'model.layers.0.self_attn.k_proj']
    """
    if recipe not in RECIPES:
        raise ValueError(
            f"fp8 recipe={recipe!r}: torchao float8 all-gather under FSDP2 supports {list(RECIPES)}; "
            "set fp8.recipe: tensorwise (rowwise recipes all-gather in high precision)"
        )
    require_torchao()
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    _register_portable()
    config = Float8LinearConfig.from_recipe_name(recipe)
    config = Float8LinearConfig(**{**config.__dict__, "enable_fsdp_float8_all_gather": True})
    convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    return list(float8_linears(model))


def float8_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The ``Float8Linear`` modules of ``model`` by FQN."""
    from torchao.float8.float8_linear import Float8Linear

    return {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def tp_styles() -> dict[str, type]:
    """TP styles for ``Float8Linear``: ``{"colwise": ..., "rowwise": ...}`` (torchao's)."""
    require_torchao()
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel}


def after_fsdp(model: nn.Module, pm: ParallelMesh | None = None) -> None:
    """After ``fully_shard``: float8 all-gathers as uint8 on gloo, and the first scales.

    ``pm`` is accepted for symmetry with the other adapters; the amax all-reduce runs over
    the weights' own mesh, which is the core ``weight`` mesh plus replicate axes.
    """
    use_uint8_all_gather(model)
    after_optimizer_step(model)


@torch.no_grad()
def after_optimizer_step(model: nn.Module) -> None:
    """Recompute every float8 weight's scale from the current weights (one all-reduce)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def after_load(model: nn.Module) -> None:
    """After a checkpoint load: the weights changed, so the scales must too."""
    after_optimizer_step(model)


def install_step_hook(optimizer: Any, model: nn.Module) -> Any:
    """Run :func:`after_optimizer_step` after every step of ``optimizer``.

    ``optimizer`` may be Accelerate's ``AcceleratedOptimizer``: the hook goes on the torch
    optimizer it wraps. See [Note: Accelerate's torchao hook (upstream bug 6)].

    Returns:
        The hook handle (``.remove()`` detaches it).
    """
    inner = optimizer
    while not hasattr(inner, "_optimizer_step_post_hooks") and hasattr(inner, "optimizer"):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(
            f"install_step_hook: {type(optimizer).__name__} wraps no torch.optim.Optimizer; pass the optimizer "
            "that steps the model's parameters"
        )
    return inner.register_step_post_hook(lambda *_args, **_kwargs: after_optimizer_step(model))
