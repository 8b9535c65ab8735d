"""shardbridge.cli: the ``shardbridge`` command.

Public (for adapters): :class:`Verb` and :data:`GROUP`, how an adapter contributes a verb
through its packaging metadata (see [Note: adapter verbs] in ``_plugins.py``). The command
itself is the console script ``shardbridge`` (``shardbridge.cli._main:main``).
"""

from shardbridge.cli._plugins import GROUP, Verb

__all__ = ["GROUP", "Verb"]
