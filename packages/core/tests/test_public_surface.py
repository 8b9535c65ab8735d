"""Adapters use the core's public surface only (tier 1).

What the core keeps private (a ``_``-prefixed module, or a ``_``-prefixed name in any module) may
change with any commit; an adapter that imports it breaks silently the day it does. So no adapter
source file imports a core ``_`` module or name, or reads a ``_`` attribute of a core module it
imported. The one exception is ``shardbridge._compat``: the designated home of torch's private
names for every package (docs/architecture.md, "Layers"; ``test_compat.py`` keeps torch's private
names there), whose helpers every package calls.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[3]
ADAPTER_SOURCES = ("te-adapter", "megatron-fsdp-adapter", "hf-adapter")
SHARED = frozenset({"shardbridge._compat"})
"""Core private modules adapters may import (see the module docstring)."""


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _private_core_uses(source: str, where: str) -> list[str]:
    """Every use of a core ``_`` module or name in ``source``, as ``where:line: what``."""
    tree = ast.parse(source)
    found: list[str] = []
    core_modules: set[str] = set()  # local names bound to a core module (``from shardbridge import fp8``)

    def private_module(module: str) -> bool:
        return module not in SHARED and any(_is_private(p) for p in module.split(".")[1:])

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardbridge":
            if private_module(node.module):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
                continue
            for alias in node.names:
                if _is_private(alias.name) and f"{node.module}.{alias.name}" not in SHARED:
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                else:
                    core_modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "shardbridge":
                    continue
                if private_module(alias.name):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                else:
                    core_modules.add(alias.asname or alias.name.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == "shardbridge"
            and private_module(node.args[0].value)
        ):
            found.append(f"{where}:{node.lineno}: import_module({node.args[0].value!r})")
    for node in ast.walk(tree):
        # fp8._BACKENDS, shardbridge.checkpoint._trust: a private attribute of a core module
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id in core_modules:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_sees_every_form_of_private_use():
    """Guard against a vacuous pass: each way of reaching a core private name is found."""
    source = textwrap.dedent(
        """
        import shardbridge._fused
        import shardbridge.checkpoint._trust as trust
        from shardbridge._fused import split_fused
        from shardbridge.checkpoint._trust import TrustedReader
        from shardbridge.checkpoint import _trust
        from shardbridge import fp8, checkpoint as ck
        from shardbridge._compat import local_tensor   # the shared home: allowed
        from shardbridge.checkpoint import read_metadata  # public: allowed
        fp8._BACKENDS
        ck._export.parse_size
        importlib.import_module("shardbridge.cli._plugins")
        obj._private  # not a core module: allowed
        """
    )
    found = _private_core_uses(source, "x.py")
    assert [f.split(": ", 1)[1] for f in found] == [
        "import shardbridge._fused",
        "import shardbridge.checkpoint._trust",
        "from shardbridge._fused import ...",
        "from shardbridge.checkpoint._trust import ...",
        "from shardbridge.checkpoint import _trust",
        "import_module('shardbridge.cli._plugins')",
        "fp8._BACKENDS",
        "ck._export",
    ]


def test_adapters_import_no_core_private_module_or_name():
    sources = sorted(p for name in ADAPTER_SOURCES for p in (REPO / "packages" / name / "src").rglob("*.py"))
    assert len(sources) > 20
    offenders = [
        o for p in sources for o in _private_core_uses(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)))
    ]
    assert offenders == [], (
        "adapters reach core private names (make them public in the core, or move the code):\n" + "\n".join(offenders)
    )


def test_the_shared_private_module_is_documented_as_such():
    """The exception above is a decision the architecture doc states, not a convenience."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    for module in SHARED:
        assert f"`{module}`" in text and "designated" in text, module
