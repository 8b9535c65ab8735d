"""Tier 4: every command and Python block in README.md and docs/**/*.md runs, as printed.

[Note: executed docs]
~~~~~~~~~~~~~~~~~~~~~
The collector reads every fenced block of README.md, docs/**/*.md and packages/*/README.md:

    ```bash / ```sh        run with ``bash -e -o pipefail`` (the test's interpreter's bin/ first on PATH;
                           README.md: see "a new shell" below)
    ```python, first line  written to that file (a script a later block of the same page runs,
      ``# NAME.py``          e.g. ``torchrun ... NAME.py``); never run by itself
    ```python, ``>>>``      a doctest: every output must match (ELLIPSIS, NORMALIZE_WHITESPACE); run
                           in the test's process (doctest's own runner, fresh globals, the scratch
                           directory as cwd): what ``python -m doctest`` checks, without a new
                           interpreter importing torch for each block (~4 s each)
    ```python, otherwise   run with ``python``
    ```yaml with a top-  an Accelerate config file: read and validated by shardbridge_hf.read_config_file
      level distributed_type  (what ``shardbridge launch`` does before starting any process; in the
                           test's process)
    ```text / ```yaml /    not run (output, listings, fragments of config files)
      ```console-output ...
    ``` (no language)      an error: say what the block is

A block whose fence has ``<!-- docs-test: skip (REASON) -->`` on the line directly above is not
run; it is counted with its reason (GPU only, hours long, needs a network, ...). A Python block
under ``<!-- docs-test: signatures (MODULE) -->`` is an API listing: each entry
(``name(params) -> ret``, ``def name(params)``, ``class Name:`` with annotated fields or method
signatures) is checked against the real object in MODULE: parameter names, kinds (positional,
``*``, keyword-only) and defaults; dataclass fields and their defaults (every field, unless the
listing has a ``...`` line); every listed method. Each page's blocks
run in order in one scratch directory of their own, which holds a symlink to every top-level
entry of the repository (so ``examples/...``, ``tools/...`` resolve as from the repository root,
and what a block writes stays in the scratch directory): a later block may use what an earlier
one wrote (README: the demo, then ``shardbridge ckpt inspect shardbridge-demo/checkpoints``).
The first block that fails fails its page, with the block's line, text and output. At the end
the test prints ``docs: ran N block(s) in P page(s), skipped M (reasons)``.

README.md runs as a reader's NEW shell would (issue 38: with the test's interpreter first on PATH,
8 README lines that said ``command not found`` in a new shell passed here): its bash blocks get a
PATH without that interpreter's bin/ and no ``VIRTUAL_ENV``, and a ``source .../bin/activate``
line of an earlier block of the page is run again before each later block (one shell session). The
scratch directory's ``.venv`` is the test's interpreter's environment, so README's
``source .venv/bin/activate`` activates what the other pages run with.

Pages run two at a time (``SHARDBRIDGE_DOCS_JOBS``, default 2; 1 = one after the other), each page's
blocks in order in its own scratch directory: many blocks are one process (a CLI command, ``python
-c``) and leave one of CI's two cores idle. The seconds a block reports are measured beside the
other page's blocks.

Run one page: ``pytest integration_tests/test_docs.py -k hf.md``.
"""

from __future__ import annotations

import ast
import dataclasses
import doctest
import importlib
import inspect
import io
import os
import queue
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUN = {"bash": "bash", "sh": "bash", "python": "python"}
NOT_RUN = {"text", "yaml", "console-output", "json", "toml", "ini", "diff", "c", "cpp", "cuda", "markdown"}
ALIASES = {"shell": "bash", "console": "bash (or console-output for output)", "zsh": "bash", "py": "python",
           "python3": "python", "pycon": "python (a doctest: >>>)"}  # fmt: skip
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<lang>[^`\s]*)[ \t]*$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>skip|signatures)\s*\((?P<reason>.+)\)\s*-->\s*$")
SCRIPT_NAME = re.compile(r"^#\s*(?P<name>[\w.-]+\.py)\s*$")
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    """One fenced block of a page."""

    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    skip: str | None  # the skip marker's reason, or None
    signatures: str | None = None  # the module a signatures marker names, or None

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def script_name(self) -> str | None:
        first = next((line for line in self.text.splitlines() if line.strip()), "")
        match = SCRIPT_NAME.match(first)
        return match.group("name") if self.lang == "python" and match else None


def pages() -> list[str]:
    found = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted(REPO.glob("packages/*/README.md"))]
    return [str(p.relative_to(REPO)) for p in found if p.is_file()]


def parse(page: str) -> list[Block]:
    """Every fenced block of ``page``, with the skip marker of the line above, if any."""
    lines = (REPO / page).read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        indent, ticks = match.group("indent"), match.group("ticks")
        close = re.compile(rf"^{re.escape(indent)}{ticks}`*[ \t]*$")
        j = i + 1
        while j < len(lines) and not close.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"{page}:{i + 1}: a code fence that is never closed")
        body = "\n".join(line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : j])
        above = MARKER.match(lines[i - 1]) if i else None
        kind = above.group("kind") if above else None
        reason = above.group("reason").strip() if above else None
        blocks.append(
            Block(
                page,
                i + 1,
                match.group("lang").lower(),
                body + "\n",
                skip=reason if kind == "skip" else None,
                signatures=reason if kind == "signatures" else None,
            )
        )
        i = j + 1
    return blocks


def _problems(blocks: list[Block]) -> list[str]:
    """What the collector refuses before running anything: unlabelled fences, shell/python aliases,
    scripts no later block runs."""
    out = []
    for n, block in enumerate(blocks):
        if not block.lang:
            out.append(
                f"{block.where}: a fence without a language; label it bash/sh/python (run) or "
                "text/yaml/console-output (not run)"
            )
        elif block.lang in ALIASES:
            out.append(f"{block.where}: ```{block.lang} is not collected; write ```{ALIASES[block.lang]}")
        elif block.lang not in RUN and block.lang not in NOT_RUN:
            out.append(f"{block.where}: unknown fence language {block.lang!r}; use one of {sorted({*RUN, *NOT_RUN})}")
        name = block.script_name
        if name and block.skip is None and not any(name in later.text for later in blocks[n + 1 :] if later.lang in RUN):
            out.append(f"{block.where}: the script {name} is written but no later bash/python block of the page runs it")
    return out


def test_every_fence_says_what_it_is():
    """No block escapes the docs test by having no language (or a language it does not collect)."""
    problems = [p for page in pages() for p in _problems(parse(page))]
    assert not problems, "\n".join(problems)


def test_no_file_refers_to_notes_outside_the_repository():
    """The repository stands alone: no file points at engineering notes that are not part of it."""
    names = ["KNOWLEDGE" + ".md", "DESIGN" + ".md", "STYLE" + ".md", "../" + "shared", "/work/" + "shared"]
    pattern = re.compile("|".join(re.escape(n) for n in names))
    skip_dirs = {".git", ".venv", ".venv-core", ".venv-mcore", ".venv-wheel", ".nox", "__pycache__", "build", "dist"}
    found = []
    for path in REPO.rglob("*"):
        if path.is_dir() or skip_dirs & set(path.relative_to(REPO).parts) or path.suffix in (".png", ".pyc"):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(REPO)}:{n}" for n, line in enumerate(text.splitlines(), 1) if pattern.search(line)]
    assert not found, found


# -- running ------------------------------------------------------------------------------------

_COUNTS: Counter = Counter()
_SKIPPED: Counter = Counter()
_PAGES: set = set()
_BLOCK_SECONDS: list[tuple[float, str]] = []


NEW_SHELL_PAGES = ("README.md",)
"""Pages whose bash blocks run as in a reader's new shell (see [Note: executed docs])."""
ACTIVATE = re.compile(r"^\s*(?:source|\.)\s+\S*bin/activate\b.*$", re.MULTILINE)


def _scratch(tmp_path: Path) -> Path:
    """A directory that looks like the repository root for reading and keeps every write to itself."""
    venv = Path(sys.prefix)
    for entry in REPO.iterdir():
        if entry.name not in (".git",) and not (tmp_path / entry.name).exists():
            # .venv: the environment these tests run in (README activates it), wherever it lives
            target = venv if entry.name == ".venv" and (venv / "bin" / "activate").is_file() else entry
            (tmp_path / entry.name).symlink_to(target)
    if not (tmp_path / ".venv").exists() and (venv / "bin" / "activate").is_file():
        (tmp_path / ".venv").symlink_to(venv)
    return tmp_path


def _env(page: str = "") -> dict[str, str]:
    bin_dir = str(Path(sys.executable).parent)
    env = dict(os.environ, OMP_NUM_THREADS="1", PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    env.pop("SHARDBRIDGE_HF_CONFIG", None)
    if page in NEW_SHELL_PAGES:  # a new shell: no environment active, nothing of it on PATH
        inactive = {bin_dir, str(Path(os.environ.get("VIRTUAL_ENV", sys.prefix)) / "bin")}
        env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if p and p not in inactive)
        env.pop("VIRTUAL_ENV", None)
    return env


def _is_accelerate_config(block: Block) -> bool:
    return block.lang == "yaml" and re.search(r"^distributed_type:", block.text, re.MULTILINE) is not None


def _command(block: Block, cwd: Path, index: int, session: str = "") -> list[str] | None:
    """The command that runs ``block`` (its text written into ``cwd``), or None for a script file.

    ``session``: lines of earlier blocks a shell would still have in effect (an activation), run first.
    """
    if block.script_name:
        (cwd / block.script_name).write_text(block.text)
        return None
    if block.lang in ("bash", "sh"):
        path = cwd / f".docs-block-{index}.sh"
        path.write_text(session + block.text)
        return ["bash", "-e", "-o", "pipefail", str(path)]
    path = cwd / f".docs-block-{index}.py"
    path.write_text(block.text)
    return [sys.executable, str(path)]


def _in_process(block: Block, cwd: Path) -> str | None:
    """Run a doctest or an Accelerate config block in this process; None if it passed, else what failed.

    ``python -m doctest FILE`` would start an interpreter that imports torch and shardbridge again for
    each block; doctest's own runner here checks the same examples against the same printed output
    (fresh globals named ``__main__``, as ``python -m doctest`` gives a text file; ``cwd`` as the
    working directory).
    """
    before = os.getcwd()
    os.chdir(cwd)
    try:
        if _is_accelerate_config(block):
            from shardbridge_hf import read_config_file

            path = cwd / f".docs-block-{block.line}.yaml"
            path.write_text(block.text)
            try:
                read_config_file(path)
            except Exception as exc:  # noqa: BLE001 (the block's failure, reported as the subprocess's was)
                return f"{type(exc).__name__}: {exc}"
            return None
        flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
        test = doctest.DocTestParser().get_doctest(block.text, {"__name__": "__main__"}, block.where, block.page, block.line)
        out = io.StringIO()
        result = doctest.DocTestRunner(optionflags=flags).run(test, out=out.write)
        test.globs.clear()
        return out.getvalue() if result.failed else None
    finally:
        os.chdir(before)


# -- API listings ([Note: executed docs], the signatures marker) ---------------------------------


def _entries(text: str) -> list[str]:
    """The listing's entries: a line at column 0 starts one, indented lines continue it."""
    out: list[str] = []
    for line in text.splitlines():
        code = re.sub(r"\s+#.*$", "", line.rstrip())  # a trailing comment
        if not code.strip() or code.lstrip().startswith("#"):
            continue
        open_brackets = sum(out[-1].count(c) for c in "([{") - sum(out[-1].count(c) for c in ")]}") if out else 0
        # a continuation: indented, inside open brackets, or after a decorator
        if out and (code[0].isspace() or open_brackets > 0 or out[-1].splitlines()[-1].startswith("@")):
            out[-1] += "\n" + code
        else:
            out.append(code)
    return out


def _default_text(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


def _params(args: ast.arguments) -> list[tuple[str, str, str | None]]:
    """(name, kind, default source) per parameter of an ast signature."""
    positional = [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    out = [(a.arg, "positional", _default_text(d)) for a, d in zip(positional, defaults)]
    if args.vararg:
        out.append((args.vararg.arg, "*args", None))
    out += [(a.arg, "keyword", _default_text(d)) for a, d in zip(args.kwonlyargs, args.kw_defaults)]
    if args.kwarg:
        out.append((args.kwarg.arg, "**kwargs", None))
    return out


_KINDS = {
    inspect.Parameter.POSITIONAL_ONLY: "positional",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.VAR_POSITIONAL: "*args",
    inspect.Parameter.KEYWORD_ONLY: "keyword",
    inspect.Parameter.VAR_KEYWORD: "**kwargs",
}


def _same_default(listed: str | None, actual: object) -> bool:
    if listed is None:
        return actual is inspect.Parameter.empty
    if actual is inspect.Parameter.empty:
        return False
    try:
        return ast.literal_eval(listed) == actual
    except ValueError:  # a name such as torch.float32
        return listed.split(".")[-1] == (getattr(actual, "__name__", None) or repr(actual).split(".")[-1])


def _compare_function(where: str, listed: ast.arguments, target: object, skip_self: bool) -> list[str]:
    actual = [
        (p.name, _KINDS[p.kind], p.default)
        for p in inspect.signature(target).parameters.values()
        if not (skip_self and p.name == "self")
    ]
    mine = [p for p in _params(listed) if not (skip_self and p[0] == "self")]
    if [(n, k) for n, k, _ in mine] != [(n, k) for n, k, _ in actual]:
        return [f"{where}: listed {[(n, k) for n, k, _ in mine]}, actual {[(n, k) for n, k, _ in actual]}"]
    return [
        f"{where}: default of {n} listed as {d}, actual {a!r}"
        for (n, _, d), (_, _, a) in zip(mine, actual)
        if not _same_default(d, a)
    ]


def _field_default(field: dataclasses.Field) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return field.default_factory()  # type: ignore[misc]
    return inspect.Parameter.empty


def check_signatures(block: Block) -> list[str]:
    """Each entry of an API listing against the real object (see [Note: executed docs])."""
    module = importlib.import_module(block.signatures)
    problems = []
    for entry in _entries(block.text):
        source = entry if entry.startswith(("def ", "class ", "@")) else "def " + entry
        source = re.sub(r"\)(\s*->[^:\n]*)?\s*$", r")\1: ...", source) if not source.startswith(("class", "@")) else source
        try:
            tree = ast.parse(source)
        except SyntaxError as exc:
            problems.append(f"cannot read the entry as a signature ({exc.msg}): {entry.splitlines()[0]}")
            continue
        node = tree.body[0]
        target = getattr(module, node.name, None)
        if target is None:
            problems.append(f"{block.signatures} has no {node.name!r}")
        elif isinstance(node, ast.FunctionDef):
            problems += _compare_function(node.name, node.args, target, skip_self=False)
        elif dataclasses.is_dataclass(target):
            fields = {f.name: f for f in dataclasses.fields(target)}
            listed = {i.target.id for i in node.body if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)}
            elided = any(
                isinstance(i, ast.Expr) and isinstance(i.value, ast.Constant) and i.value.value is Ellipsis
                for i in node.body
            )
            if not elided and set(fields) - listed:  # a complete listing unless it says "..."
                problems.append(f"{node.name}: fields {sorted(set(fields) - listed)} are not listed (or add a ... line)")
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    name = item.target.id
                    if name not in fields:
                        problems.append(f"{node.name} has no field {name!r} (fields: {list(fields)})")
                    elif item.value is not None and not _same_default(ast.unparse(item.value), _field_default(fields[name])):
                        problems.append(f"{node.name}.{name}: default listed as {ast.unparse(item.value)}, "
                                        f"actual {_field_default(fields[name])!r}")  # fmt: skip
        else:
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    method = getattr(target, item.name, None)
                    if method is None:
                        problems.append(f"{node.name} has no method {item.name!r}")
                    else:
                        problems += _compare_function(f"{node.name}.{item.name}", item.args, method, skip_self=True)
    return problems


_CAUSE = re.compile(r"terminate called|what\(\):|Fatal Python error|Error\b|Exception\b|Traceback")


def _tail(text: str, lines: int = 40) -> str:
    """The last ``lines`` lines, after the earlier lines that name a cause (a C++ abort's
    ``terminate called ... what():`` scrolls away under torchrun's own report of it)."""
    all_lines = text.splitlines()
    earlier = [line for line in all_lines[:-lines] if _CAUSE.search(line)][:12]
    head = ["[earlier lines naming a cause]", *earlier, "[...]"] if earlier else []
    return "\n".join(head + all_lines[-lines:])


def _missing_extras() -> list[str]:
    from shardbridge._extras import missing_requirements

    return missing_requirements("all")


_BOOK = threading.Lock()  # the counts above: pages run in threads (DOCS_JOBS)


def _ran(block: Block, seconds: float | None) -> None:
    with _BOOK:
        _COUNTS["ran"] += 1
        if seconds is not None:
            _COUNTS["seconds"] += seconds
            _BLOCK_SECONDS.append((seconds, block.where))


def _run_page(page: str, tmp_path: Path) -> None:
    """Every block of ``page`` in order, in a scratch directory of its own; the first failure raises."""
    blocks = parse(page)
    problems = _problems(blocks)
    assert not problems, "\n".join(problems)
    cwd = _scratch(tmp_path)
    with _BOOK:
        _PAGES.add(page)
    session = ""  # what a reader's shell keeps from the page's earlier blocks: activations
    for index, block in enumerate(blocks):
        if _STOP.is_set():
            raise RuntimeError(f"{page}: the docs test stopped (an earlier failure with -x, or a timeout)")
        if block.lang not in RUN and not _is_accelerate_config(block):
            continue
        if block.skip is not None:
            with _BOOK:
                _SKIPPED[block.skip] += 1
            continue
        if block.signatures is not None:
            problems = check_signatures(block)
            assert not problems, f"{block.where}: the listing does not match {block.signatures}:\n" + "\n".join(problems)
            _ran(block, None)
            continue
        if _is_accelerate_config(block) or (block.lang == "python" and block.text.lstrip().startswith(">>>")):
            start = time.perf_counter()
            failure = _on_main_thread(_in_process, block, cwd)
            _ran(block, time.perf_counter() - start)
            assert failure is None, f"{block.where} ({block.lang}) failed:\n{block.text}\n--- output ---\n{failure}"
            continue
        command = _command(block, cwd, index, session if page in NEW_SHELL_PAGES else "")
        if block.lang in ("bash", "sh"):
            session += "".join(f"{line}\n" for line in ACTIVATE.findall(block.text))
        if command is None:
            continue
        start = time.perf_counter()
        try:
            run = subprocess.run(
                command, cwd=cwd, env=_env(page), capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.where}: the block ran longer than {BLOCK_TIMEOUT_S} s:\n{block.text}")
        _ran(block, time.perf_counter() - start)
        assert run.returncode == 0, (
            f"{block.where} ({block.lang}) exited {run.returncode}:\n{block.text}\n--- output (tail) ---\n"
            f"{_tail(run.stdout)}\n{_tail(run.stderr)}"
        )


DOCS_JOBS = int(os.environ.get("SHARDBRIDGE_DOCS_JOBS", "2"))
"""Pages run this many at a time (each page's blocks in order): many blocks are one process (a CLI
command, ``python -c``), which leaves a core of CI's two idle; another page's blocks use it."""
_FIRST = ("docs/hf.md", "README.md")  # the longest pages start first
_MAIN: queue.Queue = queue.Queue()
"""Calls a page's thread hands to the main thread: a doctest writes to sys.stdout, which is the
process's, and pytest swaps it at every test's start and end, in the main thread."""


_STOP = threading.Event()
"""Set when the module's pages are torn down (the end, or after ``-x`` / a timeout): a page still
running stops at its next block, and a call waiting for the main thread gives up."""


def _on_main_thread(fn, *args):
    """``fn(*args)`` run by the main thread (which serves while it waits for a page: _serve_until)."""
    if threading.current_thread() is threading.main_thread():
        return fn(*args)
    done: Future = Future()
    _MAIN.put((fn, args, done))
    while True:
        try:
            return done.result(timeout=1.0)
        except TimeoutError:
            if _STOP.is_set() and not done.running():
                done.cancel()
                raise RuntimeError("the docs test stopped before the main thread ran this block") from None


def _serve_until(runs: list[Future]) -> None:
    """Run the pages' main-thread calls until every run of ``runs`` has ended."""
    while not all(run.done() for run in runs):
        try:
            fn, args, done = _MAIN.get(timeout=0.1)
        except queue.Empty:
            continue
        if not done.set_running_or_notify_cancel():
            continue
        try:
            done.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 (the block's failure: handed to its page's thread)
            done.set_exception(exc)
        except BaseException as exc:  # a timeout or an interrupt of the test running now: its own
            done.set_exception(RuntimeError(f"interrupted ({type(exc).__name__})"))
            raise


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory):
    """page -> the Future of its run, for every page this session collected; DOCS_JOBS at a time."""
    pages_here = [
        item.callspec.params["page"]
        for item in request.session.items
        if item.module is request.module and item.originalname == "test_page_runs_as_printed"
    ]
    pages_here.sort(key=lambda p: (p not in _FIRST, _FIRST.index(p) if p in _FIRST else 0))
    pool = ThreadPoolExecutor(max_workers=max(1, DOCS_JOBS), thread_name_prefix="docs-page")
    # tmp directories made here, in the main thread (tmp_path_factory is not thread-safe)
    runs = {page: pool.submit(_run_page, page, tmp_path_factory.mktemp(re.sub(r"\W", "_", page))) for page in pages_here}
    try:
        yield runs
    finally:
        _STOP.set()  # a page still running (after -x, a timeout) stops at its next block
        for run in runs.values():
            run.cancel()
        try:
            _serve_until(list(runs.values()))  # ... and may need the main thread until then
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            _STOP.clear()


@pytest.mark.slow
# A page is many blocks, each with its own BLOCK_TIMEOUT_S: the suite-wide 600 s (pyproject) would
# cut a long page (docs/hf.md: four 4-process launches) on a loaded machine while every block is
# still within its own limit.
@pytest.mark.timeout(3 * BLOCK_TIMEOUT_S)
@pytest.mark.skipif(
    bool(_missing_extras()),
    reason=f"the docs run in tools/test.sh's environment (extras all,te-structural); not installed: {_missing_extras()}",
)
@pytest.mark.parametrize(
    "page", [p for p in pages() if any(b.lang in RUN or _is_accelerate_config(b) for b in parse(p))]
)
def test_page_runs_as_printed(page, page_runs):
    _serve_until([page_runs[page]])
    page_runs[page].result()  # re-raises the page's first failure


def summary() -> str | None:
    """``docs: ran N block(s) ..., skipped M (reasons)``, or None when no page ran."""
    if not _PAGES:
        return None
    skipped = sum(_SKIPPED.values())
    reasons = "; ".join(f"{n} x {reason}" for reason, n in sorted(_SKIPPED.items(), key=lambda kv: -kv[1]))
    slowest = ", ".join(f"{where} {sec:.0f} s" for sec, where in sorted(_BLOCK_SECONDS, reverse=True)[:5])
    return (
        f"docs: ran {_COUNTS['ran']} block(s) in {len(_PAGES)} page(s) ({_COUNTS['seconds']:.0f} s), "
        f"skipped {skipped}" + (f" ({reasons})" if reasons else "") + (f"; slowest: {slowest}" if slowest else "")
    )
