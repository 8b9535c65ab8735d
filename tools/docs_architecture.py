"""Write (or check) the tables of docs/architecture.md that the code itself can produce.

    python tools/docs_architecture.py            # rewrite the generated blocks in place
    python tools/docs_architecture.py --check    # exit 1 naming each block that drifted

Each generated block sits between two markers in the doc (``<!-- generated: NAME ... -->`` and
``<!-- end generated: NAME -->``) and is produced here from the source: the modules of every
package (file tree and first docstring line), the public names (each ``__all__``, read from the
source without importing it), the mesh axes, the nox sessions (noxfile.py) and the CLI verbs
(the core's argument parser and the ``shardbridge.cli`` entry points of pyproject.toml). Every
backticked repository path the doc names (``packages/...``, ``tools/...``, ...) must exist.
``packages/core/tests/test_architecture_doc.py`` runs the check, so a change to any of these
that the doc does not show fails the tests until this script is run.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"

# package dir under packages/ -> import name of its top package
PACKAGES = {
    "core": "shardbridge",
    "te-adapter": "shardbridge_te",
    "megatron-fsdp-adapter": "shardbridge_megatron_fsdp",
    "hf-adapter": "shardbridge_hf",
}
# Public import paths whose __all__ the doc lists (a package's __init__.py, or a public module).
PUBLIC = (
    "shardbridge",
    "shardbridge.checkpoint",
    "shardbridge.fp8",
    "shardbridge.layout",
    "shardbridge.models",
    "shardbridge.pretrained",
    "shardbridge.testing",
    "shardbridge.patching",
    "shardbridge.extras",
    "shardbridge.checks",
    "shardbridge.cli",
    "shardbridge_te",
    "shardbridge_megatron_fsdp",
    "shardbridge_megatron_fsdp.mcore",
    "shardbridge_hf",
)


def _source(import_path: str) -> Path:
    top, *rest = import_path.split(".")
    package = next(d for d, name in PACKAGES.items() if name == top)
    base = REPO / "packages" / package / "src" / top / Path(*rest) if rest else REPO / "packages" / package / "src" / top
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


def _summary(path: Path) -> str:
    doc = ast.get_docstring(_tree(path)) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ").replace("|", "\\|")


def _all(path: Path) -> list[str]:
    for node in _tree(path).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    raise ValueError(f"{path.relative_to(REPO)} has no literal __all__")


def _assigned(path: Path, name: str) -> object:
    for node in _tree(path).body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target is not None else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path.relative_to(REPO)} does not assign {name}")


def modules() -> str:
    """One row per source file of each package: its path and the first paragraph of its docstring."""
    rows = ["| package | module | what it is (its docstring) |", "|---|---|---|"]
    for package, top in PACKAGES.items():
        src = REPO / "packages" / package / "src"
        for path in sorted((src / top).rglob("*.py")):
            rows.append(f"| `{package}` | `{path.relative_to(src).as_posix()}` | {_summary(path)} |")
    return "\n".join(rows)


def public_names() -> str:
    """Each public import path and its ``__all__``."""
    rows = ["| import | public names (`__all__`) |", "|---|---|"]
    for import_path in PUBLIC:
        names = ", ".join(f"`{n}`" for n in _all(_source(import_path)))
        rows.append(f"| `{import_path}` | {names} |")
    return "\n".join(rows)


def mesh_axes() -> str:
    """The axes every ``ParallelMesh`` has (``shardbridge/_mesh.py``)."""
    mesh = _source("shardbridge._mesh")
    axes = _assigned(mesh, "MESH_AXES")
    flattened = _assigned(mesh, "FLATTENED_AXES")
    lines = ["| axis | kind | made of |", "|---|---|---|"]
    lines += [f"| `{a}` | mesh dim | |" for a in axes]
    lines += [f"| `{a}` | flattened | {' x '.join(f'`{p}`' for p in parts)} |" for a, parts in flattened.items()]
    return "\n".join(lines)


def nox_sessions() -> str:
    """Every ``@nox.session`` of noxfile.py, whether ``nox`` runs it by default, and its docstring."""
    tree = _tree(REPO / "noxfile.py")
    defaults: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "nox.options.sessions":
            defaults = ast.literal_eval(node.value)
    rows = ["| session | default | what it runs |", "|---|---|---|"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any("nox.session" in ast.unparse(d) for d in node.decorator_list):
            doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
            rows.append(f"| `{node.name}` | {'yes' if node.name in defaults else ''} | {doc} |")
    return "\n".join(rows)


def cli_verbs() -> str:
    """``shardbridge`` verbs: the core's (its argument parser) and the adapters' (pyproject entry points)."""
    import tomllib

    sys.path.insert(0, str(REPO / "packages" / "core" / "src"))
    from shardbridge.cli import GROUP
    from shardbridge.cli._main import build_parser

    contributed = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    rows = ["| command | from | what it does |", "|---|---|---|"]

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:  # argparse has no public accessor for subcommands
            if not isinstance(action, argparse._SubParsersAction):
                continue
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                dotted = f"{prefix}.{name}" if prefix else name
                if dotted in contributed:
                    continue  # listed below, from pyproject.toml
                command = f"shardbridge {dotted.replace('.', ' ')}"
                nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
                if not nested:
                    rows.append(f"| `{command}` | core (`shardbridge/cli/`) | {helps.get(name, '')} |")
                walk(sub, dotted)

    walk(build_parser(), "")
    for dotted, target in sorted(contributed.items()):
        rows.append(f"| `shardbridge {dotted.replace('.', ' ')}` | `{target}` (entry point) | adapter verb |")
    return "\n".join(rows)


BLOCKS: dict[str, Callable[[], str]] = {
    "modules": modules,
    "public-names": public_names,
    "mesh-axes": mesh_axes,
    "nox-sessions": nox_sessions,
    "cli-verbs": cli_verbs,
}


def _pattern(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {re.escape(name)} [^\n]*-->\n)(.*?)(<!-- end generated: {re.escape(name)} -->)", re.S)


def render(text: str) -> str:
    """``text`` (the doc) with every generated block rewritten from the code."""
    for name, make in BLOCKS.items():
        pattern = _pattern(name)
        if not pattern.search(text):
            raise ValueError(f"docs/architecture.md has no block {name!r} (<!-- generated: {name} ... -->)")
        body = make()
        text = pattern.sub(lambda m, body=body: m.group(1) + body + "\n" + m.group(3), text)
    return text


_PATH = re.compile(r"`((?:packages|tools|docs|integration_tests|examples)/[^`\s]*)`")


def missing_paths(text: str) -> list[str]:
    """Repository paths the doc names (backticked, from a top-level folder) that do not exist."""
    named = {p for p in _PATH.findall(text) if "*" not in p and "..." not in p}  # patterns are not paths
    return sorted(p for p in named if not (REPO / p).exists())


def drifted(text: str) -> list[str]:
    """Names of the blocks whose text in ``text`` differs from what the code produces."""
    fresh = render(text)
    return [name for name in BLOCKS if _pattern(name).search(text).group(2) != _pattern(name).search(fresh).group(2)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated block drifted; write nothing")
    args = parser.parse_args(argv)
    text = DOC.read_text(encoding="utf-8")
    missing = missing_paths(text)
    if missing:
        print(f"docs/architecture.md names paths that do not exist: {missing}; fix the text")
        return 1
    if args.check:
        stale = drifted(text)
        if stale:
            print(f"docs/architecture.md: generated block(s) {stale} differ from the code; run python tools/docs_architecture.py")
            return 1
        print("docs/architecture.md: every generated block matches the code, every path it names exists")
        return 0
    DOC.write_text(render(text), encoding="utf-8")
    print(f"docs/architecture.md: {len(BLOCKS)} generated blocks written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
