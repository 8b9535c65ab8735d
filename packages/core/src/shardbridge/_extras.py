"""What to install for an optional feature: the install hint every "missing extra" error carries.

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
"""

from __future__ import annotations

import functools
import importlib.metadata
import re

__all__ = ["DISTRIBUTION", "extra_requirements", "install_hint", "missing_requirements"]

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
