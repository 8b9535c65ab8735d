"""The FP8 recipe: which backend quantizes, with which scaling recipe and parameters.

[Note: one FP8 recipe]
~~~~~~~~~~~~~~~~~~~~~~
Users say what they want once, on :attr:`MixedPrecisionPolicy.fp8 <shardbridge.MixedPrecisionPolicy.fp8>`
(in code, or ``fsdp_config.shardbridge.fp8`` in an Accelerate yaml)::

    FP8Recipe(backend="torchao", name="rowwise")
    FP8Recipe(backend="te", name="delayed", params={"amax_history_len": 16}, fp8_params=True)

The recipe is plain data (JSON-able, no callables) and names no framework object. A backend
(:class:`shardbridge.fp8.FP8Backend`, registered by name) turns it into framework objects
(torchao ``Float8LinearConfig`` / ``MXFP8TrainingOpConfig``, TE ``DelayedScaling`` ...) and
checks it: an unknown recipe or parameter is a ValueError naming what the backend supports.
Adapters never branch on the backend's name; they call the backend's hooks.

Recipe names (one vocabulary for every backend)::

    tensorwise          per-tensor current scaling   torchao tensorwise, TE Float8CurrentScaling
    rowwise             per-row scaling, e4m3        torchao rowwise
    rowwise_with_gw_hp  rowwise, weight grad in high precision   torchao
    mxfp8               1x32 blocks, e8m0 scales     torchao MXFP8 training, TE MXFP8BlockScaling
    delayed             per-tensor delayed scaling   TE DelayedScaling
    blockwise           1x128 / 128x128 blocks       TE Float8BlockScaling
    nvfp4               fp4 with fp8 block scales    TE NVFP4BlockScaling
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shardbridge._extras import install_hint

__all__ = ["FP8Recipe"]


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
        from shardbridge.fp8._backend import ENTRY_POINT_GROUP, _is_known, backend_names  # (circular at import)

        if not _is_known(self.backend):
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
