"""The patch plan: what shardbridge_hf changes in Accelerate, and which upstream issue each covers.

Every change to an Accelerate (or TE) object the adapter makes at run time is a :class:`Patch`
here, and the code that makes it asks :func:`gate` first with the installed accelerate version
(``shardbridge_hf._compat.accelerate_version``). Outside the range a patch was checked against
(the hf matrix in noxfile.py: accelerate 1.10 and 1.15), ``outside`` decides:

- ``"error"`` (RuntimeError naming the patch, the range and the fix) where running without the
  patch would silently train differently (DDP instead of FSDP2, FP8 off);
- ``"skip"`` (a warning, Accelerate's own code runs) where Accelerate without it fails loudly.

Reversible where the upstream object outlives the call: the ``PartialState._shared_state``
entry is restored by ``ShardbridgeAccelerator.unpatch()``, the ``fp8_autocast`` forward wrap
by the undo kept on the model (:func:`shardbridge_hf._te.remove_fp8_autocast`).
``_prepare_tp`` is a subclass override: Accelerate's class itself is never changed.

[Note: hf patch plan]
~~~~~~~~~~~~~~~~~~~~~
::

    patch                       upstream object                                  outside
    partial_state_fsdp          accelerate.state.PartialState._shared_state          error
                                  ["distributed_type"] (bug 4)
    prepare_tp_noop             Accelerator._prepare_tp (bug 1; PR #3945 partial)    skip
    te_fp8_autocast             <model>.forward under te.fp8_autocast (bug 5,        error
                                  accelerate #3710 / PR #3585)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from shardbridge_hf import _compat

__all__ = ["PATCHES", "Patch", "gate", "patch_attr"]

Version = tuple[int, ...]


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change to an upstream object, the issue/PR it covers, and the versions it was checked against."""

    name: str
    """Short identifier (errors, warnings, tests)."""
    target: str
    """The upstream object changed or overridden."""
    covers: str
    """The upstream issue or PR (or the reproduced bug, where none is filed)."""
    checked: tuple[Version, Version]
    """``(oldest, newest)`` accelerate versions checked, inclusive; ``(1, 15)`` admits every 1.15.x."""
    outside: Literal["error", "skip"]
    """Outside ``checked``: ``"error"`` (RuntimeError) or ``"skip"`` (a warning; Accelerate's own code runs)."""
    undo: str
    """How the patch is undone, or why nothing is left to undo."""

    def in_checked_range(self, version: tuple[int, ...]) -> bool:
        """Whether ``version`` lies in :attr:`checked`, compared on the bounds' length.

        Example:
            >>> PATCHES[0].in_checked_range((1, 15, 3)), PATCHES[0].in_checked_range((1, 16, 0))
            (True, False)
        """
        low, high = self.checked
        return low <= tuple(version)[: len(low)] and tuple(version)[: len(high)] <= high


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
    ),
    Patch(
        name="te_fp8_autocast",
        target="<model>.forward (instance attribute) wrapped in transformer_engine.pytorch.fp8_autocast",
        covers="upstream bug 5: accelerate #3710 / PR #3585 (FSDP2 path never enters fp8_autocast)",
        checked=_CHECKED,
        outside="error",
        undo="shardbridge_hf._te.remove_fp8_autocast(model) (the undo is kept on the model)",
    ),
)
"""Every run-time patch of shardbridge_hf."""

_LOST_WHEN_SKIPPED = {
    "prepare_tp_noop": "Accelerate's own _prepare_tp runs (it imports transformers' ReplicateParallel, "
    "an ImportError on transformers >= 5.1)",
}


def gate(name: str, version: tuple[int, ...] | None = None) -> bool:
    """Whether to apply patch ``name`` on accelerate ``version`` (None = the installed one).

    Raises:
        RuntimeError: outside the checked range of an ``outside="error"`` patch.
        KeyError: no patch is named ``name``.

    Example:
        >>> gate("prepare_tp_noop", (1, 15, 0))
        True
    """
    patch = next((p for p in PATCHES if p.name == name), None)
    if patch is None:
        raise KeyError(f"no shardbridge_hf patch named {name!r}; known: {[p.name for p in PATCHES]}")
    version = _compat.accelerate_version() if version is None else tuple(version)
    if patch.in_checked_range(version):
        return True
    low, high = patch.checked
    where = (
        f"shardbridge_hf's patch {patch.name!r} ({patch.target}; covers {patch.covers}) was checked against "
        f"accelerate {_fmt(low)} to {_fmt(high)}.x; this is accelerate {_fmt(version)}"
    )
    if patch.outside == "error":
        raise RuntimeError(
            f"{where}. Install a checked accelerate (pip install 'accelerate>={_fmt(low)},<{high[0]}.{high[1] + 1}'), "
            "or run the hf matrix (nox -s hf_matrix) against this one and widen Patch.checked in "
            "shardbridge_hf/_patches.py"
        )
    warnings.warn(f"{where}: the patch is skipped, so {_LOST_WHEN_SKIPPED[patch.name]}.", stacklevel=3)
    return False


def patch_attr(obj: Any, attr: str, value: Any) -> Callable[[], None]:
    """Set ``obj.attr = value``; return an undo that restores the identical previous attribute.

    Deletes the attribute instead when ``obj`` had none of its own (an instance then sees its
    class's attribute again).

    Example:
        >>> class A: ...
        >>> a = A()
        >>> undo = patch_attr(a, "x", 1)
        >>> undo(); hasattr(a, "x")
        False
    """
    own = vars(obj)
    had = attr in own
    previous = own.get(attr)
    setattr(obj, attr, value)

    def undo() -> None:
        if had:
            setattr(obj, attr, previous)
        elif attr in vars(obj):
            delattr(obj, attr)

    return undo


def patch_item(mapping: Any, key: str, value: Any) -> Callable[[], None]:
    """Set ``mapping[key] = value``; return an undo that restores the identical previous entry (or removes it).

    Example:
        >>> d = {}
        >>> undo = patch_item(d, "k", 1)
        >>> undo(); d
        {}
    """
    had = key in mapping
    previous = mapping.get(key)
    mapping[key] = value

    def undo() -> None:
        if had:
            mapping[key] = previous
        else:
            mapping.pop(key, None)

    return undo
