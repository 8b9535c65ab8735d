"""Megatron-Core tests run only where megatron.core is importable (the ``megatron-core`` extra,
``.venv-mcore`` in CI, ``nox -s megatron_core``); it never shares an environment with the
standalone megatron-fsdp the rest of this package's tests use."""

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

try:
    _HAVE_MCORE = importlib.util.find_spec("megatron.core") is not None
except (ImportError, ValueError):
    _HAVE_MCORE = False

collect_ignore_glob = [] if _HAVE_MCORE else ["test_*.py"]
