"""Deprecated aliases: old public names that keep working for one release, with a warning.

[Note: deprecated aliases]
~~~~~~~~~~~~~~~~~~~~~~~~~~
A public module whose names moved declares them in ONE literal dict, ``_DEPRECATED = {old
name: new dotted home}``, and ``__getattr__ = deprecated_getattr(__name__, _DEPRECATED)``
(PEP 562: called only for names the module does not define). Reading an old name warns each
time (``DeprecationWarning``, naming the new home) and returns the object there; the old names
are in no ``__all__`` and go away in the next release. A home in a ``_`` module means the name
is no longer public at all. ``tools/docs_architecture.py`` reads the dicts without importing
anything and writes docs/architecture.md's table of deprecated names, and the docs check
refuses prose that names a deprecated alias outside that table.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["deprecated_getattr"]


def deprecated_getattr(
    module: str, deprecated: Mapping[str, str], reasons: Mapping[str, str] | None = None
) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving ``deprecated`` (old name -> new dotted home), see [Note: deprecated aliases].

    ``reasons``: old name -> why (appended to the warning in parentheses).

    Example:
        >>> getter = deprecated_getattr("pkg", {"old": "math.pi"})
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     value = getter("old")
        >>> value, str(caught[0].message)
        (3.141592653589793, 'pkg.old is now math.pi; the old name goes away in the next release')
    """

    def __getattr__(name: str) -> Any:
        if name not in deprecated:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        new = deprecated[name]
        home, _, attr = new.rpartition(".")
        if any(part.startswith("_") for part in home.split(".")):
            what = "is no longer a public name"
        elif attr == name:
            what = f"moved to {new}"
        else:
            what = f"is now {new}"
        why = f" ({reasons[name]})" if reasons and name in reasons else ""
        warnings.warn(
            f"{module}.{name} {what}{why}; the old name goes away in the next release", DeprecationWarning, stacklevel=2
        )
        return getattr(importlib.import_module(home), attr)

    return __getattr__
