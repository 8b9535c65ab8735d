"""Lower shardbridge's :class:`~shardbridge.PrecisionPolicy` to Megatron-FSDP's.

[Note: Megatron-FSDP precision]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-FSDP (0.6, Megatron-LM PR #3067) keeps separate main buffers and names three dtypes::

    shardbridge policy        Megatron-FSDP PrecisionPolicy
    main_params_dtype  -----> main_params_dtype   (optimizer weights; fp32 by default)
    main_grads_dtype   -----> main_grads_dtype    (accumulation; shardbridge default fp32,
                                                   Megatron-FSDP's None = "the model dtype")
    grad_comm_dtype    -----> grad_comm_dtype     (reduce-scatter / all-reduce; None = main grads)
    param_dtype        -----> (no field)          compute runs in the dtype the module has
                                                   when it is wrapped

So the compute dtype is handled explicitly: :func:`~shardbridge_megatron_fsdp.shard_model`
casts the module to ``param_dtype`` before wrapping and then writes the original
full-precision values into the main weights, so a bf16 run starts from exactly the fp32
weights a torch-FSDP2 run starts from (Megatron-FSDP alone would initialise its fp32 main
weights from the bf16-rounded model). ``main_grads_dtype`` is always passed explicitly:
the seed discussion (PR #3067) concludes that gradients must accumulate in fp32 by default
for large-scale accuracy, and Megatron-FSDP's own default (None) would follow a bf16 model.

``output_dtype`` and ``cast_forward_inputs`` have no Megatron-FSDP counterpart: a policy that
sets ``output_dtype`` is refused by :func:`to_megatron_policy` rather than silently ignored.

[Note: FP8 under Megatron-FSDP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
FP8 is a conversion of the model before it is wrapped (``shardbridge.fp8.convert(model,
recipe, mesh=pm)``); :func:`~shardbridge_megatron_fsdp.shard_model` reads the recipe the model
was converted with (``shardbridge.fp8.recipe_of``) and lowers it, not to
``megatron_fsdp.MixedPrecisionPolicy`` (it has no FP8 field), but to
``DistributedDataParallelConfig`` keywords (:func:`fp8_ddp_kwargs`)::

    recipe                                        Megatron-FSDP (GPU)
    FP8Recipe(backend="te", name=any TE recipe,  fp8_param_gather=True: TE FP8 parameters (built
              fp8_params=True)                    under te.quantized_model_init, i.e.
                                                  shardbridge_te.model_init_context / convert)
                                                  all-gathered in FP8; main weights in
                                                  main_params_dtype, re-quantized after each step
    fp8_params=False (FP8 compute on high-        refused: Megatron-FSDP flattens parameters into
      precision weights, e.g. every torchao        its own buffers and all-gathers them in the
      recipe)                                      module dtype; torchao's weight wrappers and
                                                  scales are not parameters it can gather
    any recipe on CPU                             refused: TE's FP8 kernels need CUDA

:func:`~shardbridge_megatron_fsdp.shard_model` passes the keywords into the
``DistributedDataParallelConfig`` that ``fully_shard_model`` builds (see [Note:
DistributedDataParallelConfig fields fully_shard_model does not take] in ``_compat.py``) and
checks that the model holds FP8 parameters Megatron-FSDP recognises. TE's FP8 autocast over
the ``weight`` mesh came with the conversion (pass ``mesh=`` to ``convert``).
"""

from __future__ import annotations

from typing import Any

import torch
from shardbridge import PrecisionPolicy, fp8
from shardbridge.fp8 import FP8Recipe

from shardbridge_megatron_fsdp._compat import require_megatron_fsdp

__all__ = ["compute_dtype", "fp8_ddp_kwargs", "to_megatron_policy"]


def compute_dtype(policy: PrecisionPolicy) -> torch.dtype | None:
    """The dtype the module is cast to before wrapping; None = leave it as it is."""
    return policy.param_dtype


def to_megatron_policy(policy: PrecisionPolicy) -> Any:
    """``megatron_fsdp.MixedPrecisionPolicy`` for ``policy``. See [Note: Megatron-FSDP precision].

    Raises:
        NotImplementedError: ``policy.output_dtype`` is set (no Megatron-FSDP counterpart); the
            message says what to do instead. (FP8 lowers to :func:`fp8_ddp_kwargs`.)

    Example:
        >>> to_megatron_policy(PrecisionPolicy.bf16_comm()).grad_comm_dtype  # doctest: +SKIP
        torch.bfloat16
    """
    if not isinstance(policy, PrecisionPolicy):
        raise ValueError(
            f"policy must be a shardbridge.PrecisionPolicy, got {type(policy).__name__}; "
            "e.g. PrecisionPolicy.bf16()"
        )
    if policy.output_dtype is not None:
        raise NotImplementedError(
            f"output_dtype={policy.output_dtype} has no Megatron-FSDP counterpart (it does not cast module "
            "outputs); set output_dtype=None and cast the loss input yourself (e.g. logits.float())"
        )
    mfsdp = require_megatron_fsdp()
    comm = policy.effective_grad_comm_dtype
    return mfsdp.MixedPrecisionPolicy(
        main_params_dtype=policy.main_params_dtype,
        main_grads_dtype=policy.main_grads_dtype,
        # None when equal: megatron-fsdp 0.6.1 then communicates in the main-grad buffer itself.
        # An explicit equal dtype breaks no_shard (a communication bucket of the wrong size:
        # "size of tensor a (128) must match ... (256)" in _grad_acc).
        grad_comm_dtype=None if comm == policy.main_grads_dtype else comm,
    )


def fp8_ddp_kwargs(recipe: FP8Recipe | None, *, device_type: str) -> dict[str, Any]:
    """``DistributedDataParallelConfig`` keywords for the model's FP8 ``recipe``; ``{}`` without FP8.

    See [Note: FP8 under Megatron-FSDP]. Pure: imports neither megatron_fsdp nor TE.

    Args:
        recipe: the recipe the model was converted with (``shardbridge.fp8.recipe_of(model)``), or None.
        device_type: the mesh's device type ("cuda" on a GPU; "cpu" is refused for FP8).

    Raises:
        ValueError / NotImplementedError: a recipe its backend refuses, ``fp8_params=False``
            (every torchao recipe), ``all_gather_fp8=False`` (FP8 parameters are gathered in
            FP8), or a device other than CUDA; each names what Megatron-FSDP supports.

    Example:
        >>> fp8_ddp_kwargs(FP8Recipe(backend="te", fp8_params=True), device_type="cuda")
        {'fp8_param_gather': True}
    """
    if recipe is None:
        return {}
    supported = 'Megatron-FSDP runs FP8 only as FP8 parameters: fp8=FP8Recipe(backend="te", name=..., fp8_params=True)'
    try:
        fp8.get_backend(recipe.backend).check(recipe)  # e.g. torchao refuses fp8_params (it keeps hp weights)
    except ValueError as e:
        raise NotImplementedError(f"fp8={recipe} with Megatron-FSDP: {e}. {supported}") from None
    if not recipe.fp8_params:
        raise NotImplementedError(
            f"fp8={recipe} with Megatron-FSDP: fp8_params=False (FP8 compute on high-precision weights, backend "
            f"{recipe.backend!r}) is not run by Megatron-FSDP, which flattens parameters into its own buffers and "
            f"all-gathers them in the module dtype. {supported} (TE modules, all-gathered with "
            "fp8_param_gather=True), or train this recipe on the torch FSDP2 path (shardbridge.apply_fsdp / "
            "shardbridge_hf)"
        )
    if recipe.all_gather_fp8 is False:
        raise NotImplementedError(
            f"fp8={recipe} with Megatron-FSDP: all_gather_fp8=False, but Megatron-FSDP all-gathers FP8 parameters in "
            "their FP8 storage (fp8_param_gather); set all_gather_fp8=None (or True)"
        )
    if device_type != "cuda":
        raise NotImplementedError(
            f"fp8={recipe} with Megatron-FSDP on device {device_type!r}: fp8_param_gather all-gathers "
            "TransformerEngine FP8 parameters, which need TE's CUDA kernels; run on a GPU (mesh device 'cuda'), "
            "or train without FP8 on CPU"
        )
    return {"fp8_param_gather": True}
