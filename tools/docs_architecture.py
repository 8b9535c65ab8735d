"""Write (or check) the parts of the docs that the code itself can produce, and check what prose names.

    python tools/docs_architecture.py            # rewrite every generated block in place
    python tools/docs_architecture.py --check    # exit 1 naming each drifted block and each bad name

[Note: docs that cannot drift]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Two rules, for README.md, docs/**/*.md and packages/*/README.md:

1. A list the code can produce is generated. It sits between two markers,
   ``<!-- generated: KIND [ARG] (tools/docs_architecture.py) -->`` and
   ``<!-- end generated: KIND [ARG] -->``, and is written from the source, which is read
   without importing it (the checks run where no extra is installed): the modules of every
   package with their docstrings (``modules``), every public namespace's ``__all__``
   (``public-names``; ``names MODULE``: one namespace's, or the public names a private
   module defines), the deprecated aliases (``deprecated-names``: each module's
   ``_DEPRECATED``), the mesh axes (``mesh-axes``: ``MESH_AXES``, ``FLATTENED_AXES``,
   ``EXPERT_AXES`` of ``shardbridge/_mesh.py``), the checkpoint's layers
   (``checkpoint-layers``), the nox sessions and the CLI verbs. :data:`REQUIRED` names the
   blocks a page must keep.
2. Prose that names code must name something that exists (outside fenced blocks, which
   integration_tests/test_docs.py runs, and outside generated blocks):

   - a backticked Python path of a shardbridge package (```shardbridge.cp.cp_split```,
     ```shardbridge_te.parallelize(model, ...)```, and ```checkpoint.save``` /
     ```fp8.refresh``` for the core's public namespaces) resolves, statically: modules,
     their top-level names and imports, class members (methods, fields, ``self.x``
     attributes), following the core's own base classes. A path that resolves only to a
     deprecated alias is an error (name the new home), and so is one that does not resolve,
     unless it is a string the code uses (``shardbridge.json``, the entry-point group
     ``shardbridge.fp8_backends``);
   - a backticked file name (```_repair.py```, ```state/_provider.py```) is a file of the
     repository, and a backticked repository path (```packages/...```, ```tools/...```) exists;
   - every ``[Note: NAME]`` is defined in the code (a line that is exactly ``[Note: NAME]``);
   - a message quoted as shardbridge's, ```ValueError` ("...")`` or ```ValueError` (`...`)``,
     is the code's: cut at what the code fills in (``...``, a quoted value, a number, the value
     after ``=``, a parenthesis), each piece of four words or more is in a string literal of the
     packages' sources. (An upstream message is quoted as a traceback line, ```ValueError: ...```,
     and is not checked.)

``packages/core/tests/test_architecture_doc.py`` runs the check, so a change to the code that a
page does not show fails the tests until this script is run (rule 1) or the prose is fixed
(rule 2).
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
import sys
from collections.abc import Callable, Iterator
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
REQUIRED = {
    "docs/architecture.md": ("modules", "public-names", "deprecated-names", "mesh-axes", "nox-sessions", "cli-verbs"),
    "docs/checkpoints.md": ("names shardbridge.checkpoint", "checkpoint-layers"),
    "docs/concepts/mesh.md": ("mesh-axes",),
}
"""The generated blocks each page must keep (a page may hold more)."""

AXIS_USES = {
    "dp_replicate": "HSDP replicas",
    "dp_shard": "FSDP shards",
    "cp": "context parallel: each sequence split over it",
    "tp": "tensor parallel",
    "dp": "data loading: ranks that see different batches",
    "dp_shard_cp": "FSDP sharding",
    "dp_cp": "loss / gradient reduction",
    "weight": "every rank holding a different piece of a weight; the amax group of per-tensor FP8 scaling "
    "(excludes `dp_replicate`: replicas hold equal pieces)",
    "efsdp": "FSDP of routed experts: the ranks holding the same experts (size `weight` / `ep`)",
    "ep": "routed experts split over it (`Shard(0)` of `[E, ...]`), token dispatch (size `ParallelDims.ep`)",
}
"""What each mesh axis is for: the one column of the axes table the code cannot say (checked: one per axis)."""


# -- reading the source without importing it ------------------------------------------------


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"))


@functools.cache
def module_index() -> dict[str, Path]:
    """Every module of every package: dotted name -> source file."""
    index = {}
    for package, top in PACKAGES.items():
        src = REPO / "packages" / package / "src"
        for path in sorted((src / top).rglob("*.py")):
            parts = list(path.relative_to(src).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            index[".".join(parts)] = path
    return index


def _source(import_path: str) -> Path:
    return module_index()[import_path]


def _summary(path: Path) -> str:
    doc = ast.get_docstring(_tree(path)) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ").replace("|", "\\|")


def _top_level(tree: ast.Module) -> Iterator[ast.stmt]:
    """Module-level statements, including those under ``if`` / ``try`` (``if TYPE_CHECKING:`` imports)."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            nested = [*node.body, *node.orelse, *getattr(node, "finalbody", [])]
            nested += [s for h in getattr(node, "handlers", []) for s in h.body]
            stack.extend(reversed(nested))
        else:
            yield node


def _assigned(path: Path, name: str) -> object:
    for node in _top_level(_tree(path)):
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target is not None else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"{path.relative_to(REPO)} does not assign {name}")


def _all(path: Path) -> list[str]:
    try:
        return list(_assigned(path, "__all__"))  # type: ignore[call-overload]
    except ValueError:
        raise ValueError(f"{path.relative_to(REPO)} has no literal __all__") from None


def _deprecated(path: Path) -> dict[str, str]:
    try:
        return dict(_assigned(path, "_DEPRECATED"))  # type: ignore[call-overload]
    except ValueError:
        return {}


def _is_private_package(name: str) -> bool:
    """A package without a ``_`` that its docstring declares private (the checkpoint's layers)."""
    path = module_index()[name]
    return path.name == "__init__.py" and "(private)" in _summary(path)


def public_namespaces() -> list[str]:
    """Every public namespace: no ``_``-prefixed part, not in a package declared private."""
    found = []
    for name in module_index():
        parts = name.split(".")
        if any(p.startswith("_") for p in parts):
            continue
        if any(_is_private_package(".".join(parts[:i])) for i in range(2, len(parts) + 1)):
            continue
        found.append(name)
    return found


# -- the generated blocks ---------------------------------------------------------------------


def modules(arg: str | None = None) -> str:
    """One row per source file of each package: its path and the first paragraph of its docstring."""
    rows = ["| package | module | what it is (its docstring) |", "|---|---|---|"]
    for package, top in PACKAGES.items():
        src = REPO / "packages" / package / "src"
        for path in sorted((src / top).rglob("*.py")):
            rows.append(f"| `{package}` | `{path.relative_to(src).as_posix()}` | {_summary(path)} |")
    return "\n".join(rows)


def public_names(arg: str | None = None) -> str:
    """Each public namespace with names, and its ``__all__``."""
    rows = ["| import | public names (`__all__`) |", "|---|---|"]
    for namespace in public_namespaces():
        names = _all(_source(namespace))
        if names:
            rows.append(f"| `{namespace}` | {', '.join(f'`{n}`' for n in names)} |")
    return "\n".join(rows)


def names(arg: str | None) -> str:
    """``arg`` a public namespace: its ``__all__``. A private module: the public names it defines, by namespace."""
    if arg is None or arg not in module_index():
        raise ValueError(f"names needs a module of the repository, got {arg!r}")
    if arg in public_namespaces():
        return ", ".join(f"`{n}`" for n in _all(_source(arg)))
    found: dict[str, list[str]] = {}
    for namespace in public_namespaces():
        imported = {
            a.name
            for node in _top_level(_tree(_source(namespace)))
            if isinstance(node, ast.ImportFrom) and node.module == arg
            for a in node.names
        }
        if from_arg := [n for n in _all(_source(namespace)) if n in imported]:
            found[namespace] = from_arg
    if not found:
        raise ValueError(f"no public namespace re-exports a name of {arg}")
    return "; ".join(f"`{ns}`: " + ", ".join(f"`{n}`" for n in ns_names) for ns, ns_names in found.items())


def deprecated_names(arg: str | None = None) -> str:
    """Every deprecated alias (each public namespace's ``_DEPRECATED``), grouped by where the names are now."""
    rows = ["| old home | names (each read warns; gone in the next release) | now in |", "|---|---|---|"]
    for namespace in public_namespaces():
        groups: dict[str, list[str]] = {}
        for old, new in _deprecated(_source(namespace)).items():
            home, _, attr = new.rpartition(".")
            if any(p.startswith("_") for p in home.split(".")):
                groups.setdefault("no longer public", []).append(f"`{old}`")
            elif attr == old:
                groups.setdefault(f"`{home}`", []).append(f"`{old}`")
            else:
                groups.setdefault(f"`{new}`", []).append(f"`{old}`")
        rows += [f"| `{namespace}` | {', '.join(olds)} | {now} |" for now, olds in groups.items()]
    return "\n".join(rows)


def mesh_axes(arg: str | None = None) -> str:
    """The axes every ``ParallelMesh`` has (``shardbridge/_mesh.py``), with what each is for."""
    mesh = _source("shardbridge._mesh")
    axes = _assigned(mesh, "MESH_AXES")
    flattened = _assigned(mesh, "FLATTENED_AXES")
    expert = _assigned(mesh, "EXPERT_AXES")
    every = [*axes, *flattened, *expert]  # type: ignore[misc]
    if sorted(every) != sorted(AXIS_USES):
        raise ValueError(f"AXIS_USES in tools/docs_architecture.py names {sorted(AXIS_USES)}, the code {sorted(every)}")
    lines = ["| axis | kind | made of | used for |", "|---|---|---|---|"]
    lines += [f"| `{a}` | mesh dim | | {AXIS_USES[a]} |" for a in axes]  # type: ignore[union-attr]
    for a, parts in flattened.items():  # type: ignore[union-attr]
        lines.append(f"| `{a}` | flattened | {' x '.join(f'`{p}`' for p in parts)} | {AXIS_USES[a]} |")
    unflattened = " x ".join(f"`{a}`" for a in expert)  # type: ignore[union-attr]
    lines += [f"| `{a}` | expert | `weight` as {unflattened} | {AXIS_USES[a]} |" for a in expert]  # type: ignore[union-attr]
    return "\n".join(lines)


def checkpoint_layers(arg: str | None = None) -> str:
    """The modules of ``shardbridge.checkpoint`` by layer, each with its docstring's first paragraph."""
    root = _source("shardbridge.checkpoint").parent
    rows = ["| layer | module | what it is (its docstring) |", "|---|---|---|"]
    layers = [root, *sorted(p for p in root.iterdir() if (p / "__init__.py").is_file())]
    for layer in layers:
        files = sorted(layer.glob("*.py"), key=lambda p: (p.name != "__init__.py", p.name))
        for path in files:
            rows.append(f"| `{path.parent.relative_to(root.parent).as_posix()}/` | `{path.name}` | {_summary(path)} |")
    return "\n".join(rows)


def nox_sessions(arg: str | None = None) -> str:
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


def cli_verbs(arg: str | None = None) -> str:
    """``shardbridge`` verbs: the core's (its argument parser) and the adapters' (pyproject entry points)."""
    import tomllib

    sys.path.insert(0, str(REPO / "packages" / "core" / "src"))
    from shardbridge.cli._main import build_parser
    from shardbridge.cli._plugins import GROUP

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


BLOCKS: dict[str, Callable[[str | None], str]] = {
    "modules": modules,
    "public-names": public_names,
    "names": names,
    "deprecated-names": deprecated_names,
    "mesh-axes": mesh_axes,
    "checkpoint-layers": checkpoint_layers,
    "nox-sessions": nox_sessions,
    "cli-verbs": cli_verbs,
}
_BLOCK = re.compile(
    r"(<!-- generated: (?P<key>(?P<kind>[\w-]+)(?: (?P<arg>[\w.]+))?) \(tools/docs_architecture\.py\) -->\n)"
    r"(?P<body>.*?)(<!-- end generated: (?P=key) -->)",
    re.S,
)


def pages() -> list[Path]:
    """Every page the docs test runs: README.md, docs/**/*.md, packages/*/README.md."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(REPO.glob("packages/*/README.md"))]


def blocks(text: str) -> dict[str, str]:
    """``{key: body}`` of every generated block in ``text`` (key: ``KIND`` or ``KIND ARG``)."""
    return {m.group("key"): m.group("body") for m in _BLOCK.finditer(text)}


def render(text: str, page: str = "docs/architecture.md") -> str:
    """``text`` (the page ``page``) with every generated block rewritten from the code."""
    missing = [key for key in REQUIRED.get(page, ()) if key not in blocks(text)]
    if missing:
        raise ValueError(f"{page} has no generated block {missing} (<!-- generated: KIND ... -->)")
    unknown = [m.group("kind") for m in _BLOCK.finditer(text) if m.group("kind") not in BLOCKS]
    if unknown or text.count("<!-- generated: ") != len(_BLOCK.findall(text)):
        raise ValueError(f"{page}: generated block(s) without a known kind or an end marker: {unknown}")
    made: dict[str, str] = {}

    def body(m: re.Match[str]) -> str:
        key = m.group("key")
        if key not in made:
            made[key] = BLOCKS[m.group("kind")](m.group("arg"))
        return m.group(1) + made[key] + "\n" + m.group(6)

    return _BLOCK.sub(body, text)


def drifted(text: str, page: str = "docs/architecture.md") -> list[str]:
    """Keys of the blocks of ``text`` whose body differs from what the code produces."""
    fresh = blocks(render(text, page))
    return [key for key, body in blocks(text).items() if body != fresh[key]]


# -- what prose names ---------------------------------------------------------------------------

_PATH = re.compile(r"`((?:packages|tools|docs|integration_tests|examples)/[^`\s]*)`")
_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_DOTTED = re.compile(r"^((?:shardbridge(?:_te|_hf|_megatron_fsdp)?)(?:\.[A-Za-z_]\w*)+|[a-z]\w*(?:\.[A-Za-z_]\w*)+)(?=$|\()")
_PY_FILE = re.compile(r"^(?:[\w.-]+/)*\w+\.py$")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_NOTE_DEF = re.compile(r"^\s*(?:#\s*)?\[Note: ([^\]]+)\]\s*$", re.M)
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")


def prose(text: str) -> str:
    """``text`` with fenced blocks and generated blocks blanked (line numbers kept)."""
    text = _BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    out, fence = [], None
    for line in text.split("\n"):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
            out.append("")
        elif fence is not None:
            out.append("")
            if line.strip().startswith(fence) and line.strip().strip(fence[0]) == "":
                fence = None
        else:
            out.append(line)
    return "\n".join(out)


def missing_paths(text: str) -> list[str]:
    """Repository paths the page names (backticked, from a top-level folder) that do not exist."""
    named = {p for p in _PATH.findall(text) if "*" not in p and "..." not in p}  # patterns are not paths
    return sorted(p for p in named if not (REPO / p).exists())


@functools.cache
def _code_files() -> tuple[str, ...]:
    roots = [REPO / "packages", REPO / "tools", REPO / "integration_tests", REPO / "examples"]
    return tuple(p.relative_to(REPO).as_posix() for root in roots for p in root.rglob("*.py"))


@functools.cache
def _package_folders() -> frozenset[str]:
    return frozenset(part for path in module_index().values() for part in path.relative_to(REPO / "packages").parts[2:-1])


@functools.cache
def _defined_notes() -> frozenset[str]:
    return frozenset(n for f in _code_files() for n in _NOTE_DEF.findall((REPO / f).read_text(encoding="utf-8")))


@functools.cache
def _string_constants() -> frozenset[str]:
    """Every string literal of the packages' sources (names that are strings: files, entry-point groups)."""
    found = set()
    for path in module_index().values():
        found.update(n.value for n in ast.walk(_tree(path)) if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return frozenset(found)


_MESSAGE = re.compile(r'`[A-Z]\w*(?:Error|Warning|Exception)`\s*\((?:"([^"]+)"|`([^`]+)`)')
_FILLED = re.compile(r"\.\.\.|'[^']*'|\"[^\"]*\"|\([^()]*\)|\b\d+\b|(?<==)[\w.]+")
_WORD = re.compile(r"[A-Za-z][\w'-]+")


@functools.cache
def _literal_text() -> str:
    """The packages' string literals, f-strings cut at their values (NUL), whitespace collapsed."""
    parts = []
    for path in module_index().values():
        for n in ast.walk(_tree(path)):
            if isinstance(n, ast.JoinedStr):
                parts.append("\0".join(v.value if isinstance(v, ast.Constant) else "" for v in n.values))
            elif isinstance(n, ast.Constant) and isinstance(n.value, str):
                parts.append(n.value)
    return re.sub(r"\s+", " ", "\0".join(parts))


def message_pieces(message: str) -> list[str]:
    """The pieces of a quoted message the code must hold word for word (see [Note: docs that cannot drift])."""
    pieces = (re.sub(r"\s+", " ", p).strip(" ,;:.") for p in _FILLED.sub("\0", message).split("\0"))
    return [p for p in pieces if len(_WORD.findall(p)) >= 4]


class _Resolver:
    """Resolves ``a.b.c`` against the repository's sources without importing them."""

    def module(self, name: str) -> tuple[str, object]:
        return ("module", name)

    @functools.cache  # noqa: B019 (one resolver per check)
    def bindings(self, module: str) -> dict[str, tuple[str, object]]:
        found: dict[str, tuple[str, object]] = {}
        for node in _top_level(_tree(module_index()[module])):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                found[node.name] = ("function", None)
            elif isinstance(node, ast.ClassDef):
                found[node.name] = ("class", (module, node))
            elif isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            found[n.id] = ("value", None)
            elif isinstance(node, ast.Import):
                for a in node.names:
                    found[a.asname or a.name.split(".")[0]] = ("module", a.name if a.asname else a.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    found[a.asname or a.name] = ("from", (node.module, a.name))
        for old, new in _deprecated(module_index()[module]).items():
            found.setdefault(old, ("deprecated", new))
        return found

    def attr(self, obj: tuple[str, object], name: str) -> tuple[str, object]:
        kind, data = obj
        if kind == "module":
            module = str(data)
            if f"{module}.{name}" in module_index():
                return ("module", f"{module}.{name}")
            if module not in module_index():
                return ("external", None)
            got = self.bindings(module).get(name)
            if got is None:
                return ("missing", f"{module} has no {name!r}")
            if got[0] == "from":
                source, original = got[1]  # type: ignore[misc]
                return self.attr(("module", source), original)
            if got[0] == "module":
                return ("module", got[1]) if got[1] in module_index() else ("external", None)
            return got
        if kind == "class":
            module, node = data  # type: ignore[misc]
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and item.name == name:
                    return ("class", (module, item)) if isinstance(item, ast.ClassDef) else ("function", None)
                targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return ("value", None)
            for n in ast.walk(node):  # self.name = ... in a method
                if isinstance(n, ast.Attribute) and n.attr == name and isinstance(n.ctx, ast.Store):
                    if isinstance(n.value, ast.Name) and n.value.id == "self":
                        return ("value", None)
            for base in node.bases:
                parts = ast.unparse(base).split("[")[0].split(".")
                resolved: tuple[str, object] = ("module", module)
                for part in parts:
                    resolved = self.attr(resolved, part)
                if resolved[0] == "class":
                    got = self.attr(resolved, name)
                    if got[0] != "missing":
                        return got
                elif resolved[0] in ("external", "value"):
                    return ("external", None)  # a base from torch, typing, ...: cannot say
            return ("missing", f"{node.name} has no {name!r}")
        if kind in ("external", "value"):
            return ("external", None)  # an attribute of a value or of another library: cannot say
        return ("missing", f"a {kind} has no attribute {name!r}")

    def resolve(self, dotted: str) -> tuple[str, object]:
        parts = dotted.split(".")
        obj: tuple[str, object] = ("module", parts[0])
        for part in parts[1:]:
            obj = self.attr(obj, part)
            if obj[0] in ("missing", "deprecated"):
                return obj
        return obj


def bad_names(text: str, page: str = "") -> list[str]:
    """What the prose of ``text`` names that the code does not have, as ``page:line: problem``."""
    resolver = _Resolver()
    short = {ns.split(".")[-1]: ns for ns in public_namespaces() if ns.startswith("shardbridge.")}
    problems = []
    body = prose(text)
    for lineno, line in enumerate(body.split("\n"), 1):
        for span in _SPAN.findall(line):
            m = _DOTTED.match(span)
            if _PY_FILE.match(span):
                # ours by convention: a bare private module (`_repair.py`), or a path from a folder
                # of a shardbridge package (`state/_provider.py`); others are upstream files or scripts
                ours = span.split("/")[0] in _package_folders() if "/" in span else span.startswith("_")
                if ours and not any(f == span or f.endswith("/" + span) for f in _code_files()):
                    problems.append(f"{page}:{lineno}: `{span}` is no file of the repository")
            elif m:
                dotted = m.group(1)
                first = dotted.split(".")[0]
                if first in short and span[len(dotted) :].startswith("("):
                    dotted = f"{short[first].rpartition('.')[0]}.{dotted}"  # a call: fp8.refresh(model)
                elif not first.startswith("shardbridge"):
                    continue
                kind, why = resolver.resolve(dotted)
                if kind == "deprecated":
                    problems.append(f"{page}:{lineno}: `{span}` is a deprecated alias: name `{why}`")
                elif kind == "missing" and dotted not in _string_constants():
                    problems.append(f"{page}:{lineno}: `{span}` names nothing in the code ({why})")
    joined = re.sub(r"\s+", " ", body)
    for m in _MESSAGE.finditer(joined):
        missing = [p for p in message_pieces(m.group(1) or m.group(2)) if p not in _literal_text()]
        if missing:
            problems.append(f"{page}: the message {missing[0]!r} is in no string of the code")
    for m in _NOTE.finditer(joined):
        if m.group(1) not in _defined_notes() and "..." not in m.group(1):
            problems.append(f"{page}: [Note: {m.group(1)}] is defined nowhere in the code")
    return problems + [f"{page}: `{p}` does not exist" for p in missing_paths(body)]


def problems() -> list[str]:
    """Every drifted block and every bad name, on every page."""
    found = []
    for path in pages():
        page = path.relative_to(REPO).as_posix()
        text = path.read_text(encoding="utf-8")
        found += [f"{page}: generated block `{key}` differs from the code" for key in drifted(text, page)]
        found += bad_names(text, page)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 on a drifted block or a bad name; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        found = problems()
        for problem in found:
            print(problem)
        if found:
            print(f"{len(found)} problem(s); regenerate with python tools/docs_architecture.py, fix the prose by hand")
            return 1
        print(f"{len(pages())} pages: every generated block matches the code, every name the prose uses exists")
        return 0
    written = 0
    for path in pages():
        text = path.read_text(encoding="utf-8")
        fresh = render(text, path.relative_to(REPO).as_posix())
        if fresh != text:
            path.write_text(fresh, encoding="utf-8")
            written += 1
    print(f"generated blocks rewritten in {written} page(s); names are checked by --check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
