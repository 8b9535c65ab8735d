"""The first thing each worker of ``shardbridge launch`` runs: ``python -m shardbridge_hf._worker SCRIPT ARGS``.

It calls :func:`shardbridge_hf._plugin.main` (install the Accelerate plugin, then run the script as
``__main__``). A module of its own, imported by nothing: ``python -m`` of a module the package
already imported (``_plugin`` is, through ``_launch``) runs a second copy of it, and runpy warns
so on every rank. See [Note: the Accelerate plugin] in ``_plugin.py``.
"""

from shardbridge_hf._plugin import main

if __name__ == "__main__":
    main()
