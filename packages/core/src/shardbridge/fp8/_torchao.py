"""The torchao FP8 backend: float8 training recipes and MXFP8, under FSDP2 x TP (torchao 0.18).

torchao is optional: this module imports it only when a hook runs (otherwise an ImportError
with the install hint of the ``fp8`` extra, [Note: install hints] in ``shardbridge/extras.py``),
so ``import shardbridge`` never does.

[Note: torchao recipes under FSDP2 x TP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    recipe              module          weight param                         FSDP2 all-gather   TP styles
    tensorwise          Float8Linear    WeightWithDynamicFloat8CastTensor    float8, 1 B/elem   Float8Colwise/RowwiseParallel
    rowwise             Float8Linear    plain                                high precision     torch's
    rowwise_with_gw_hp  Float8Linear    plain                                high precision     torch's
    mxfp8               nn.Linear       MXFP8TrainingWeightWrapperTensor     high precision     MXFP8Colwise/RowwiseParallel

- tensorwise: one scale per tensor, so the weight can be cast to float8 BEFORE the all-gather
  (``enable_fsdp_float8_all_gather``); the scale is the amax over the whole weight, which
  :func:`precompute_float8_dynamic_scale_for_fsdp` computes for all weights with one all-reduce
  after parallelizing, after every optimizer step and after every load (:meth:`refresh`). On
  gloo the float8 buffers travel as uint8 (``apply_fsdp``; [Note: float8 all-gather on gloo]).
- rowwise / rowwise_with_gw_hp: a scale per row of the UNSHARDED weight; a shard cannot be cast
  before the all-gather without changing the numerics, so torchao (0.18) all-gathers the weight in
  high precision by design and casts after (torchtitan #3032 chose this recipe anyway: better
  accuracy, and the casts fuse under torch.compile).
- mxfp8: torchao 0.18's MXFP8 training (``prototype.moe_training``, ``MXFP8TrainingOpConfig``)
  wraps each weight in ``MXFP8TrainingWeightWrapperTensor``, whose FSDP2 hooks all-gather the
  HIGH-PRECISION data (``fsdp_pre_all_gather`` sends ``_data.to(param_dtype)``); the e8m0 block
  scales are computed after the all-gather. On CPU it runs the ``EMULATED`` kernel preference
  (PyTorch ops, no Triton/CUTLASS). Under TP, torch's styles would be silently wrong: the
  wrapper intercepts ``F.linear`` in ``__torch_function__``, which a DTensor call never reaches
  (DTensor dispatches below it), so the matmuls would run in high precision. :meth:`convert`
  therefore returns the core's local-shard styles (``Converted.tp_styles``), which call ``F.linear`` on the local shards
  where the wrapper sees it (see [Note: MXFP8 under tensor parallelism] in ``_tp_styles.py``);
  a TP-local dim that is not a multiple of 32 is refused by name there. A converted Linear whose
  weight is a DTensor under any OTHER style refuses to run (NotImplementedError naming it)
  instead of computing in high precision. torchao 0.18's MXFP8 ``F.linear`` also drops the bias:
  converted Linears add it themselves.

Which modules take ``Converted.tp_styles``: exactly those :func:`shardbridge.fp8.convert`
converted (``shardbridge.fp8.converted_fqn``), in the core's Llama plan and the hf adapter alike.

Checkpoints: the two wrapper subclasses hold the high-precision weight (``__tensor_flatten__``
names it), which is what :func:`shardbridge.fp8.register_fp8_tensor_type` saves (``convert`` registers
both): a view, so loads write the live weight in place, bit-exact, and any torch reads the checkpoint.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardbridge._checks import did_you_mean
from shardbridge._compat import require_module
from shardbridge._extras import install_hint
from shardbridge.fp8._convert import converted_fqn
from shardbridge.fp8._recipe import Converted, FP8BackendBase
from shardbridge.fp8._tensors import register_fp8_tensor_type
from shardbridge.fp8._tp_styles import MXFP8ColwiseParallel, MXFP8RowwiseParallel, check_mx_tokens

if TYPE_CHECKING:
    from shardbridge._mesh import ParallelMesh
    from shardbridge.fp8._recipe import FP8Recipe

__all__ = ["TorchaoBackend", "default_module_filter"]

INSTALL_HINT = install_hint("fp8")  # [Note: install hints] in shardbridge/extras.py
_SKIP_NAMES = ("lm_head", "output", "embed")
_FLOAT8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
_PARAMS: dict[str, dict[str, tuple[type, ...]]] = {
    "tensorwise": {},
    "rowwise": {},
    "rowwise_with_gw_hp": {},
    "mxfp8": {"kernel": (str,), "wgrad_with_hp": (bool,)},
}
_MX_KERNELS = ("auto", "emulated")


def default_module_filter(module: nn.Module, fqn: str) -> bool:
    """Convert a Linear unless it is the output head / an embedding or a dim is not a multiple of 16.

    float8 matmuls need both dims divisible by 16 (MXFP8: 32, checked at convert); the output head
    stays in high precision for stability (as torchtitan and Accelerate do).
    """
    if not isinstance(module, nn.Linear):
        return False
    if any(part in _SKIP_NAMES for part in fqn.split(".")):
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def _torchao(name: str) -> Any:
    return require_module(name, hint=f'fp8 backend "torchao" needs torchao: {INSTALL_HINT}')


def _inner_tensor(t: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor a torchao weight wrapper holds (named by ``__tensor_flatten__``).

    The wrappers flatten to ``[weight, *scales]`` (a precomputed scale is 0-d): the inner tensor of
    the wrapper's own shape is the weight.
    """
    names, _ = t.__tensor_flatten__()
    return next(inner for inner in (getattr(t, n) for n in names) if inner.shape == t.shape)


def _mxfp8_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward for an MXFP8-wrapped weight: the bias added here, DTensor weights refused."""
    if isinstance(self.weight, DTensor):
        # Tensor-parallel with a style that is not the backend's: DTensor dispatches below the wrapper's
        # __torch_function__, so the matmul would silently run in high precision.
        raise NotImplementedError(
            f"fp8 recipe mxfp8: {converted_fqn(self) or 'a Linear'} has a DTensor (tensor-parallel) weight but was "
            "not parallelized with the torchao backend's tp_styles (MXFP8ColwiseParallel / MXFP8RowwiseParallel); "
            "under any other style its matmul would silently run in high precision. Plan it 'colwise' / 'rowwise' "
            "with those styles, or keep it out of FP8 (fp8.convert's module_filter)"
        )
    if type(self.weight) is torch.Tensor or type(self.weight) is nn.Parameter:
        raise NotImplementedError(
            f"fp8 recipe mxfp8: {converted_fqn(self) or 'a Linear'}'s weight is a plain tensor in forward (its MXFP8 "
            "weight wrapper was lost, e.g. by a tensor-parallel style that rebuilds the local shard), so its matmul "
            "would silently run in high precision; plan it 'colwise' / 'rowwise', or keep it out of FP8"
        )
    check_mx_tokens(self, x)
    # MXFP8TrainingWeightWrapperTensor.__torch_function__ (torchao 0.18) computes F.linear(x, w, b) as x @ w.T
    # in MXFP8 and returns it without b: the bias is added in high precision, as nn.Linear would.
    y = F.linear(x, self.weight)
    return y if self.bias is None else y + self.bias


def _all_gathers_float8(recipe: FP8Recipe) -> bool:
    return recipe.name == "tensorwise" and recipe.all_gather_fp8 is not False


class TorchaoBackend(FP8BackendBase):
    """torchao float8 (tensorwise, rowwise, rowwise_with_gw_hp) and MXFP8 training.

    See [Note: torchao recipes under FSDP2 x TP]. Parameters (``FP8Recipe.params``): mxfp8 takes
    ``kernel`` ("auto": torchao's CUDA/Triton kernels; "emulated": PyTorch ops; default: emulated
    when the model is on CPU, else auto) and ``wgrad_with_hp`` (bool); the float8 recipes take none.
    """

    name = "torchao"
    recipes = ("tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8")

    def require_runtime(self) -> None:
        """ImportError with the install hint unless torchao imports."""
        _torchao("torchao.float8")

    def check(self, recipe: FP8Recipe) -> None:
        """ValueError / NotImplementedError naming what torchao runs here."""
        super().check(recipe)
        allowed = _PARAMS[recipe.name]
        for key, value in recipe.params.items():
            if key not in allowed:
                raise ValueError(
                    f"fp8.params.{key}: torchao recipe {recipe.name!r} takes "
                    f"{sorted(allowed) or 'no parameters'}; remove {key!r}{did_you_mean(key, allowed)}"
                )
            if not isinstance(value, allowed[key]) or (key == "kernel" and value not in _MX_KERNELS):
                raise ValueError(
                    f"fp8.params.{key}={value!r}: use " + (str(list(_MX_KERNELS)) if key == "kernel" else "true/false")
                )
        if recipe.all_gather_fp8 and recipe.name != "tensorwise":
            raise ValueError(
                f"fp8.all_gather_fp8=true with torchao recipe {recipe.name!r}: only 'tensorwise' (one scale per "
                "tensor) can cast a weight shard to float8 before the all-gather; the others all-gather in high "
                "precision by design. Set all_gather_fp8 to null/false, or recipe: tensorwise"
            )
        if recipe.fp8_params:
            raise ValueError(
                "fp8.fp8_params=true with backend torchao: torchao keeps high-precision weights (tensorwise "
                "all-gathers them in float8 anyway); set fp8_params: false, or backend: te"
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
        """Float8Linear (float8 recipes) or MXFP8 weight wrappers (mxfp8) on the filtered Linears; their TP styles."""
        _register_plain_types()
        chosen = module_filter or default_module_filter
        parallel = next((n for n, p in model.named_parameters() if isinstance(p, DTensor)), None)
        if parallel is not None:
            raise ValueError(
                f"fp8.convert: parameter {parallel!r} is already a DTensor (tensor parallelism or FSDP was applied); "
                "torchao converts plain Linears: convert the model first, then parallelize it (parallelize_llama / "
                "apply_llama_tp / apply_fsdp)"
            )
        if not any(chosen(m, n) for n, m in model.named_modules()):
            # An "FP8 run" that computes everything in high precision is a silently ignored setting.
            raise ValueError(
                f"fp8 recipe {recipe.name}: no module of the model is selected for FP8 ("
                + ("the module_filter selects none" if module_filter is not None else
                   "the default filter takes nn.Linear layers with both dims divisible by 16, except the output head "
                   "and embeddings") + "); give the model such Linears, pass a module_filter, or set no fp8 recipe"
            )  # fmt: skip
        if recipe.name in _FLOAT8_RECIPES:
            float8 = _torchao("torchao.float8")
            config = float8.Float8LinearConfig.from_recipe_name(recipe.name)
            if _all_gathers_float8(recipe):
                config = float8.Float8LinearConfig(**{**config.__dict__, "enable_fsdp_float8_all_gather": True})
            float8.convert_to_float8_training(model, module_filter_fn=chosen, config=config)
            linear = _torchao("torchao.float8.float8_linear").Float8Linear
            names = tuple(n for n, m in model.named_modules() if isinstance(m, linear))
            return Converted(modules=names, tp_styles=_tp_styles(recipe))
        return Converted(modules=self._convert_mxfp8(model, recipe, chosen), tp_styles=_tp_styles(recipe))

    def _convert_mxfp8(self, model: nn.Module, recipe: FP8Recipe, chosen: Callable[[nn.Module, str], bool]) -> tuple:
        moe = _torchao("torchao.prototype.moe_training.config")
        kernel_pref = _torchao("torchao.quantization.quantize_.common.kernel_preference").KernelPreference
        quantize_ = _torchao("torchao.quantization").quantize_
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        kernel = recipe.params.get("kernel", "emulated" if on_cpu else "auto")
        if kernel == "auto" and on_cpu:
            raise ValueError(
                "fp8 recipe mxfp8: params.kernel='auto' picks torchao's Triton / CUTLASS kernels, which need CUDA; on "
                "CPU use kernel 'emulated' (the default there), or leave params.kernel unset"
            )
        names = tuple(n for n, m in model.named_modules() if chosen(m, n))
        for fqn in names:
            linear = model.get_submodule(fqn)
            if linear.in_features % 32 or linear.out_features % 32:
                raise ValueError(
                    f"fp8 recipe mxfp8: {fqn} is Linear({linear.in_features}, {linear.out_features}); MXFP8 needs "
                    "both dims divisible by its block size 32; exclude it with module_filter"
                )
        config = moe.MXFP8TrainingOpConfig(
            kernel_preference=kernel_pref.EMULATED if kernel == "emulated" else kernel_pref.AUTO,
            wgrad_with_hp=bool(recipe.params.get("wgrad_with_hp", False)),
        )
        selected = set(names)
        quantize_(model, config, filter_fn=lambda module, fqn: fqn in selected)
        for fqn in names:
            linear = model.get_submodule(fqn)
            linear.forward = types.MethodType(_mxfp8_linear_forward, linear)  # TP styles replace it again
        return names

    @torch.no_grad()
    def refresh(self, model: nn.Module, recipe: FP8Recipe) -> None:
        """tensorwise with float8 all-gather: every weight's scale from the current weights (one all-reduce)."""
        if _all_gathers_float8(recipe):
            _torchao("torchao.float8").precompute_float8_dynamic_scale_for_fsdp(model)


def _tp_styles(recipe: FP8Recipe) -> Mapping[str, type] | None:
    """tensorwise: torchao's float8 styles (float8 activations across TP); mxfp8: local-shard styles.

    mxfp8's styles run each converted Linear on its local shards, where torchao's weight wrapper
    sees ``F.linear`` (see [Note: MXFP8 under tensor parallelism]); rowwise recipes: torch's.
    """
    if recipe.name == "mxfp8":
        return {"colwise": MXFP8ColwiseParallel, "rowwise": MXFP8RowwiseParallel}
    if recipe.name != "tensorwise":
        return None
    tp = _torchao("torchao.float8.float8_tensor_parallel")
    return {"colwise": tp.Float8ColwiseParallel, "rowwise": tp.Float8RowwiseParallel}


@functools.cache
def _register_plain_types() -> tuple[type, ...]:
    """Both torchao weight wrappers save their high-precision tensor (a view: loads are in place)."""
    classes = [_torchao("torchao.float8.fsdp_utils").WeightWithDynamicFloat8CastTensor]
    try:
        tensor = require_module("torchao.prototype.moe_training.tensor", hint=INSTALL_HINT)
        classes += [tensor.MXFP8TrainingWeightWrapperTensor, tensor.Float8TrainingWeightWrapperTensor]
    except ImportError:
        pass  # a torchao without the prototype: nothing of it can be in a model either
    for cls in classes:
        register_fp8_tensor_type(cls, _inner_tensor)
    return tuple(classes)
