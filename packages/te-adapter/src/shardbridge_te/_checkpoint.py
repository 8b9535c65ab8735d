"""TE state in shardbridge checkpoints: FP8 parameters made portable, ``_extra_state`` made loadable.

[Note: TE FP8 parameters in checkpoints]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``quantized_model_init`` makes TE weights ``Float8Tensor`` / ``MXFP8Tensor`` /
``Float8BlockwiseQTensor`` / ``NVFP4Tensor`` objects. DCP would pickle those classes (a reader
without TE fails). :func:`register_te_fp8_types` registers each with the core's
``register_fp8_tensor_type(cls, to_plain)`` with ``to_plain = t.dequantize()``: the checkpoint
holds plain high-precision tensors, loadable by a model without FP8 (or by torch alone), and a
load into an FP8 model goes through ``param.copy_(plain)``, which TE re-quantizes. Re-quantizing
dequantized values reproduces them exactly for MXFP8, blockwise and NVFP4 where the new local
shard's blocks coincide with the saved ones, and within 2**-21 relative for current scaling (its
fp32 ``scale_inv`` is recomputed); blocks that merge pieces of different scales re-quantize
within the format's precision. Tested on CPU with TE's real classes and format references for
its kernels (``tests/test_te_fp8_checkpoint_structural.py``); TE's kernels: GPU tier (docs/te.md).

[Note: portable _extra_state]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
TE saves FP8 metadata as ``_extra_state``: a uint8 tensor holding a pickle (recipe object,
``scale``/``amax_history`` tensors, a dict of Python values). The pickle differs in SIZE from
rank to rank, and DCP treats a plain tensor as replicated with one size: loading fails
(TE #1860; TE's own tests drop ``_extra_state``). It also pickles TE's recipe class (a reader
without TE fails), and TE 2.20 refuses to unpickle it by default. Here ``get_extra_state``
returns ``bytes``: ``torch.save`` of a dict of plain values (format tag, recipe as class name
plus fields, the tensors, the extra variables), loadable with ``weights_only=True``. DCP stores
a non-tensor once (deduplicated) with no size in its metadata, so any rank and any layout
loads it; ``set_extra_state`` rebuilds TE's state from it without unpickling any class. An
empty state (no FP8, or a stateless recipe) has ``recipe=None``, so FP8 and non-FP8 models
read each other's checkpoints.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import io
import pickle
from typing import Any

import torch
from shardbridge.fp8 import register_fp8_tensor_type
from torch import nn

from shardbridge_te._patches import keep_instance_undo, patch_attr

__all__ = [
    "EXTRA_STATE_FORMAT",
    "decode_extra_state",
    "encode_extra_state",
    "install_portable_extra_state",
    "recipe_from_record",
    "recipe_to_record",
    "register_te_fp8_types",
]

EXTRA_STATE_FORMAT = "shardbridge_te.extra_state/1"
_TENSOR_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
_RECIPE_MODULE = "transformer_engine.common.recipe"


@functools.cache
def register_te_fp8_types() -> tuple[type, ...]:
    """Register TE's FP8 tensor classes with the core checkpoint (once). See [Note: TE FP8 parameters in checkpoints].

    Returns:
        The classes registered (those this TE has).
    """
    from shardbridge_te._compat import te_pytorch

    te = te_pytorch()
    registered = []
    for name in ("Float8Tensor", "MXFP8Tensor", "Float8BlockwiseQTensor", "NVFP4Tensor", "HybridQuantizedTensor"):
        cls = getattr(te, name, None)
        if isinstance(cls, type) and issubclass(cls, torch.Tensor):
            register_fp8_tensor_type(cls, _dequantize)
            registered.append(cls)
    return tuple(registered)


def _dequantize(t: torch.Tensor) -> torch.Tensor:
    return t.dequantize()


# --------------------------------------------------------------------------- recipe records


def recipe_to_record(recipe: Any) -> dict[str, Any]:
    """A TE recipe dataclass as ``{"class": name, "fields": {...}}`` of plain values.

    Enums become ``{"enum": class name, "name": member}``.

    Raises:
        ValueError: a field holds something that is not plain data (a custom
            ``amax_compute_algo`` function): it cannot be stored portably.

    Example:
        >>> from dataclasses import dataclass
        >>> @dataclass
        ... class R:
        ...     margin: int = 0
        >>> recipe_to_record(R())
        {'class': 'R', 'fields': {'margin': 0}}
    """
    fields = {}
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        if isinstance(value, enum.Enum):
            value = {"enum": type(value).__name__, "name": value.name}
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(
                f"recipe {type(recipe).__name__}.{f.name}={value!r} is not plain data and cannot be saved "
                "portably; use a named algorithm (e.g. amax_compute_algo='max') for checkpointed runs"
            )
        fields[f.name] = value
    return {"class": type(recipe).__name__, "fields": fields}


def recipe_from_record(record: dict[str, Any], module: Any = None) -> Any:
    """Rebuild a recipe from :func:`recipe_to_record`'s output (``module`` = where its classes live).

    The record comes from a checkpoint, so it is untrusted (see [Note: untrusted checkpoints] in
    the core's ``checkpoint/_trust.py``): only a public dataclass of ``module`` (a subclass of its
    ``Recipe`` where it has one) is built, only from plain values and members of public enums
    of ``module``; anything else is a ValueError and nothing is called.

    Raises:
        ValueError: the record names something that is not a recipe / enum member.
    """
    module = module if module is not None else importlib.import_module(_RECIPE_MODULE)
    where = f"FP8 recipe record {record.get('class')!r} from the checkpoint's _extra_state"
    if not isinstance(record, dict) or not isinstance(record.get("fields"), dict):
        raise ValueError(f"{where} is not a recipe record; the checkpoint is damaged or not trusted")
    cls = _public_attr(module, record.get("class"), where)
    base = getattr(module, "Recipe", None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and (base is None or issubclass(cls, base))):
        raise ValueError(f"{where}: {record.get('class')!r} is not a recipe class of {module.__name__}; not trusted")
    fields = {}
    for name, value in record["fields"].items():
        if isinstance(value, dict) and "enum" in value:
            enum_cls = _public_attr(module, value.get("enum"), where)
            member = value.get("name")
            if not (isinstance(enum_cls, type) and issubclass(enum_cls, enum.Enum)) or member not in enum_cls.__members__:
                raise ValueError(f"{where}: field {name!r} names {value!r}, not an enum member; not trusted")
            value = enum_cls[member]
        elif value is not None and not isinstance(value, (bool, int, float, str)):
            raise ValueError(f"{where}: field {name!r} is not plain data; not trusted")
        fields[name] = value
    init_names = {f.name for f in dataclasses.fields(cls) if f.init}
    return cls(**{k: v for k, v in fields.items() if k in init_names})


def _public_attr(module: Any, name: Any, where: str) -> Any:
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") or not hasattr(module, name):
        raise ValueError(f"{where}: {name!r} is not a public name of {module.__name__}; not trusted")
    return getattr(module, name)


# --------------------------------------------------------------------------- extra state


def encode_extra_state(state: dict[str, Any] | None) -> bytes:
    """TE's unpickled extra-state dict (or None) -> portable bytes. See [Note: portable _extra_state].

    Example:
        >>> payload = decode_extra_state(encode_extra_state(None))
        >>> payload["format"], payload["recipe"]
        ('shardbridge_te.extra_state/1', None)
    """
    payload: dict[str, Any] = {"format": EXTRA_STATE_FORMAT, "recipe": None, "tensors": {}, "extra": {}}
    if state:
        payload["recipe"] = recipe_to_record(state["recipe"]) if state.get("recipe") is not None else None
        payload["tensors"] = {k: state[k].detach().cpu().clone() for k in _TENSOR_KEYS if k in state}
        payload["extra"] = {
            k: v for k, v in state.get("extra_fp8_variables", {}).items() if isinstance(v, (bool, int, float, str))
        }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    return buffer.getvalue()


def decode_extra_state(data: bytes) -> dict[str, Any]:
    """Portable bytes -> payload dict (``weights_only``: no class is unpickled).

    Raises:
        ValueError: ``data`` is not a shardbridge_te extra state.
    """
    payload = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != EXTRA_STATE_FORMAT:
        raise ValueError(f"_extra_state is not a {EXTRA_STATE_FORMAT} payload (got {type(payload).__name__})")
    return payload


def is_portable_extra_state(value: Any) -> bool:
    """Whether ``value`` is a portable extra state (``bytes`` from :func:`encode_extra_state`)."""
    return isinstance(value, (bytes, bytearray)) and EXTRA_STATE_FORMAT.encode() in bytes(value[:512])


def _te_state_from_native(native: Any) -> dict[str, Any] | None:
    """TE's get_extra_state output (uint8 pickle tensor, written by this very process) -> dict."""
    if native is None:
        return None
    if isinstance(native, torch.Tensor):
        if native.numel() == 0:
            return None
        return pickle.loads(native.detach().cpu().numpy().tobytes())  # our own module's bytes
    raise ValueError(f"unexpected TE extra state of type {type(native).__name__}")


def _apply_payload(module: nn.Module, payload: dict[str, Any]) -> None:
    """TE's set_extra_state, from a decoded payload instead of an unpickled TE object (GPU-only path)."""
    if payload["recipe"] is None:
        return
    recipe = recipe_from_record(payload["recipe"])
    module.fp8_meta.update(payload["extra"])
    module.fp8_meta["recipe"] = recipe
    module.fp8_meta.pop("global_fp8_buffer_pos_fwd_recompute", None)
    module.init_fp8_meta_tensors(recipe)
    tensors = payload["tensors"]
    with torch.no_grad():
        for direction in ("fwd", "bwd"):
            meta = module.fp8_meta.get(f"scaling_{direction}")
            if meta is None or f"scale_{direction}" not in tensors:
                continue
            meta.scale.copy_(tensors[f"scale_{direction}"])
            meta.amax_history.copy_(tensors[f"amax_history_{direction}"])


def install_portable_extra_state(module: nn.Module) -> None:
    """Make ``module``'s ``_extra_state`` portable bytes (instance patch, idempotent).

    See [Note: portable _extra_state]. TE-native states (uint8 tensors from older
    checkpoints) still load through TE's own ``set_extra_state``. Patch
    ``portable_extra_state``: its undo is kept on the module (``shardbridge_te.unpatch(model)``).
    """
    if getattr(module.get_extra_state, "_shardbridge_portable", False):
        return
    native_get, native_set = module.get_extra_state, module.set_extra_state

    def get_extra_state() -> bytes:
        return encode_extra_state(_te_state_from_native(native_get()))

    def set_extra_state(state: Any) -> None:
        if is_portable_extra_state(state):
            _apply_payload(module, decode_extra_state(state))
        else:
            native_set(state)

    get_extra_state._shardbridge_portable = True  # type: ignore[attr-defined]
    undo_get = patch_attr(module, "get_extra_state", get_extra_state)
    undo_set = patch_attr(module, "set_extra_state", set_extra_state)

    def undo() -> None:
        undo_set()
        undo_get()

    keep_instance_undo(module, "portable_extra_state", undo)
