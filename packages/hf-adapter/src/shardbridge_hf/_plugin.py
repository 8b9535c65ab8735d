"""The Accelerate plugin: in a ``shardbridge launch`` worker, ``accelerate.Accelerator`` is shardbridge's.

::

    shardbridge launch --config_file cfg.yaml train.py ARGS       # each worker runs:
    python -m shardbridge_hf._worker train.py ARGS                # install(), then train.py as __main__

[Note: the Accelerate plugin]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Accelerate has no plugin entry points: its launcher and its workers run no third-party code, and
``transformers.Trainer`` (so TRL's trainers, its subclasses) builds its own
``accelerate.Accelerator(**args)`` in ``create_accelerator_and_postprocess``. The only way an
unmodified script trains under shardbridge is that the name ``accelerate.Accelerator`` means
:class:`~shardbridge_hf.ShardbridgeAccelerator` in its process before the script imports it. So
``shardbridge launch`` starts each worker as ``python -m shardbridge_hf._worker SCRIPT ARGS``
(``--run-module MODULE ARGS`` for ``shardbridge launch -m MODULE``), which

1. installs the plugin (:func:`install`): ``accelerate.Accelerator`` and ``accelerate.accelerator.Accelerator``
   (and ``transformers.trainer.Accelerator``, where transformers' trainer module was imported
   already) are replaced by ``ShardbridgeAccelerator`` (patch ``accelerator_class``, [Note: hf
   patch plan]); the returned :class:`Plugin` undoes exactly that;
2. runs the script as ``python SCRIPT ARGS`` would (``__name__ == "__main__"``, ``sys.argv``,
   ``sys.path[0]`` = the script's folder) or the module as ``python -m MODULE ARGS`` would.

A script that imports ``ShardbridgeAccelerator`` itself runs unchanged (the class is the same
one). What a ``Trainer`` needs beyond the accelerator (its checkpoints, ``save_model``, its
arguments) is adapted where the Trainer meets it, see [Note: Trainer under shardbridge] in
``_trainer.py``.

Plain ``accelerate launch`` cannot do this: it starts ``python SCRIPT`` itself and copies the
``fsdp_config.shardbridge`` block to an argument nothing reads. See [Note: a file for shardbridge
launch only] in ``_launch.py`` for how such a launch is refused by name instead.
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
from collections.abc import Callable, Sequence
from typing import Any

from shardbridge_hf import _patches

__all__ = ["RUN_MODULE", "WORKER_MODULE", "Plugin", "install", "installed", "main", "route_workers", "run_target"]

WORKER_MODULE = "shardbridge_hf._worker"
"""What ``shardbridge launch`` runs in each worker (``python -m`` this)."""

RUN_MODULE = "--run-module"
"""The worker's first argument when the target is a module (``shardbridge launch -m MODULE``)."""

# Where the name Accelerator is bound for code that runs after install(): a script's own
# ``import accelerate`` / ``from accelerate import Accelerator``, accelerate's module, and
# transformers' trainer module (only rebound when it was imported before install(); imported later,
# it binds the plugin's class by itself).
_BINDINGS = (("accelerate", "Accelerator"), ("accelerate.accelerator", "Accelerator"), ("transformers.trainer", "Accelerator"))
_IMPORT_IF_ABSENT = ("accelerate", "accelerate.accelerator")


class Plugin:
    """The installed plugin: :meth:`uninstall` puts back the identical previous objects."""

    def __init__(self, undo: list[Callable[[], None]]) -> None:
        self._undo = undo

    def uninstall(self) -> None:
        """Undo :func:`install` (idempotent)."""
        while self._undo:
            self._undo.pop()()


def install() -> Plugin:
    """Make ``accelerate.Accelerator`` resolve to ``ShardbridgeAccelerator`` in this process.

    See [Note: the Accelerate plugin]. Idempotent: bindings that already hold the class are left
    alone (and not undone by this call's :class:`Plugin`).

    Raises:
        RuntimeError: the installed accelerate lies outside the checked range (patch
            ``accelerator_class``).

    Example:
        >>> plugin = install()  # doctest: +SKIP
        >>> import accelerate; accelerate.Accelerator.__name__  # doctest: +SKIP
        'ShardbridgeAccelerator'
        >>> plugin.uninstall()  # doctest: +SKIP
    """
    _patches.gate("accelerator_class")
    from shardbridge_hf._accelerator import ShardbridgeAccelerator

    undo = []
    for module_name, attr in _BINDINGS:
        if module_name in _IMPORT_IF_ABSENT:
            module = importlib.import_module(module_name)
        else:
            module = sys.modules.get(module_name)
        if module is None or getattr(module, attr, None) is ShardbridgeAccelerator:
            continue
        undo.append(_patches.patch_attr(module, attr, ShardbridgeAccelerator))
    return Plugin(undo)


def route_workers(args: Any) -> None:
    """Make ``accelerate launch``'s arguments start each worker through :func:`main`. See [Note: the Accelerate plugin].

    ``SCRIPT ARGS`` becomes ``-m shardbridge_hf._worker SCRIPT ARGS`` (``-m MODULE ARGS`` becomes
    ``-m shardbridge_hf._worker --run-module MODULE ARGS``). No wrap policy reaches the workers
    (``ShardbridgeAccelerator`` wraps by itself), the launch guard included ([Note: a file for
    shardbridge launch only] in ``_launch.py``).

    Raises:
        ValueError: ``--no_python`` (nothing Python runs before the program, so no plugin).
    """
    if getattr(args, "no_python", False):
        raise ValueError(
            "--no_python: shardbridge launch starts each worker as `python -m shardbridge_hf._worker SCRIPT`, which "
            "installs the Accelerate plugin before the script runs; launch a Python script (or -m MODULE) instead"
        )
    # Accelerate copies the file's fsdp_config into the arguments it was not given on the command
    # line, so the emptied wrap policy is recorded as given.
    args.fsdp_auto_wrap_policy = None
    if isinstance(getattr(args, "nondefault", None), set):
        args.nondefault.add("fsdp_auto_wrap_policy")
    target = [RUN_MODULE, args.training_script] if getattr(args, "module", False) else [args.training_script]
    args.training_script_args = [*target, *args.training_script_args]
    args.training_script = WORKER_MODULE
    args.module = True


def installed() -> bool:
    """Whether ``accelerate.Accelerator`` is ``ShardbridgeAccelerator`` (or a subclass of it) here."""
    accelerate = sys.modules.get("accelerate")
    if accelerate is None:
        return False
    from shardbridge_hf._accelerator import ShardbridgeAccelerator

    cls = getattr(accelerate, "Accelerator", None)
    return isinstance(cls, type) and issubclass(cls, ShardbridgeAccelerator)


def main(argv: Sequence[str] | None = None) -> None:
    """The worker bootstrap: :func:`install`, then :func:`run_target`. See [Note: the Accelerate plugin].

    Args:
        argv: ``[SCRIPT, *ARGS]`` or ``[RUN_MODULE, MODULE, *ARGS]``; None = ``sys.argv[1:]``.

    Raises:
        SystemExit: (status 2) no target given. The script's own exceptions and exit status
            pass through unchanged.
    """
    from shardbridge_hf._noise import quiet_upstream_noise

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv == [RUN_MODULE]:
        print(f"{WORKER_MODULE}: error: no script to run; usage: python -m {WORKER_MODULE} SCRIPT [ARGS]", file=sys.stderr)
        raise SystemExit(2)
    quiet_upstream_noise()  # before transformers imports torchao: [Note: upstream noise in a launch]
    install()  # for the life of the worker
    run_target(argv)


def run_target(argv: Sequence[str]) -> None:
    """Run ``[SCRIPT, *ARGS]`` as ``python SCRIPT ARGS`` would, or ``[RUN_MODULE, MODULE, *ARGS]`` as ``python -m``.

    ``sys.argv`` becomes the target's; for a script ``sys.path[0]`` is its folder (what ``python
    SCRIPT`` puts first), for a module the current folder (what ``python -m`` puts first).
    """
    argv = list(argv)
    as_module = argv[0] == RUN_MODULE
    if as_module:
        argv = argv[1:]
    target, args = argv[0], argv[1:]
    sys.argv = [target, *args]
    if as_module:
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)  # puts the module's file in argv[0]
        return
    sys.path[0] = os.path.dirname(os.path.abspath(target))
    runpy.run_path(target, run_name="__main__")
