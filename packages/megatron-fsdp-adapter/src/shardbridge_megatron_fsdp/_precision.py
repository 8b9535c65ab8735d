"""Lower shardbridge's :class:`~shardbridge.MixedPrecisionPolicy` to Megatron-FSDP's.

[Note: Megatron-FSDP precision]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-FSDP (0.6, Megatron-LM PR #3067) keeps separate main buffers and names three dtypes::

    shardbridge policy        Megatron-FSDP MixedPrecisionPolicy
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
``fp8`` recipes are TransformerEngine's business (``shardbridge_te``).
"""

from __future__ import annotations

from typing import Any

import torch
from shardbridge import MixedPrecisionPolicy, fp8

from shardbridge_megatron_fsdp._compat import require_megatron_fsdp

__all__ = ["compute_dtype", "fp8_ddp_kwargs", "to_megatron_policy"]


def compute_dtype(policy: MixedPrecisionPolicy) -> torch.dtype | None:
    """The dtype the module is cast to before wrapping; None = leave it as it is."""
    return policy.param_dtype


def to_megatron_policy(policy: MixedPrecisionPolicy) -> Any:
    """``megatron_fsdp.MixedPrecisionPolicy`` for ``policy``. See [Note: Megatron-FSDP precision].

    Raises:
        NotImplementedError: ``policy.fp8`` or ``policy.output_dtype`` is set (no
            Megatron-FSDP counterpart); the message says what to do instead.

    Example:
        >>> to_megatron_policy(MixedPrecisionPolicy.bf16_comm()).grad_comm_dtype  # doctest: +SKIP
        torch.bfloat16
    """
    if not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(
            f"policy must be a shardbridge.MixedPrecisionPolicy, got {type(policy).__name__}; "
            "e.g. MixedPrecisionPolicy.bf16()"
        )
    if policy.fp8 is not None:
        fp8_ddp_kwargs(policy, device_type="cuda")  # refuses torchao / non-FP8-parameter recipes by name
        raise NotImplementedError(
            f"fp8={policy.fp8} with Megatron-FSDP: FP8 parameters are all-gathered by "
            "DistributedDataParallelConfig(fp8_param_gather=True) with TransformerEngine's CUDA kernels: not on "
            "CPU (set fp8=None there); on a GPU the keywords come from fp8_ddp_kwargs(policy, device_type='cuda'), "
            "which shard_model does not pass to Megatron-FSDP yet"
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


def fp8_ddp_kwargs(policy: MixedPrecisionPolicy, *, device_type: str) -> dict[str, Any]:
    """``DistributedDataParallelConfig`` keywords for ``policy.fp8`` (GPU); ``{}`` without FP8.

    Megatron-FSDP's FP8 parameters are TransformerEngine's: TE modules built under
    ``te.quantized_model_init`` (``FP8Recipe(backend="te", fp8_params=True)``) and all-gathered
    in FP8 with ``DistributedDataParallelConfig(fp8_param_gather=True)``. That needs TE's CUDA
    kernels, so on CPU it is refused by name; torchao's weight wrappers are not Megatron-FSDP
    parameters it can gather (it flattens parameters into its own buffers), so they are refused too.

    Raises:
        NotImplementedError: CPU, a backend other than "te", or ``fp8_params=False``.

    Example:
        >>> from shardbridge import FP8Recipe
        >>> fp8_ddp_kwargs(MixedPrecisionPolicy(fp8=FP8Recipe(backend="te", fp8_params=True)), device_type="cuda")
        {'fp8_param_gather': True}
    """
    recipe = policy.fp8
    if recipe is None:
        return {}
    try:
        fp8.get_backend(recipe.backend).check(recipe)  # e.g. torchao refuses fp8_params (it keeps hp weights)
    except ValueError as e:
        raise NotImplementedError(f"fp8={recipe} with Megatron-FSDP: {e}") from None
    if not recipe.fp8_params:
        raise NotImplementedError(
            f"fp8={recipe} with Megatron-FSDP: its FP8 parameters are TransformerEngine's (fp8_param_gather); "
            'use FP8Recipe(backend="te", fp8_params=True) with TE modules, or the torch FSDP2 path '
            "(shardbridge.apply_fsdp / shardbridge_hf) for torchao recipes"
        )
    if device_type != "cuda":
        raise NotImplementedError(
            f"fp8={recipe} with Megatron-FSDP on {device_type}: fp8_param_gather all-gathers TransformerEngine FP8 "
            "parameters, which need TE's CUDA kernels; run on a GPU machine, or set fp8=None on CPU"
        )
    return {"fp8_param_gather": True}
