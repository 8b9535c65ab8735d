"""Patch plans: every change an adapter makes to its host framework, gated and reversible.

[Note: patch plans]
~~~~~~~~~~~~~~~~~~~
An adapter that changes an upstream object (a class attribute, an instance's ``forward``, a
process-wide dict) declares it as a :class:`Patch` in its plan: the object, the upstream issue
or PR it covers, the framework versions it was checked against, what happens outside them
(``"error"``: refuse, because running without it would give wrong results; ``"skip"``: warn
naming what is lost, and let the framework's own code run), and how it is undone. Every patch
site first asks :meth:`PatchPlan.gate`; :func:`patch_attr` / :func:`patch_item` return an undo
that restores the identical previous object, which the adapter keeps wherever the upstream
object outlives the call. The rules are the same for every adapter, so they live here; the
plans themselves (TE's, Accelerate's, Megatron-FSDP's) live in each adapter.

Private: adapters reach these names through :mod:`shardbridge.adapters` (the adapter-facing
namespace); training code never uses them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Patch", "PatchPlan", "Version", "fmt_version", "patch_attr", "patch_item"]

Version = tuple[int, ...]


def fmt_version(version: Version) -> str:
    """``(2, 20, 2)`` -> ``"2.20.2"``."""
    return ".".join(map(str, version))


@dataclass(frozen=True, kw_only=True)
class Patch:
    """One change to an upstream object, the issue/PR it covers, and the versions it was checked against."""

    name: str
    """Short identifier (logs, errors, tests)."""
    target: str = ""
    """The upstream object changed or replaced, e.g. ``"Float8Tensor.fsdp_pre_all_gather"``."""
    covers: str
    """The upstream issue or PR (or the reproduced bug, where none is filed)."""
    checked: tuple[Version, Version]
    """``(oldest, newest)`` versions checked, inclusive, compared on each bound's length:
    ``(1, 15)`` admits every 1.15.x."""
    outside: Literal["error", "skip"] = "error"
    """Outside ``checked``: ``"error"`` (RuntimeError) or ``"skip"`` (a warning; the patch is not applied)."""
    undo: str = ""
    """How the patch is undone, or why nothing is left to undo."""
    what: str = ""
    """What the patch does, in one sentence."""
    fixed_in: Version | None = None
    """First release with the upstream fix (the patch is then not applied); None = none yet."""
    lost_when_skipped: str = ""
    """What is lost when an ``outside="skip"`` patch is skipped (named in the warning)."""

    def applies(self, version: Version) -> bool:
        """Whether ``version`` needs this patch (the upstream fix is not in it).

        Example:
            >>> Patch(name="x", covers="#1", checked=((2, 8), (2, 20)), fixed_in=(2, 21, 0)).applies((2, 20, 2))
            True
        """
        return self.fixed_in is None or tuple(version) < self.fixed_in

    def in_checked_range(self, version: Version) -> bool:
        """Whether ``version`` lies in :attr:`checked` (inclusive, on each bound's length).

        Example:
            >>> p = Patch(name="x", covers="#1", checked=((1, 10), (1, 15)))
            >>> p.in_checked_range((1, 15, 3)), p.in_checked_range((1, 16, 0))
            (True, False)
        """
        low, high = self.checked
        version = tuple(version)
        return low <= version[: len(low)] and version[: len(high)] <= high


@dataclass(frozen=True, kw_only=True)
class PatchPlan:
    """An adapter's patches and the one gate every patch site asks. See [Note: patch plans]."""

    owner: str
    """The adapter, e.g. ``"shardbridge_te"`` (named in messages)."""
    framework: str
    """The host framework as named in messages, e.g. ``"TransformerEngine"``."""
    patches: tuple[Patch, ...]
    """Every patch, in the order the adapter applies them."""
    installed: Callable[[], Version]
    """The installed framework's version (called only when :meth:`gate` is given none)."""
    install_hint: Callable[[Version, Version], str]
    """``(low, high) ->`` what to install for a checked version, e.g. ``"pip install 'x==2.20.2'"``."""
    widen_hint: str
    """How to extend a patch's checked range (named in the error)."""
    newest_suffix: str = ""
    """Appended to the newest bound in messages (``".x"`` where a bound admits every patch release)."""
    kind: str = ""
    """How messages name a patch of this plan (``"TE patch"``); default ``"<owner> patch"``."""

    def get(self, name: str) -> Patch:
        """The patch called ``name``.

        Raises:
            KeyError: no such patch (the message lists the known ones).
        """
        for patch in self.patches:
            if patch.name == name:
                return patch
        raise KeyError(f"no {self.kind or self.owner + ' patch'} named {name!r}; known: {[p.name for p in self.patches]}")

    def gate(self, name: str, version: Version | None = None) -> bool:
        """Whether to apply patch ``name`` on ``version`` (None = the installed framework).

        True inside the patch's checked range (and before its upstream fix); False once the fix
        is released, or outside the range of an ``outside="skip"`` patch (with a warning saying
        what is lost).

        Raises:
            RuntimeError: outside the checked range of an ``outside="error"`` patch.
            KeyError: no patch is named ``name``.
        """
        patch = self.get(name)
        version = self.installed() if version is None else tuple(version)
        if not patch.applies(version):
            return False
        if patch.in_checked_range(version):
            return True
        low, high = patch.checked
        where = (
            f"{self.owner}'s patch {patch.name!r} ({patch.target}; covers {patch.covers}) was checked against "
            f"{self.framework} {fmt_version(low)} to {fmt_version(high)}{self.newest_suffix}; "
            f"this is {self.framework} {fmt_version(version)}"
        )
        if patch.outside == "error":
            raise RuntimeError(f"{where}. Install a checked {self.framework} ({self.install_hint(low, high)}), or {self.widen_hint}")
        warnings.warn(f"{where}: the patch is skipped, so {patch.lost_when_skipped}.", stacklevel=3)
        return False


def patch_attr(obj: Any, attr: str, value: Any) -> Callable[[], None]:
    """Set ``obj.attr = value``; return an undo that restores exactly what was there.

    ``obj`` is a class or an instance. The undo puts back the identical object that was in
    ``vars(obj)`` (a class's raw function, staticmethod, ...), or deletes the attribute when
    ``obj`` had none of its own (an instance then sees its class's attribute again).

    Example:
        >>> class A:
        ...     def f(self): ...
        >>> original = vars(A)["f"]
        >>> undo = patch_attr(A, "f", lambda self: 1)
        >>> undo(); vars(A)["f"] is original
        True
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


def patch_item(mapping: Any, key: Any, value: Any) -> Callable[[], None]:
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
