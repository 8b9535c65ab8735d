"""The version of shardbridge: the single place it is written.

``pyproject.toml`` reads it at build time (``[tool.setuptools.dynamic]``), so the installed
distribution's metadata, ``shardbridge.__version__`` and ``shardbridge --version`` always agree,
from a clone, an editable install or a wheel.
"""

__version__ = "0.1.0"
