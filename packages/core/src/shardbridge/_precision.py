"""One mixed-precision policy for every host framework.

:class:`PrecisionPolicy` names the four dtypes of a training step once; the core lowers
it to torch FSDP2 (:meth:`PrecisionPolicy.to_fsdp2`), the adapters lower it to
Megatron-FSDP and Accelerate. FP8 is not a dtype of the policy: it is a conversion of the
model's modules before it is parallelized (``shardbridge.fp8.convert``; [Note: one FP8
recipe] there), as torchtitan keeps its float8 converter apart from FSDP's mixed precision.

[Note: the dtypes of one training step]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    sharded main params (main_params_dtype, e.g. fp32)  <- the optimizer steps these
        | all-gather, cast to param_dtype (bf16)
    unsharded params (param_dtype)  -> forward / backward compute (output cast: output_dtype)
        | gradients, cast to grad_comm_dtype (fp32 or bf16)
    reduce-scatter / all-reduce (grad_comm_dtype)
        | cast to main_grads_dtype (fp32)
    sharded main grads (main_grads_dtype)           -> the optimizer reads these

torch FSDP2 has no separate main-parameter copy: the sharded parameters ARE the main
parameters and keep the dtype the model had when ``fully_shard`` ran, and sharded gradients
take that dtype too. So for FSDP2, ``main_params_dtype`` is a requirement on the model at wrap
time (``apply_fsdp`` checks it and says how to fix it) and ``main_grads_dtype`` must equal it.
Megatron-FSDP keeps separate main buffers and honours all four dtypes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from shardbridge._extras import install_hint

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

__all__ = ["PrecisionPolicy", "ALLOWED_DTYPES"]

#: dtypes a policy field may name. FP8 is not a field dtype: it is a conversion (``shardbridge.fp8.convert``).
ALLOWED_DTYPES: tuple[torch.dtype, ...] = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True, kw_only=True)
class PrecisionPolicy:
    """The dtypes of compute, optimizer weights, gradients and gradient communication.

    See [Note: the dtypes of one training step]. Use a preset (:meth:`fp32`, :meth:`bf16`,
    :meth:`bf16_comm`, :meth:`from_name`) unless you need something else.

    Example:
        >>> policy = PrecisionPolicy.bf16()
        >>> policy.param_dtype, policy.effective_grad_comm_dtype
        (torch.bfloat16, torch.float32)
        >>> policy.to_fsdp2().reduce_dtype
        torch.float32
    """

    PRESETS: ClassVar[tuple[str, ...]] = ("fp32", "bf16", "bf16_comm")

    param_dtype: torch.dtype | None = None
    """Compute dtype: parameters are all-gathered and used in forward/backward in this dtype.
    None = compute in the parameter's own dtype (no casting: full precision)."""

    main_params_dtype: torch.dtype = torch.float32
    """dtype of the weights the optimizer updates. torch FSDP2: the model must already be in
    this dtype when it is wrapped. Set it to the model's dtype (e.g. bf16) to train without a
    higher-precision copy."""

    main_grads_dtype: torch.dtype = torch.float32
    """dtype gradients are accumulated in and handed to the optimizer. torch FSDP2: must equal
    ``main_params_dtype`` (sharded gradients take the sharded parameter's dtype)."""

    grad_comm_dtype: torch.dtype | None = None
    """dtype of the gradient reduce-scatter (and the HSDP all-reduce). None = main_grads_dtype.
    Narrower than main_grads_dtype saves bandwidth and loses precision (warned)."""

    output_dtype: torch.dtype | None = None
    """dtype each wrapped unit casts its floating-point outputs to. None = no cast."""

    cast_forward_inputs: bool = True
    """Cast floating-point forward inputs of each wrapped unit to ``param_dtype``.
    False = the caller feeds inputs in the right dtype."""

    def __post_init__(self) -> None:
        for field_name in ("param_dtype", "grad_comm_dtype", "output_dtype"):
            _check_dtype(field_name, getattr(self, field_name), allow_none=True)
        for field_name in ("main_params_dtype", "main_grads_dtype"):
            _check_dtype(field_name, getattr(self, field_name), allow_none=False)
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(f"cast_forward_inputs={self.cast_forward_inputs!r} must be a bool")
        lost = _what_is_lost(self.effective_grad_comm_dtype, self.main_grads_dtype)
        if lost:
            warnings.warn(
                f"grad_comm_dtype={self.grad_comm_dtype} is narrower than main_grads_dtype="
                f"{self.main_grads_dtype}: gradients are reduced across data-parallel ranks with {lost}; "
                f"set grad_comm_dtype=None to communicate in {self.main_grads_dtype}",
                UserWarning,
                stacklevel=3,
            )

    @property
    def effective_grad_comm_dtype(self) -> torch.dtype:
        """The dtype gradients are communicated in: ``grad_comm_dtype`` or ``main_grads_dtype``."""
        return self.grad_comm_dtype if self.grad_comm_dtype is not None else self.main_grads_dtype

    # -- presets -----------------------------------------------------------------------------

    @classmethod
    def fp32(cls) -> PrecisionPolicy:
        """Everything in fp32: no mixed precision.

        Example:
            >>> PrecisionPolicy.fp32().to_fsdp2().param_dtype is None
            True
        """
        return cls()

    @classmethod
    def bf16(cls) -> PrecisionPolicy:
        """bf16 compute; fp32 main params, main grads and gradient communication.

        Example:
            >>> PrecisionPolicy.bf16().effective_grad_comm_dtype
            torch.float32
        """
        return cls(param_dtype=torch.bfloat16)

    @classmethod
    def bf16_comm(cls) -> PrecisionPolicy:
        """bf16 compute and bf16 reduce-scatter; fp32 main params and grads.

        Halves the gradient traffic of :meth:`bf16`. Choosing the preset is the intent, so it
        does not warn about the narrower communication dtype.

        Example:
            >>> PrecisionPolicy.bf16_comm().to_fsdp2().reduce_dtype
            torch.bfloat16
        """
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return cls(param_dtype=torch.bfloat16, grad_comm_dtype=torch.bfloat16)

    @classmethod
    def from_name(cls, name: str) -> PrecisionPolicy:
        """A preset by name (for the CLI and config files): one of :attr:`PRESETS`.

        Raises:
            ValueError: unknown name; the message lists the valid ones.

        Example:
            >>> PrecisionPolicy.from_name("bf16") == PrecisionPolicy.bf16()
            True
        """
        factories: dict[str, Callable[[], PrecisionPolicy]] = {
            "fp32": cls.fp32,
            "bf16": cls.bf16,
            "bf16_comm": cls.bf16_comm,
        }
        assert tuple(factories) == cls.PRESETS
        if name not in factories:
            raise ValueError(f"unknown mixed-precision preset {name!r}; choose one of {list(cls.PRESETS)}")
        return factories[name]()

    # -- rules shared by every FSDP2 lowering (core, hf adapter) --------------------------------

    def check_grads_match_params(self) -> None:
        """NotImplementedError unless ``main_grads_dtype == main_params_dtype`` (torch FSDP2's rule).

        torch FSDP2 has no separate main-gradient buffer: sharded gradients live in the
        sharded parameter's dtype. Megatron-FSDP has one (``shardbridge_megatron_fsdp``).
        """
        if self.main_grads_dtype != self.main_params_dtype:
            raise NotImplementedError(
                f"torch FSDP2 keeps sharded gradients in the sharded parameter's dtype "
                f"(main_params_dtype={self.main_params_dtype}), so main_grads_dtype={self.main_grads_dtype} "
                "cannot be lowered to it; set main_grads_dtype=main_params_dtype, or use Megatron-FSDP "
                f"(shardbridge_megatron_fsdp; {install_hint('megatron')}) which keeps separate main grads"
            )

    def check_model_dtype(self, model: torch.nn.Module, *, fix: str = "") -> None:
        """ValueError naming the first floating parameter not in ``main_params_dtype``.

        torch FSDP2 keeps the sharded (optimizer) weights in the model's own dtype, so the model
        must be in ``main_params_dtype`` when it is wrapped.

        Args:
            model: the model about to be wrapped.
            fix: what else the user may change, appended to the message (an adapter names its
                config key here).
        """
        dtype = self.main_params_dtype
        wrong = [(n, p.dtype) for n, p in model.named_parameters() if p.dtype.is_floating_point and p.dtype != dtype]
        if wrong:
            name, got = wrong[0]
            raise ValueError(
                f"parameter {name!r} has dtype {got} (and {len(wrong) - 1} more not in {dtype}), but "
                f"policy.main_params_dtype={dtype}; torch FSDP2 keeps the sharded (optimizer) weights in "
                f"the model's dtype, so convert the model before wrapping: model.to({dtype}), or "
                + (fix or f"set main_params_dtype=main_grads_dtype={got}")
            )

    # -- lowering ----------------------------------------------------------------------------

    def to_fsdp2(self) -> TorchMixedPrecisionPolicy:
        """Lower to ``torch.distributed.fsdp.MixedPrecisionPolicy`` (FSDP2).

        ``param_dtype -> param_dtype``, ``effective_grad_comm_dtype -> reduce_dtype``,
        ``output_dtype`` and ``cast_forward_inputs`` unchanged. ``main_params_dtype`` has no
        FSDP2 field: it is the dtype of the model at wrap time, checked by ``apply_fsdp``.

        Raises:
            NotImplementedError: ``main_grads_dtype != main_params_dtype``; torch FSDP2 cannot
                express it, the message names what can.

        Example:
            >>> PrecisionPolicy.bf16_comm().to_fsdp2()
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, output_dtype=None, cast_forward_inputs=True)
        """
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

        self.check_grads_match_params()
        return TorchMixedPrecisionPolicy(
            param_dtype=self.param_dtype,
            reduce_dtype=self.effective_grad_comm_dtype,
            output_dtype=self.output_dtype,
            cast_forward_inputs=self.cast_forward_inputs,
        )


def _check_dtype(field_name: str, value: object, *, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if value in ALLOWED_DTYPES:
        return
    hint = ""
    if isinstance(value, torch.dtype) and value.is_floating_point:
        hint = "; for FP8 training convert the model instead: shardbridge.fp8.convert(model, FP8Recipe(...))"
    allowed = ", ".join(str(d) for d in ALLOWED_DTYPES) + (" or None" if allow_none else "")
    raise ValueError(f"{field_name}={value!r} is not an allowed dtype; choose one of {allowed}{hint}")


def _significant_bits(dtype: torch.dtype) -> int:
    # eps = 2**-(mantissa bits); +1 for the implicit leading bit.
    return round(-torch.log2(torch.tensor(torch.finfo(dtype).eps, dtype=torch.float64)).item()) + 1


def _what_is_lost(narrow: torch.dtype, wide: torch.dtype) -> str:
    """Describe the precision/range ``narrow`` loses against ``wide``; "" if nothing."""
    lost = []
    bits_narrow, bits_wide = _significant_bits(narrow), _significant_bits(wide)
    if bits_narrow < bits_wide:
        lost.append(f"{bits_narrow} significant bits instead of {bits_wide}")
    max_narrow, max_wide = torch.finfo(narrow).max, torch.finfo(wide).max
    if max_narrow < max_wide:
        lost.append(f"a largest finite value of {max_narrow:.4g} instead of {max_wide:.4g}")
    return " and ".join(lost)
