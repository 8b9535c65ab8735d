"""The core's public surface: small, each name in one place, and all the adapters use (tier 1).

Public names are the names in the ``__all__`` of a public namespace: a package or module of
``shardbridge`` with no ``_``-prefixed part in its dotted path (and none of the
:data:`PRIVATE_PACKAGES`). Four rules, one test each:

- budgets: ``shardbridge`` has at most :data:`TOP_BUDGET` names and ``shardbridge.checkpoint``
  at most :data:`CHECKPOINT_BUDGET` (what a user learns first stays learnable; a name that does
  not fit goes to the namespace of its concept);
- one place: no name, and no class or function under another name, is public in two namespaces
  (old homes keep working for one release through ``__getattr__`` with a DeprecationWarning,
  outside every ``__all__``);
- adapters import the core through public names only: a name in the ``__all__`` of a public
  namespace (``shardbridge.adapters`` is the one meant for them), a public subpackage, or
  ``shardbridge._compat`` (the designated home of torch's private names for every package:
  docs/architecture.md, "Layers"; ``test_compat.py`` keeps torch's private names there). No
  ``_`` module or name, no deprecated alias, no attribute outside an ``__all__``;
- the list of public namespaces is the one docs/architecture.md shows (``PUBLIC`` of
  tools/docs_architecture.py): a new one is a decision, not an accident.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import pathlib
import textwrap
import warnings

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
CORE_SRC = REPO / "packages" / "core" / "src"
ADAPTER_SOURCES = ("te-adapter", "megatron-fsdp-adapter", "hf-adapter")
SHARED = frozenset({"shardbridge._compat"})
"""Core private modules adapters may import (see the module docstring)."""
PRIVATE_PACKAGES = frozenset({"shardbridge.checkpoint.state", "shardbridge.checkpoint.storage", "shardbridge.checkpoint.derived"})
"""Packages without a ``_`` that are private all the same (each docstring says so): the checkpoint's layers."""
TOP_BUDGET = 30
CHECKPOINT_BUDGET = 14


def _is_private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def public_namespaces() -> list[str]:
    """Every public package and module of the core, from the source tree (no import)."""
    found = []
    for path in sorted((CORE_SRC / "shardbridge").rglob("*.py")):
        parts = list(path.relative_to(CORE_SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if any(_is_private(p) for p in parts) or any(name == p or name.startswith(p + ".") for p in PRIVATE_PACKAGES):
            continue
        found.append(name)
    return found


def public_names() -> dict[str, list[str]]:
    """``{namespace: its __all__}`` for every public namespace (imported: the names must exist)."""
    return {ns: list(importlib.import_module(ns).__all__) for ns in public_namespaces()}


def _private_core_uses(source: str, where: str, public: dict[str, list[str]]) -> list[str]:
    """Every use of a core name outside ``public`` (``{namespace: __all__}``) in ``source``, as ``where:line: what``."""
    tree = ast.parse(source)
    found: list[str] = []
    core_modules: dict[str, str] = {}  # local name -> the core module it is bound to

    def allowed_module(module: str) -> bool:
        return module in SHARED or module in public

    def allowed_name(module: str, name: str) -> bool:
        if module in SHARED:
            return not _is_private(name)
        return f"{module}.{name}" in SHARED or name in public.get(module, ()) or f"{module}.{name}" in public

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shardbridge":
            if not allowed_module(node.module):
                found.append(f"{where}:{node.lineno}: from {node.module} import ...")
                continue
            for alias in node.names:
                if not allowed_name(node.module, alias.name):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
                elif f"{node.module}.{alias.name}" in public or f"{node.module}.{alias.name}" in SHARED:
                    core_modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "shardbridge":
                    continue
                if not allowed_module(alias.name):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
                elif alias.asname:
                    core_modules[alias.asname] = alias.name
                else:
                    core_modules[alias.name.split(".")[0]] = "shardbridge"
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and node.args[0].value.split(".")[0] == "shardbridge"
            and not allowed_module(node.args[0].value)
        ):
            found.append(f"{where}:{node.lineno}: import_module({node.args[0].value!r})")
    for node in ast.walk(tree):
        # fp8._BACKENDS, checkpoint.LocalChunks: an attribute of a core module outside its __all__
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in core_modules):
            continue
        module = core_modules[node.value.id]
        if module in SHARED:
            continue
        if not allowed_name(module, node.attr):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return sorted(found, key=lambda f: int(f.split(":")[1]))


def test_the_budgets_hold():
    top = importlib.import_module("shardbridge").__all__
    checkpoint = importlib.import_module("shardbridge.checkpoint").__all__
    assert len(top) <= TOP_BUDGET, f"shardbridge.__all__ has {len(top)} names > {TOP_BUDGET}: {top}"
    assert len(checkpoint) <= CHECKPOINT_BUDGET, f"shardbridge.checkpoint.__all__: {len(checkpoint)} > {CHECKPOINT_BUDGET}"
    for verb in ("save", "load", "load_latest", "latest", "step_dir", "verify", "inspect", "export_safetensors", "wait"):
        assert verb in checkpoint, verb


def test_each_public_name_lives_in_one_place():
    names = public_names()
    assert {"shardbridge", "shardbridge.checkpoint", "shardbridge.adapters", "shardbridge.fp8"} <= set(names)
    homes: dict[str, list[str]] = {}
    objects: dict[int, list[str]] = {}
    for namespace, all_ in names.items():
        assert len(all_) == len(set(all_)), f"{namespace}.__all__ lists a name twice"
        module = importlib.import_module(namespace)
        for name in all_:
            homes.setdefault(name, []).append(namespace)
            obj = getattr(module, name)  # every listed name exists
            if inspect.isclass(obj) or inspect.isfunction(obj):
                objects.setdefault(id(obj), []).append(f"{namespace}.{name}")
    twice = {name: where for name, where in homes.items() if len(where) > 1}
    assert twice == {}, f"public in more than one namespace: {twice}"
    aliases = [where for where in objects.values() if len(where) > 1]
    assert aliases == [], f"one object public under several names: {aliases}"


def test_public_namespaces_are_the_documented_ones():
    spec = importlib.util.spec_from_file_location("docs_architecture", REPO / "tools" / "docs_architecture.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    documented = [ns for ns in tool.PUBLIC if ns.split(".")[0] == "shardbridge"]
    assert sorted(documented) == sorted(public_namespaces()), "update PUBLIC in tools/docs_architecture.py"


def test_the_private_packages_say_so():
    for package in PRIVATE_PACKAGES:
        assert "(private)" in (importlib.import_module(package).__doc__ or ""), package


def test_old_homes_warn_and_give_the_same_object():
    """Every name that moved keeps working for one release ([Note: deprecated aliases]), naming where it went."""
    moved = []
    for namespace in public_namespaces():
        module = importlib.import_module(namespace)
        moved += [(module, name, new) for name, new in getattr(module, "_DEPRECATED", {}).items()]
    assert len(moved) > 80
    for old, name, new in moved:
        assert name not in old.__all__ and name not in vars(old), f"{old.__name__}.{name} is still defined there"
        with pytest.warns(DeprecationWarning, match=rf"^{old.__name__}\.{name} "):
            value = getattr(old, name)
        home, _, attr = new.rpartition(".")
        assert value is getattr(importlib.import_module(home), attr), f"{old.__name__}.{name} -> {new}"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
            importlib.import_module("shardbridge.checkpoint").no_such_name  # noqa: B018


def test_the_scan_sees_every_form_of_private_use():
    """Guard against a vacuous pass: each way of reaching a name outside the public surface is found."""
    source = textwrap.dedent(
        """
        import shardbridge._fused
        import shardbridge.checkpoint._trust as trust
        import shardbridge.checkpoint.storage
        from shardbridge._fused import split_fused
        from shardbridge.checkpoint._trust import TrustedReader
        from shardbridge.checkpoint import _trust
        from shardbridge import fp8, checkpoint as ck
        from shardbridge import cp_split                  # a deprecated alias: not in any __all__
        from shardbridge.checkpoint import LocalChunks    # moved to shardbridge.adapters
        from shardbridge._compat import local_tensor      # the shared home: allowed
        from shardbridge.adapters import read_metadata    # the adapter-facing namespace: allowed
        from shardbridge.cp import cp_split as split      # public: allowed
        fp8._BACKENDS
        ck._export.parse_size
        ck.check_destination
        ck.save                                           # public: allowed
        importlib.import_module("shardbridge.cli._plugins")
        obj._private  # not a core module: allowed
        """
    )
    found = _private_core_uses(source, "x.py", public_names())
    assert [f.split(": ", 1)[1] for f in found] == [
        "import shardbridge._fused",
        "import shardbridge.checkpoint._trust",
        "import shardbridge.checkpoint.storage",
        "from shardbridge._fused import ...",
        "from shardbridge.checkpoint._trust import ...",
        "from shardbridge.checkpoint import _trust",
        "from shardbridge import cp_split",
        "from shardbridge.checkpoint import LocalChunks",
        "fp8._BACKENDS",
        "ck._export",
        "ck.check_destination",
        "import_module('shardbridge.cli._plugins')",
    ]


def test_adapters_import_only_public_core_names():
    sources = sorted(p for name in ADAPTER_SOURCES for p in (REPO / "packages" / name / "src").rglob("*.py"))
    assert len(sources) > 20
    public = public_names()
    offenders = [
        o for p in sources for o in _private_core_uses(p.read_text(encoding="utf-8"), str(p.relative_to(REPO)), public)
    ]
    assert offenders == [], (
        "adapters reach core names outside the public surface (use the public home, or add what adapters need to "
        "shardbridge.adapters):\n" + "\n".join(offenders)
    )


def test_the_shared_private_module_is_documented_as_such():
    """The exception above is a decision the architecture doc states, not a convenience."""
    text = (REPO / "docs" / "architecture.md").read_text(encoding="utf-8")
    for module in SHARED:
        assert f"`{module}`" in text and "designated" in text, module
    assert "`shardbridge.adapters`" in text and "adapter-facing" in text
