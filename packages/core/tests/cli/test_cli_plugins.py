"""shardbridge.cli._plugins: adapter verbs through the ``shardbridge.cli`` entry-point group."""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib

import pytest
from shardbridge.cli import _main, _plugins
from shardbridge.cli._plugins import GROUP, Verb

CLI = pathlib.Path(_main.__file__).parent


def test_core_cli_names_no_adapter():
    """The core CLI reaches adapters only through entry points (docs/architecture.md layering)."""
    for path in CLI.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.startswith("shardbridge_") for n in names), f"{path.name}:{node.lineno}"


def test_launch_is_registered_by_the_hf_adapter():
    assert "launch" in _plugins.verb_names()
    (ep,) = [ep for ep in importlib.metadata.entry_points(group=GROUP) if ep.name == "launch"]
    assert ep.value == "shardbridge_hf._launch:cli_verb"
    verb = _plugins.load_verb("launch")
    assert isinstance(verb, Verb) and "accelerate launch" in verb.help and 'pip install -e ".[hf]"' in verb.install_hint


def _fake(monkeypatch, value: str) -> None:
    ep = importlib.metadata.EntryPoint(name="fakeverb", value=value, group=GROUP)
    monkeypatch.setattr(_plugins, "_entry_points", lambda: {"fakeverb": ep})


def test_help_lists_registered_verbs_without_importing_them(monkeypatch, capsys):
    _fake(monkeypatch, "no_such_adapter_module:verb")
    with pytest.raises(SystemExit):
        _main.main(["--help"])
    assert "fakeverb" in capsys.readouterr().out


def test_missing_adapter_is_one_line_exit_2(monkeypatch, capsys):
    _fake(monkeypatch, "no_such_adapter_module:verb")
    assert _main.main(["fakeverb", "--x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("shardbridge fakeverb: needs an adapter that is not installed")


VERB_CALLS: list[list[str]] = []


def _raises_import_error(argv):
    raise ImportError("accelerate is not installed")


ok_verb = Verb(help="records its argv", main=lambda argv: VERB_CALLS.append(list(argv)) or 0)
broken_verb = Verb(help="its framework is missing", main=_raises_import_error, install_hint='pip install "x[y]"')
not_a_verb = object()


def test_verb_gets_its_arguments_unparsed(monkeypatch):
    _fake(monkeypatch, f"{__name__}:ok_verb")
    assert _main.main(["fakeverb", "--config_file", "a.yaml", "train.py", "--lr", "1"]) == 0
    assert VERB_CALLS[-1] == ["--config_file", "a.yaml", "train.py", "--lr", "1"]


def test_missing_framework_names_the_install_hint(monkeypatch, capsys):
    _fake(monkeypatch, f"{__name__}:broken_verb")
    assert _main.main(["fakeverb"]) == 2
    assert capsys.readouterr().err == 'shardbridge fakeverb: error: accelerate is not installed; pip install "x[y]"\n'


def test_entry_point_that_is_not_a_verb_is_an_error(monkeypatch, capsys):
    _fake(monkeypatch, f"{__name__}:not_a_verb")
    assert _main.main(["fakeverb"]) == 2
    assert "is a object, not a Verb" in capsys.readouterr().err
