"""Tensor-parallel DTensor parameters in Megatron-FSDP: a scoped, version-gated patch.

[Note: TP DTensor parameters in Megatron-FSDP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Megatron-FSDP keeps every parameter's TP-LOCAL piece in its buffers (chunked by local rows,
``to_local_if_dtensor(p).shape[1:]``) and describes each piece to the optimizer and to DCP as
a DTensor on ``(dp_shard, tp)`` (``make_fsdp_dtensor``). Two lines there view the flat
buffer slice as ``(-1, *orig_param.shape[1:])``: ``make_fsdp_dtensor`` itself and the
cached-gradient branch of ``ParamAndGradBuffer.update_main_grads``. For a Megatron-style
parameter (a plain tensor with ``tensor_model_parallel``/``partition_dim``) ``orig_param`` is
the local piece, so that is right for ``partition_dim`` 0 and 1. For a torch DTensor TP
parameter ``orig_param`` is the DTensor, whose shape is GLOBAL: right for ``Shard(0)``
(column-parallel: local and global agree past dim 0), wrong for ``Shard(1)`` (row-parallel)::

    down.weight (64, 128) Shard(1) over tp=2, tp rank 1: local piece (64, 64); e.g. a
    buffer slice of 32 local rows = 2048 elements
      upstream view  (-1, 128) -> (16, 128)   chunk metadata "invalid": offsets (0, 128)
      correct view   (-1,  64) -> (32,  64)   box rows 0..31, cols 64..127

And with ``strategy="no_shard"`` ``make_fsdp_dtensor`` compares the GLOBAL numel of any TP
DTensor with its local buffer slice and raises ("Mismatch between param shape ..."), so
``no_shard`` x TP fails for column-parallel parameters too.

Why a patch, not Megatron-style attributes: handing Megatron-FSDP plain local tensors with
``partition_dim`` would make it build the right DTensors, but the module's forward would then
see plain local weights, and torch's TP styles (``RowwiseParallel``, ``ColwiseParallel``,
vocab-parallel embeddings) compute on DTensor weights. The patch keeps the user's DTensor TP
model exactly as torch built it and fixes only the two shape computations:

* ``make_fsdp_dtensor`` (module global of ``param_and_grad_buffer``): for a TP DTensor
  parameter (more than one shard), the FSDP DTensor is built from upstream's own
  ``_get_fsdp_tensor_spec`` (same mesh, placements, ``_shard_order``) with the slice viewed as
  ``(-1, *tp_local_shape[1:])``; validation and chunk metadata by upstream's own functions.
  Every other parameter goes to upstream's function unchanged.
* ``ParamAndGradBuffer.update_main_grads``: the cached gradient DTensors of TP DTensor
  parameters are dropped before upstream's method runs, so it builds them through the
  patched ``make_fsdp_dtensor`` (a Python object per parameter per step, no collective).

One more mismatch is not in Megatron-FSDP's code but in what it is handed: its gradient hook
(``_grad_acc``) copies ``to_local_if_dtensor(param.grad)`` into the TP-local main-gradient
slot, so the gradient must arrive in the parameter's own placements. torch's vocab-parallel
embedding (``RowwiseParallel`` on ``nn.Embedding``, weight ``Shard(0)``) produces a
``Replicate`` gradient of the global shape (torch 2.13: (16, 4) on every rank for a (16, 4)
weight over tp=2), and Megatron-FSDP fails copying 256 rows into 128 ("size of tensor a
(128) must match ... (256)"). :func:`align_tp_grads` registers a gradient hook on each TP
DTensor parameter (it runs before the gradient is accumulated, hence before Megatron-FSDP's
post-accumulate hook) that redistributes it to the parameter's placements
(``Replicate -> Shard(0)``: a local slice, no communication; a ``Partial`` gradient, not seen
with the reference Llama, would be all-reduced over tp by the redistribution). torch FSDP2 does the same redistribution itself.

Both Megatron-FSDP copies have the same two lines: the standalone ``megatron_fsdp`` 0.6.1 and
the copy bundled in megatron-core 0.16.1 (``megatron.core.distributed.fsdp.src.megatron_fsdp``,
version 0.3.1). :func:`install` takes the package module of either. Gate: the package's
``__version__`` must be one of the checked ones (RuntimeError otherwise: without the patch a
row-parallel model is silently mis-described to the optimizer and DCP). Reversible:
:func:`uninstall` restores the identical originals.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Iterable
from typing import Any

import torch
from shardbridge._compat import compute_local_shape_and_global_offset, parse_version
from shardbridge.adapters import Patch, PatchPlan, patch_attr
from torch.distributed.tensor import DTensor

from shardbridge_megatron_fsdp._compat import BUNDLED, STANDALONE, fsdp_tensor_spec, require_megatron_fsdp

__all__ = ["PATCHES", "align_tp_grads", "install", "installed", "is_tp_dtensor", "megatron_partition_dim", "uninstall"]

# (package name) -> versions of that Megatron-FSDP copy checked against the patch.
_CHECKED: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    STANDALONE: ((0, 6, 1), (0, 6, 1)),  # pip megatron-fsdp 0.6.1 (Megatron-LM core_r0.19.0)
    BUNDLED: ((0, 3, 1), (0, 3, 1)),  # the copy inside megatron-core 0.16.1
}
_INSTALL_HINTS = {
    STANDALONE: 'pip install "megatron-fsdp==0.6.1" (in the megatron extra)',
    BUNDLED: 'pip install "megatron-core==0.16.1" (the megatron-core extra; never beside megatron-fsdp)',
}

_COVERS = (
    "reproduced (no upstream issue): make_fsdp_dtensor / update_main_grads view a TP DTensor's "
    "local slice as (-1, *global_shape[1:]) and compare its global numel under no_shard"
)
# name -> (what is replaced, under the package's param_and_grad_buffer; what the replacement does; its undo)
_TARGETS: dict[str, tuple[str, str, str]] = {
    "make_fsdp_dtensor": (
        "make_fsdp_dtensor",
        "TP DTensor parameters: the FSDP DTensor views the slice with the TP-local shape",
        "uninstall() restores the original module global",
    ),
    "update_main_grads": (
        "ParamAndGradBuffer.update_main_grads",
        "cached gradient DTensors of TP DTensor parameters are rebuilt by the patched function",
        "uninstall() restores the original method",
    ),
}
PATCHES: tuple[str, ...] = tuple(_TARGETS)
"""Names of the two patches (see [Note: TP DTensor parameters in Megatron-FSDP])."""

_ALIGNED_ATTR = "_shardbridge_tp_grad_aligned"
_lock = threading.Lock()
_undo: dict[str, list[Callable[[], None]]] = {}  # package name -> undos of its patches


def _plan(name: str) -> PatchPlan:
    checked = _CHECKED[name]
    return PatchPlan(
        owner="shardbridge_megatron_fsdp",
        framework=name,
        patches=tuple(
            Patch(
                name=patch,
                target=f"{name}.param_and_grad_buffer.{target}",
                covers=_COVERS,
                checked=checked,
                what=what,
                undo=undo,
            )
            for patch, (target, what, undo) in _TARGETS.items()
        ),
        installed=lambda: (0,),
        install_hint=lambda low, high: _INSTALL_HINTS[name],
        widen_hint="re-check both lines of [Note: TP DTensor parameters in Megatron-FSDP] and widen _CHECKED",
    )


def _package_name(package: types.ModuleType) -> str:
    name = package.__name__
    if name not in _CHECKED:
        raise ValueError(
            f"package {name!r} is not a Megatron-FSDP copy this patch knows; pass the module "
            f"`megatron_fsdp` (standalone) or `{BUNDLED}` (megatron-core's copy)"
        )
    return name


def _version(package: types.ModuleType) -> tuple[int, ...]:
    return parse_version(str(package.__version__))


def is_tp_dtensor(param: Any) -> bool:
    """Whether ``param`` is a torch DTensor TP parameter (sharded over its mesh: Shard(d), any d)."""
    return isinstance(param, DTensor) and any(p.is_shard() for p in param.placements)


def megatron_partition_dim(param: Any) -> int | None:
    """The TP dim of a Megatron-style parameter (``tensor_model_parallel`` + ``partition_dim``), else None.

    Megatron-FSDP reads the same attributes (and TE's ``_tensor_parallel_mode``); such
    parameters are plain TP-local tensors and need no patch.
    """
    if isinstance(param, DTensor) or not getattr(param, "tensor_model_parallel", False):
        return None
    dim = getattr(param, "partition_dim", None)
    return int(dim) if dim is not None and dim >= 0 else None


def _tp_local_shape(param: DTensor) -> tuple[int, ...]:
    """The TP-local shape of a DTensor TP parameter.

    Computed from its placements, not read from its local data (which Megatron-FSDP may have freed).
    """
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    assert coordinate is not None, "this rank is not in the TP parameter's mesh"
    shape, _ = compute_local_shape_and_global_offset(
        tuple(param.shape), tuple(mesh.shape), list(coordinate), list(param.placements)
    )
    return tuple(shape)


def _make_fsdp_dtensor(pgb: types.ModuleType, original: Callable[..., Any]) -> Callable[..., Any]:
    """``make_fsdp_dtensor`` that views TP DTensor slices with their TP-local shape."""

    def make_fsdp_dtensor(
        local_tensor: torch.Tensor,
        param: torch.nn.Parameter,
        dist_index: Any,
        is_sharded_param: bool = True,
        is_expert_param: bool = False,
        run_check: bool = False,
        update_uneven_dtensor_chunk_meta: bool = False,
        force_sync_tp_duplicated_param: bool = False,
    ) -> DTensor:
        if not is_tp_dtensor(param):
            return original(
                local_tensor,
                param,
                dist_index,
                is_sharded_param=is_sharded_param,
                is_expert_param=is_expert_param,
                run_check=run_check,
                update_uneven_dtensor_chunk_meta=update_uneven_dtensor_chunk_meta,
                force_sync_tp_duplicated_param=force_sync_tp_duplicated_param,
            )
        local_shape = _tp_local_shape(param)
        if not is_sharded_param and local_tensor.numel() != torch.Size(local_shape).numel():
            raise ValueError(
                f"[Megatron-FSDP + shardbridge] unsharded slice of {local_tensor.numel()} elements for a TP "
                f"parameter whose TP-local shape is {local_shape}"
            )
        mesh, placements = fsdp_tensor_spec(
            pgb, param, dist_index, is_sharded_param=is_sharded_param, is_expert_param=is_expert_param
        )
        # flat buffer slice -> whole TP-local rows (Megatron-FSDP chunks by local rows)
        view = local_tensor.view(-1, *local_shape[1:])
        out = DTensor.from_local(view, mesh, placements, run_check=False, shape=param.shape, stride=param.stride())
        if run_check:
            pgb.validate_uneven_dtensor(out)  # looked up now: the CPU patch may replace it
        if update_uneven_dtensor_chunk_meta:
            pgb.update_uneven_dtensor_chunk_metadata(out)
        return out

    make_fsdp_dtensor.__wrapped__ = original  # type: ignore[attr-defined]
    return make_fsdp_dtensor


def _update_main_grads(original: Callable[..., Any]) -> Callable[..., Any]:
    """``update_main_grads`` that rebuilds (rather than re-views) TP DTensor gradients."""

    def update_main_grads(self: Any) -> Any:
        for name, param in self.optimizer_named_parameters:
            if is_tp_dtensor(getattr(param, "orig_param", None)):
                self.dist_main_grad.pop(name, None)
        return original(self)

    update_main_grads.__wrapped__ = original  # type: ignore[attr-defined]
    return update_main_grads


def align_tp_grads(params: Iterable[torch.Tensor]) -> int:
    """Make every TP DTensor parameter's gradient arrive in the parameter's own placements.

    See [Note: TP DTensor parameters in Megatron-FSDP]. Call AFTER wrapping, on the
    parameters the wrapped module computes with (Megatron-FSDP's "raw" parameters):
    ``MegatronFSDP.__init__`` moves the module with ``module.to(device)``, which for DTensor
    parameters swaps tensors (``torch.utils.swap_tensors``) and drops gradient hooks
    registered earlier (measured: a hook registered before wrapping never fires after).
    Idempotent.

    Returns:
        How many parameters have the hook (now or from an earlier call).

    Example:
        >>> align_tp_grads(raw_parameters(wrapped))  # doctest: +SKIP
        12
    """
    count = 0
    for param in params:
        if not is_tp_dtensor(param) or not param.requires_grad:
            continue
        count += 1
        if getattr(param, _ALIGNED_ATTR, False):
            continue
        param.register_hook(_redistribute_to(param.device_mesh, tuple(param.placements)))
        setattr(param, _ALIGNED_ATTR, True)
    return count


def _redistribute_to(mesh: Any, placements: tuple[Any, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != placements:
            return grad.redistribute(mesh, placements)  # e.g. Replicate -> Shard(0) (vocab-parallel embedding)
        return grad

    return hook


def installed(package: types.ModuleType) -> bool:
    """Whether the patch is active on ``package``."""
    return _package_name(package) in _undo


def install(package: types.ModuleType | None = None) -> bool:
    """Install the TP DTensor patch on a Megatron-FSDP copy (idempotent, any device).

    See [Note: TP DTensor parameters in Megatron-FSDP]. Install it before wrapping a model
    whose parameters are TP DTensors; it changes nothing for other parameters (plain tensors,
    Megatron-style ``partition_dim`` tensors, Replicate DTensors).

    Args:
        package: the Megatron-FSDP package module: ``megatron_fsdp`` (standalone, the
            default when None) or ``megatron.core.distributed.fsdp.src.megatron_fsdp``
            (megatron-core's bundled copy).

    Returns:
        True (the patch is active after the call).

    Raises:
        ValueError: ``package`` is neither copy.
        RuntimeError: the copy's version was not checked against the patch.

    Example:
        >>> import megatron.core.distributed.fsdp.src.megatron_fsdp as mfsdp  # doctest: +SKIP
        >>> install(mfsdp)  # doctest: +SKIP
        True
    """
    if package is None:
        package = require_megatron_fsdp()
    name = _package_name(package)
    plan = _plan(name)
    version = _version(package)
    for patch in PATCHES:
        plan.gate(patch, version)  # RuntimeError outside the checked versions
    with _lock:
        if name in _undo:
            return True
        import importlib

        pgb = importlib.import_module(f"{name}.param_and_grad_buffer")
        _undo[name] = [
            patch_attr(pgb, "make_fsdp_dtensor", _make_fsdp_dtensor(pgb, pgb.make_fsdp_dtensor)),
            patch_attr(
                pgb.ParamAndGradBuffer,
                "update_main_grads",
                _update_main_grads(pgb.ParamAndGradBuffer.update_main_grads),
            ),
        ]
    return True


def uninstall(package: types.ModuleType | None = None) -> None:
    """Undo :func:`install` on ``package`` (a no-op when not installed).

    Models wrapped while it was installed describe their TP DTensor parameters wrongly after
    this (their next gradient attachment uses upstream's view): tests and canaries only.
    """
    if package is None:
        package = require_megatron_fsdp()
    name = _package_name(package)
    with _lock:
        for undo in reversed(_undo.pop(name, [])):
            undo()
