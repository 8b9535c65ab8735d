"""shardbridge.cli: the ``shardbridge`` command (the console script ``shardbridge.cli._main:main``).

No public Python names: an adapter contributes a verb with :class:`shardbridge.adapters.Verb`
through its packaging metadata (see [Note: adapter verbs] in ``_plugins.py``).
"""

from shardbridge._deprecation import deprecated_getattr as _deprecated_getattr

__all__: list[str] = []

# Public here in 0.1.0 ([Note: deprecated aliases] in shardbridge/_deprecation.py).
_DEPRECATED = {"GROUP": "shardbridge.cli._plugins.GROUP", "Verb": "shardbridge.adapters.Verb"}
__getattr__ = _deprecated_getattr(__name__, _DEPRECATED)
