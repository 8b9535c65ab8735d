"""CLI verbs that adapters contribute, found through the ``shardbridge.cli`` entry-point group.

[Note: adapter verbs]
~~~~~~~~~~~~~~~~~~~~~
The core imports no adapter (docs/architecture.md), so it cannot know ``shardbridge launch``
(the hf adapter's launcher). An adapter declares its verbs in its packaging metadata::

    [project.entry-points."shardbridge.cli"]
    launch = "shardbridge_hf._launch:cli_verb"

and the object named there is a :class:`Verb`: a one-line help text, the command's main
function (``argv -> exit code``), and the install hint shown when loading it fails because the
adapter's host framework is missing. ``shardbridge --help`` lists every registered verb by
name without importing any adapter (the help text is read only when the verb runs or when
its own ``--help`` is asked for). A verb's arguments are its own: everything after the verb
name is handed to it unparsed. A dotted name adds an action to a core group:
``"ckpt.convert"`` (the megatron adapter's) runs as ``shardbridge ckpt convert``.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["GROUP", "Verb", "load_verb", "verb_names"]

GROUP = "shardbridge.cli"
"""The entry-point group adapters register their CLI verbs in."""


@dataclass(frozen=True, kw_only=True)
class Verb:
    """A CLI verb an adapter contributes (see [Note: adapter verbs])."""

    help: str
    """One line for ``shardbridge --help``."""
    main: Callable[[Sequence[str]], int]
    """Runs the verb on the arguments after its name; returns the exit code."""
    install_hint: str = ""
    """What to install when loading the verb fails (``shardbridge.adapters.install_hint``: the extra's packages)."""


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=GROUP)}


def verb_names() -> list[str]:
    """The names of the registered verbs (no adapter is imported)."""
    return sorted(_entry_points())


def load_verb(name: str) -> Verb:
    """Import and return verb ``name``.

    Raises:
        KeyError: no verb of that name is registered.
        ImportError: the adapter (or its host framework) cannot be imported; the message
            carries the install hint the adapter declared in its entry point, if any.
        TypeError: the entry point does not name a :class:`Verb`.
    """
    ep = _entry_points()[name]
    verb = ep.load()
    if not isinstance(verb, Verb):
        raise TypeError(f"entry point {ep.value!r} of group {GROUP!r} is a {type(verb).__name__}, not a Verb")
    return verb
