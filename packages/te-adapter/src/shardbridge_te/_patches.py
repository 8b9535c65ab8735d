"""The patch plan: what the adapter changes in a TE release, and which upstream issue each covers.

Every change the adapter makes to TransformerEngine is a :class:`Patch` in :data:`PATCHES`, and
the code that makes it asks the plan first (:func:`gate`): :func:`shardbridge_te.set_device_mesh`
for ``dtensor_params``, ``local_forward``, ``float8_pre_all_gather_amax_group`` and
``portable_extra_state``, :func:`shardbridge_te.materialize` for ``reset_parameters``. Each
patch declares the TE versions it was checked against (``checked``) and what happens outside
them (``outside``): ``"error"`` where running without the patch would silently give wrong
results or the patch reads TE internals that may have moved, ``"skip"`` (a warning naming what
is lost) where TE without it still works or fails loudly on its own. The plan is pure (a
function of the version tuple), so it is tested without TE.

Reversible: the class patch (``Float8Tensor.fsdp_pre_all_gather``) keeps its undo in this module
(:func:`unpatch` with no model restores the identical original attribute); the instance patches
(``forward``, ``get_extra_state`` / ``set_extra_state``) keep theirs on the module
(:func:`unpatch(model) <unpatch>`). ``dtensor_params`` converts the model's parameters in place
(the model's data, as ``fully_shard`` does) and ``reset_parameters`` replaces a call rather than
an attribute: neither leaves anything to undo.

[Note: why patch at all]
~~~~~~~~~~~~~~~~~~~~~~~~
TE PR #2713 (``set_device_mesh``) is the upstream design for DTensor TP parameters, but it is
merged in no release (checked up to 2.20.2). The adapter gives released TE 2.x the same
behaviour, and fixes what the PR leaves open: uneven shapes (the global shape is passed
explicitly), GroupedLinear, an amax-reduction group that does not depend on a mesh axis named
"shard", and ``_extra_state`` that DCP can load across ranks and layouts (TE #1860).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shardbridge.adapters import Patch as _CorePatch
from shardbridge.adapters import PatchPlan, fmt_version, patch_attr
from torch import nn

__all__ = [
    "LAST_CHECKED",
    "MIN_VERSION",
    "PATCHES",
    "Patch",
    "gate",
    "patch_attr",
    "patch_float8_pre_all_gather",
    "patch_plan",
    "unpatch",
]

Version = tuple[int, int, int]

MIN_VERSION: Version = (2, 8, 0)
"""Oldest TE the adapter supports (the ``te`` extra's floor)."""
LAST_CHECKED: Version = (2, 20, 2)
"""Newest TE whose Python sources the adapter was checked against (structural tier)."""

_UNDO_ATTR = "_shardbridge_te_undo"
"""Attribute on a patched TE module: ``{patch name: undo}`` of its instance patches."""


@dataclass(frozen=True, kw_only=True)
class Patch(_CorePatch):
    """The core's :class:`~shardbridge.adapters.Patch`, checked against ``MIN_VERSION .. LAST_CHECKED`` by default."""

    checked: tuple[tuple[int, ...], tuple[int, ...]] = (MIN_VERSION, LAST_CHECKED)
    """``(oldest, newest)`` TE versions the patch was checked against, both inclusive."""


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="dtensor_params",
        target="TE module parameters (weight, bias, ...) of every TE module",
        covers="TE PR #2713 (set_device_mesh, unmerged); uneven shapes and GroupedLinear beyond it",
        what="TP-sharded parameters become DTensors on the TP mesh with explicit global shapes",
        outside="error",
        undo="not undone: the model's own parameters are converted in place (as fully_shard does)",
    ),
    Patch(
        name="local_forward",
        target="<TE module>.forward (instance attribute)",
        covers="TE PR #2713 (_extract_trainable_tensor_from_dtensor)",
        what="forward hands TE the local tensors of DTensor parameters; gradients return as DTensors",
        outside="error",
        undo="unpatch(model) removes the instance attribute (the class's forward shows again)",
    ),
    Patch(
        name="reset_parameters",
        target="TransformerEngineBaseModule.reset_parameters (not called; replaced by materialize)",
        covers="TE PR #2713 lifecycle; reset_parameters' device='cuda' and mesh_dim='shard' in TE 2.x",
        what="materialize meta parameters on the requested device and quantize with the weight-mesh amax group",
        outside="error",
        undo="nothing to undo: TE's method is left alone, materialize reads param_init_meta/quantizers instead",
    ),
    Patch(
        name="float8_pre_all_gather_amax_group",
        target="Float8Tensor.fsdp_pre_all_gather (class attribute)",
        covers="TE PR #2713 (Float8Tensor.fsdp_pre_all_gather overwrites amax_reduction_group)",
        what="a pinned amax_reduction_group survives FSDP2 all-gathers",
        outside="skip",
        undo="unpatch() restores the identical class attribute (undo kept in _patches)",
        lost_when_skipped="FP8 current-scaling weights may reduce amax over FSDP's shard mesh only "
        "(not the TP ranks) after an all-gather",
    ),
    Patch(
        name="portable_extra_state",
        target="<TE module>.get_extra_state / set_extra_state (instance attributes)",
        covers="TE #1860 (DelayedScaling _extra_state not DCP-loadable across ranks)",
        what="_extra_state is saved as fixed-structure bytes readable with torch alone, loadable at any layout",
        outside="skip",
        undo="unpatch(model) removes the instance attributes (TE's native extra state again)",
        lost_when_skipped="_extra_state stays TE's native per-rank pickle, which DCP cannot load across "
        "ranks or layouts (TE #1860)",
    ),
)
"""Every patch, in the order the adapter applies them."""

def _installed() -> tuple[int, ...]:
    from shardbridge_te._compat import te_version

    return te_version()


def plan() -> PatchPlan:
    """The TE adapter's patch plan (the rules: [Note: patch plans] in ``shardbridge._patching``).

    Built from the module's current :data:`PATCHES` on each call (tests replace them).
    """
    return PatchPlan(
        owner="shardbridge_te",
        framework="TransformerEngine",
        patches=PATCHES,
        installed=_installed,
        install_hint=lambda low, high: f"pip install 'transformer_engine[pytorch]=={fmt_version(high)}'",
        widen_hint="check the patch against this TE (docs/te.md, GPU tier) and widen Patch.checked in "
        "shardbridge_te/_patches.py",
        kind="TE patch",
    )


def patch_plan(version: tuple[int, int, int]) -> tuple[Patch, ...]:
    """The patches TE ``version`` needs (those whose upstream fix is not in it).

    Raises:
        ValueError: ``version`` is older than :data:`MIN_VERSION`.

    Example:
        >>> [p.name for p in patch_plan((2, 20, 2))][:2]
        ['dtensor_params', 'local_forward']
    """
    version = tuple(version)
    if version < MIN_VERSION:
        raise ValueError(
            f"TransformerEngine {fmt_version(version)} is older than the supported "
            f"{fmt_version(MIN_VERSION)}; upgrade: pip install 'transformer_engine[pytorch]>=2.8'"
        )
    return tuple(p for p in PATCHES if p.applies(version))


def gate(name: str, version: tuple[int, int, int]) -> bool:
    """Whether to apply patch ``name`` on TE ``version``: the check every patch site makes first.

    True inside the patch's checked range (and before its upstream fix); False when the fix is
    released, or outside the range for an ``outside="skip"`` patch (with a warning saying what
    is lost).

    Raises:
        ValueError: ``version`` is older than :data:`MIN_VERSION`.
        RuntimeError: ``version`` is outside the range of an ``outside="error"`` patch.
        KeyError: no patch is named ``name``.

    Example:
        >>> gate("local_forward", (2, 20, 2))
        True
    """
    current = plan()
    current.get(name)
    patch_plan(version)  # refuses a TE older than MIN_VERSION
    return current.gate(name, version)


def keep_instance_undo(module: nn.Module, name: str, undo: Callable[[], None]) -> None:
    """Record ``undo`` of instance patch ``name`` on ``module`` (for :func:`unpatch`)."""
    undos = module.__dict__.setdefault(_UNDO_ATTR, {})
    undos.setdefault(name, undo)  # a second patch of the same name is a no-op: keep the first undo


_CLASS_UNDO: dict[str, Callable[[], None]] = {}
"""Undo of each class-level patch applied in this process."""


def unpatch(model: nn.Module | None = None) -> list[str]:
    """Undo the adapter's patches; returns the names of those undone.

    With ``model``: the instance patches of its TE modules (``local_forward``,
    ``portable_extra_state``); the parameters stay DTensors. Without: the class-level patches
    (``float8_pre_all_gather_amax_group``), which affect every ``Float8Tensor`` of the process.

    Example:
        >>> unpatch(model)  # doctest: +SKIP
        ['local_forward', 'portable_extra_state']
    """
    done: list[str] = []
    if model is None:
        for name in reversed(list(_CLASS_UNDO)):
            _CLASS_UNDO.pop(name)()
            done.append(name)
        return done
    for module in model.modules():
        undos = module.__dict__.pop(_UNDO_ATTR, {})
        for name in reversed(list(undos)):
            undos[name]()
            if name not in done:
                done.append(name)
    return done


_PINNED_ATTR = "_shardbridge_amax_group"


def patch_float8_pre_all_gather(float8_tensor_cls: type) -> Callable[[], None]:
    """Keep a pinned amax group through ``Float8Tensor.fsdp_pre_all_gather``; returns the undo.

    TE 2.x sets ``self.amax_reduction_group = mesh.get_group()`` with FSDP's shard mesh in
    every pre-all-gather: that group lacks the TP ranks (and fails on a 2-D HSDP mesh). A tensor
    carrying ``_shardbridge_amax_group`` (set by the adapter to the ``weight`` mesh's group)
    gets the call with ``mesh=None`` (TE then leaves the group alone) and the pinned group back.
    Idempotent: patching twice is one patch (the second call returns a no-op undo).
    """
    original = float8_tensor_cls.fsdp_pre_all_gather
    if getattr(original, "_shardbridge_patched", False):
        return lambda: None

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):  # type: ignore[no-untyped-def]
        pinned = getattr(self, _PINNED_ATTR, None)
        if pinned is None:
            return original(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        out = original(self, None, orig_size, contiguous_orig_stride, module, mp_policy)
        self.amax_reduction_group = pinned
        return out

    fsdp_pre_all_gather._shardbridge_patched = True  # type: ignore[attr-defined]
    fsdp_pre_all_gather.__doc__ = original.__doc__
    return patch_attr(float8_tensor_cls, "fsdp_pre_all_gather", fsdp_pre_all_gather)


def apply_float8_pre_all_gather(float8_tensor_cls: type) -> None:
    """Apply :func:`patch_float8_pre_all_gather` once per process and keep its undo for :func:`unpatch`."""
    if "float8_pre_all_gather_amax_group" not in _CLASS_UNDO:
        _CLASS_UNDO["float8_pre_all_gather_amax_group"] = patch_float8_pre_all_gather(float8_tensor_cls)
