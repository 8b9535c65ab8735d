"""The patch plan: what the adapter changes in a TE release, and which upstream issue each covers.

Every change the adapter makes to TransformerEngine is listed here with the upstream PR or
issue it stands in for and the TE versions it applies to. The plan is pure (a function of the
version tuple), so it is tested without TE. Instance patches (forward, ``_extra_state``) are
applied per module by :func:`shardbridge_te.set_device_mesh`; the one class-level patch
(:func:`patch_float8_pre_all_gather`) is reversible with its returned undo function.

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

__all__ = [
    "LAST_CHECKED",
    "MIN_VERSION",
    "PATCHES",
    "Patch",
    "patch_float8_pre_all_gather",
    "patch_plan",
]

MIN_VERSION = (2, 8, 0)
"""Oldest TE the adapter supports (the ``te`` extra's floor)."""
LAST_CHECKED = (2, 20, 2)
"""Newest TE whose Python sources the adapter was checked against (structural tier)."""


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change to TE, the upstream issue/PR it covers, and the versions it applies to."""

    name: str
    """Short identifier (used in logs and tests)."""
    covers: str
    """The upstream issue or PR, e.g. ``"TE PR #2713"``."""
    what: str
    """What the patch does, in one sentence."""
    fixed_in: tuple[int, int, int] | None = None
    """First TE release with the upstream fix (the patch is then not applied); None = none yet."""

    def applies(self, version: tuple[int, int, int]) -> bool:
        """Whether TE ``version`` needs this patch.

        Example:
            >>> Patch(name="x", covers="TE #1", what="-", fixed_in=(2, 21, 0)).applies((2, 20, 2))
            True
        """
        return self.fixed_in is None or tuple(version) < self.fixed_in


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="dtensor_params",
        covers="TE PR #2713 (set_device_mesh, unmerged); uneven shapes and GroupedLinear beyond it",
        what="TP-sharded parameters become DTensors on the TP mesh with explicit global shapes",
    ),
    Patch(
        name="local_forward",
        covers="TE PR #2713 (_extract_trainable_tensor_from_dtensor)",
        what="forward hands TE the local tensors of DTensor parameters; gradients return as DTensors",
    ),
    Patch(
        name="reset_parameters",
        covers="TE PR #2713 lifecycle; reset_parameters' device='cuda' and mesh_dim='shard' in TE 2.x",
        what="materialize meta parameters on the requested device and quantize with the weight-mesh amax group",
    ),
    Patch(
        name="float8_pre_all_gather_amax_group",
        covers="TE PR #2713 (Float8Tensor.fsdp_pre_all_gather overwrites amax_reduction_group)",
        what="a pinned amax_reduction_group survives FSDP2 all-gathers",
    ),
    Patch(
        name="portable_extra_state",
        covers="TE #1860 (DelayedScaling _extra_state not DCP-loadable across ranks)",
        what="_extra_state is saved as fixed-structure bytes readable with torch alone, loadable at any layout",
    ),
)
"""Every patch, in the order the adapter applies them."""


def patch_plan(version: tuple[int, int, int]) -> tuple[Patch, ...]:
    """The patches TE ``version`` needs.

    Raises:
        ValueError: ``version`` is older than :data:`MIN_VERSION`.

    Example:
        >>> [p.name for p in patch_plan((2, 20, 2))][:2]
        ['dtensor_params', 'local_forward']
    """
    version = tuple(version)
    if version < MIN_VERSION:
        raise ValueError(
            f"TransformerEngine {'.'.join(map(str, version))} is older than the supported "
            f"{'.'.join(map(str, MIN_VERSION))}; upgrade: pip install 'transformer_engine[pytorch]>=2.8'"
        )
    return tuple(p for p in PATCHES if p.applies(version))


_PINNED_ATTR = "_shardbridge_amax_group"


def patch_float8_pre_all_gather(float8_tensor_cls: type) -> Callable[[], None]:
    """Keep a pinned amax group through ``Float8Tensor.fsdp_pre_all_gather``; returns the undo.

    TE 2.x sets ``self.amax_reduction_group = mesh.get_group()`` with FSDP's shard mesh in
    every pre-all-gather: that group lacks the TP ranks (and fails on a 2-D HSDP mesh). A tensor
    carrying ``_shardbridge_amax_group`` (set by the adapter to the ``weight`` mesh's group)
    gets the call with ``mesh=None`` (TE then leaves the group alone) and the pinned group back.
    Idempotent: patching twice is one patch.
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
    float8_tensor_cls.fsdp_pre_all_gather = fsdp_pre_all_gather

    def undo() -> None:
        float8_tensor_cls.fsdp_pre_all_gather = original

    return undo
