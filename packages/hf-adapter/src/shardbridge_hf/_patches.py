"""The patch plan: what shardbridge_hf changes in Accelerate, and which upstream issue each covers.

Every change to an Accelerate (or TE) object the adapter makes at run time is a :class:`Patch`
here, and the code that makes it asks :func:`gate` first with the installed accelerate version
(``shardbridge_hf._compat.accelerate_version``). Outside the range a patch was checked against
(the hf matrix in noxfile.py: accelerate 1.10 and 1.15), ``outside`` decides:

- ``"error"`` (RuntimeError naming the patch, the range and the fix) where running without the
  patch would silently train differently (DDP instead of FSDP2, FP8 off);
- ``"skip"`` (a warning, Accelerate's own code runs) where Accelerate without it fails loudly.

Reversible where the upstream object outlives the call: the ``PartialState._shared_state``
entry is restored by ``ShardbridgeAccelerator.unpatch()``. The TE FP8 autocast forward wrap
(upstream bug 5, accelerate #3710) is no longer an hf patch: the TE FP8 backend does it for every
adapter (``shardbridge_te._fp8.TEBackend.after_fsdp``, undone by ``remove_autocast``).
``_prepare_tp`` is a subclass override: Accelerate's class itself is never changed.

[Note: hf patch plan]
~~~~~~~~~~~~~~~~~~~~~
::

    patch                       upstream object                                  outside
    partial_state_fsdp          accelerate.state.PartialState._shared_state          error
                                  ["distributed_type"] (bug 4)
    prepare_tp_noop             Accelerator._prepare_tp (bug 1; PR #3945 partial)    skip
    scheduler_dp_steps          Accelerator.prepare_scheduler /                      error
                                  AcceleratedScheduler.step (subclass; steps dp,
                                  not num_processes, times: [Note: LR schedule
                                  under TP] in _accelerator.py)
"""

from __future__ import annotations

from shardbridge.adapters import Patch, PatchPlan, fmt_version, patch_attr, patch_item

from shardbridge_hf import _compat

__all__ = ["PATCHES", "Patch", "gate", "patch_attr", "patch_item", "plan"]

_CHECKED = ((1, 10), (1, 15))  # the hf matrix: accelerate 1.10.1 and 1.15.0 (noxfile.py HF_MATRIX)

PATCHES: tuple[Patch, ...] = (
    Patch(
        name="partial_state_fsdp",
        target='accelerate.state.PartialState._shared_state["distributed_type"]',
        covers="upstream bug 4 (docs/hf.md): Accelerate enables FSDP only on GPU-like devices (state.py), "
        "CPU silently runs DDP; no upstream issue filed",
        checked=_CHECKED,
        outside="error",
        undo="ShardbridgeAccelerator.unpatch() restores the identical previous entry (or removes it)",
    ),
    Patch(
        name="prepare_tp_noop",
        target="accelerate.Accelerator._prepare_tp (overridden in ShardbridgeAccelerator)",
        covers="upstream bug 1: _prepare_tp imports transformers' ReplicateParallel, removed in transformers 5.1; "
        "accelerate PR #3945 skips it only for models without DTensor parameters",
        checked=_CHECKED,
        outside="skip",
        undo="nothing to undo: a subclass override, accelerate.Accelerator is unchanged",
        lost_when_skipped="Accelerate's own _prepare_tp runs (it imports transformers' ReplicateParallel, "
        "an ImportError on transformers >= 5.1)",
    ),
    Patch(
        name="scheduler_dp_steps",
        target="accelerate.Accelerator.prepare_scheduler and AcceleratedScheduler.step (overridden in "
        "ShardbridgeAccelerator / a subclass of AcceleratedScheduler)",
        covers="AcceleratedScheduler steps the schedule num_processes times per optimizer step; under TP only the "
        "dp ranks read distinct batches, so the schedule runs tp times too fast (reproduced; no upstream issue filed)",
        checked=_CHECKED,
        outside="error",
        undo="nothing to undo: subclass overrides, Accelerate's classes are unchanged",
    ),
)
"""Every run-time patch of shardbridge_hf."""


def plan() -> PatchPlan:
    """The hf adapter's patch plan (the rules: [Note: patch plans] in ``shardbridge._patching``).

    Built from the module's current :data:`PATCHES` and version probe on each call (tests
    replace them), so it is cheap and never stale.
    """
    return PatchPlan(
        owner="shardbridge_hf",
        framework="accelerate",
        patches=PATCHES,
        installed=_compat.accelerate_version,
        install_hint=lambda low, high: f"pip install 'accelerate>={fmt_version(low)},<{high[0]}.{high[1] + 1}'",
        widen_hint="run the hf matrix (nox -s hf_matrix) against this one and widen Patch.checked in "
        "shardbridge_hf/_patches.py",
        newest_suffix=".x",
    )


def gate(name: str, version: tuple[int, ...] | None = None) -> bool:
    """Whether to apply patch ``name`` on accelerate ``version`` (None = the installed one).

    Raises:
        RuntimeError: outside the checked range of an ``outside="error"`` patch.
        KeyError: no patch is named ``name``.

    Example:
        >>> gate("prepare_tp_noop", (1, 15, 0))
        True
    """
    return plan().gate(name, version)
