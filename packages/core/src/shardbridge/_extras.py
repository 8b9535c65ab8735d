"""Optional dependencies: what to install for a feature, and which host-framework versions were checked.

The install hint every "missing extra" error carries, and the version policy. Private: adapters
reach :func:`install_hint` and :func:`warn_if_untested` through :mod:`shardbridge.adapters`;
:class:`UntestedVersionWarning` is public as ``shardbridge.UntestedVersionWarning``.

[Note: install hints]
~~~~~~~~~~~~~~~~~~~~~
shardbridge is on no package index, so ``pip install "shardbridge[hf]"`` fails on a user's
machine. A hint names commands that work wherever shardbridge came from:

1. the host packages themselves, with the version bounds of the extra
   (``pip install "accelerate<1.16,>=1.10" ...``). They are read from the installed
   distribution's metadata (``importlib.metadata.requires("shardbridge")``), so they cannot
   drift from ``pyproject.toml``;
2. the extra, as it installs from a clone (``pip install -e ".[hf]"``), a built wheel
   (``pip install "shardbridge-0.1.0-py3-none-any.whl[hf]"``) or a git URL
   (``pip install "shardbridge[hf] @ git+<repository URL>"``); README.md, Install.

Without installed metadata (the sources on ``PYTHONPATH``) only form 2 is given.

[Note: version policy]
~~~~~~~~~~~~~~~~~~~~~~
torch and transformers have no upper bound in ``pyproject.toml``: pip would otherwise downgrade
a user's newer torch (and pull a multi-GB CUDA build) just to install shardbridge. Instead the
newest versions a CI or nox run passed are written down here and in the adapters (torch:
``shardbridge._compat.TORCH_CHECKED``; transformers: ``shardbridge_hf._compat.TRANSFORMERS_CHECKED``),
and importing shardbridge with a version outside that range gives ONE
:class:`UntestedVersionWarning` naming the package, its version and the checked range (once per
process; silence it with ``warnings.filterwarnings("ignore", category=UntestedVersionWarning)``).
Where running outside the checked range would silently train differently, an adapter's patch
plan refuses instead (accelerate: ``shardbridge_hf._patches``, and the ``<1.16`` bound of the
``hf`` extra; TransformerEngine and megatron-fsdp likewise). docs/testing.md, "Version policy",
lists the ranges and the runs behind them.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
import warnings

__all__ = [
    "DISTRIBUTION",
    "UntestedVersionWarning",
    "extra_requirements",
    "install_hint",
    "missing_requirements",
    "warn_if_untested",
]

DISTRIBUTION = "shardbridge"
"""The distribution's name on pip's side (``pip show shardbridge``)."""

_EXTRA_MARKER = re.compile(r"""^\s*(?P<req>[^;]+?)\s*;\s*extra\s*==\s*["'](?P<extra>[^"']+)["']\s*$""")
_SELF = re.compile(rf"^{DISTRIBUTION}\s*\[(?P<extras>[^\]]*)\]\s*$")


@functools.cache
def _requires() -> tuple[str, ...] | None:
    try:
        return tuple(importlib.metadata.requires(DISTRIBUTION) or ())
    except importlib.metadata.PackageNotFoundError:
        return None


def extra_requirements(extra: str) -> list[str] | None:
    """The requirement strings extra ``extra`` installs, from the installed metadata.

    An extra that names other extras of shardbridge (``all = ["shardbridge[megatron,hf,...]"]``)
    is expanded. Returns None when shardbridge's metadata is not installed, and raises
    ValueError for an extra the metadata does not declare.

    Example:
        >>> extra_requirements("fp8")  # doctest: +SKIP
        ['torchao>=0.18']
    """
    requires = _requires()
    if requires is None:
        return None
    by_extra: dict[str, list[str]] = {}
    for line in requires:
        match = _EXTRA_MARKER.match(line)
        if match:
            by_extra.setdefault(match.group("extra"), []).append(match.group("req").strip())
    if extra not in by_extra:
        raise ValueError(f"shardbridge declares no extra {extra!r}; its extras are {sorted(by_extra)}")
    out: list[str] = []
    for req in by_extra[extra]:
        nested = _SELF.match(req)
        if nested is None:
            out.append(req)
            continue
        for name in nested.group("extras").split(","):
            if name.strip() and name.strip() != extra:
                out.extend(r for r in extra_requirements(name.strip()) or () if r not in out)
    return out


def install_hint(extra: str) -> str:
    """One line saying how to install extra ``extra``, with commands that work without an index.

    See [Note: install hints].

    Example:
        >>> install_hint("fp8")  # doctest: +SKIP
        'pip install "torchao>=0.18" (the fp8 extra; from a shardbridge clone: pip install -e ".[fp8]")'
    """
    requirements = extra_requirements(extra)
    extra_form = f'from a shardbridge clone: pip install -e ".[{extra}]"; from a wheel: pip install "<wheel file>[{extra}]"'
    if not requirements:
        return f"install shardbridge's {extra} extra ({extra_form})"
    packages = " ".join(f'"{r}"' for r in requirements)
    return f"pip install {packages} (the {extra} extra; {extra_form})"


def missing_requirements(extra: str) -> list[str]:
    """The requirement strings of extra ``extra`` whose distribution is not installed (names only, no version check).

    Tests that need an optional extra skip with this list and :func:`install_hint`. Returns []
    when shardbridge's metadata is not installed (nothing to compare with).

    Example:
        >>> missing_requirements("plot")  # doctest: +SKIP
        ['matplotlib>=3.8']
    """
    missing = []
    for req in extra_requirements(extra) or ():
        name = re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0]
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(req)
    return missing



class UntestedVersionWarning(UserWarning):
    """A host framework's installed version lies outside the range shardbridge's CI and nox runs checked."""


def _fmt(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@functools.cache
def warn_if_untested(package: str, installed: tuple[int, ...], checked: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """Warn once (per package and version) when ``installed`` lies outside ``checked`` (inclusive).

    Each bound is compared on its own length: ``(5, 24)`` admits every 5.24.x.

    Returns:
        Whether the version is outside the range (and the warning was given).

    Example:
        >>> warn_if_untested("torch", (2, 13, 0), ((2, 11, 0), (2, 15, 0)))
        False
    """
    low, high = checked
    if low <= installed[: len(low)] and installed[: len(high)] <= high:
        return False
    # warn_explicit: one line ("shardbridge:0: UntestedVersionWarning: ..."), not the caller's source line too
    warnings.warn_explicit(
        f"{package} {_fmt(installed)} is untested with shardbridge: its CI and nox runs checked {package} "
        f"{_fmt(low)} .. {_fmt(high)} (docs/testing.md, Version policy)",
        UntestedVersionWarning,
        filename="shardbridge",
        lineno=0,
    )
    return True
