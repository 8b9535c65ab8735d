"""The Accelerate plugin (``_plugin``): in a launched worker ``accelerate.Accelerator`` is shardbridge's.

Pure tests against the real accelerate (the bindings and their undo), and the worker bootstrap in
a subprocess (a script and a module run as ``python`` would run them, with the plugin installed).
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

import pytest

pytest.importorskip("accelerate")

from shardbridge_hf import _compat, _plugin  # noqa: E402


def test_install_rebinds_accelerate_accelerator_and_uninstall_restores_the_identical_classes():
    import accelerate
    import accelerate.accelerator
    from shardbridge_hf import ShardbridgeAccelerator

    before = accelerate.Accelerator, accelerate.accelerator.Accelerator
    assert not _plugin.installed()
    plugin = _plugin.install()
    try:
        from accelerate import Accelerator

        assert Accelerator is accelerate.accelerator.Accelerator is ShardbridgeAccelerator
        assert _plugin.installed()
        assert _plugin.install()._undo == []  # idempotent: nothing rebound twice
    finally:
        plugin.uninstall()
    assert (accelerate.Accelerator, accelerate.accelerator.Accelerator) == before
    assert accelerate.Accelerator is before[0] and not _plugin.installed()
    plugin.uninstall()  # idempotent


def test_install_refuses_an_unchecked_accelerate(monkeypatch):
    monkeypatch.setattr(_compat, "accelerate_version", lambda: (1, 16, 0))
    with pytest.raises(RuntimeError, match="'accelerator_class'"):
        _plugin.install()


_PROBE = """\
import os, sys
from accelerate import Accelerator
RESULT = {"name": __name__, "argv": sys.argv[1:], "path0": os.path.realpath(sys.path[0]), "class": Accelerator.__name__}
"""


@pytest.fixture
def plugin(monkeypatch):
    """The plugin installed for one test (sys.argv / sys.path restored after)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    installed = _plugin.install()
    yield
    installed.uninstall()


_RUN_PATH, _RUN_MODULE = runpy.run_path, runpy.run_module


def _ran(capture):
    """What the probe's RESULT holds after the next run_target (runpy returns the module's globals)."""
    result = {}
    run_path, run_module = _RUN_PATH, _RUN_MODULE
    capture.setattr(runpy, "run_path", lambda *a, **k: result.update(run_path(*a, **k)["RESULT"]))
    capture.setattr(runpy, "run_module", lambda *a, **k: result.update(run_module(*a, **k)["RESULT"]))
    return result


def test_run_target_runs_a_script_and_a_module_as_python_would(tmp_path, plugin, monkeypatch):
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / "probe.py").write_text(_PROBE)
    result = _ran(monkeypatch)
    _plugin.run_target([str(folder / "probe.py"), "--lr", "1e-3"])
    # `python code/probe.py --lr 1e-3` puts the script's folder first on sys.path
    assert result == {"name": "__main__", "argv": ["--lr", "1e-3"], "path0": os.path.realpath(folder),
                      "class": "ShardbridgeAccelerator"}  # fmt: skip
    (folder / "probemod.py").write_text(_PROBE)
    monkeypatch.chdir(folder)
    result = _ran(monkeypatch)
    _plugin.run_target([_plugin.RUN_MODULE, "probemod", "x"])
    assert result == {"name": "__main__", "argv": ["x"], "path0": os.path.realpath(folder), "class": "ShardbridgeAccelerator"}


def test_worker_without_a_target_exits_2(capsys):
    for argv in ([], [_plugin.RUN_MODULE]):
        with pytest.raises(SystemExit) as exit_:
            _plugin.main(argv)
        assert exit_.value.code == 2
        assert "no script to run" in capsys.readouterr().err


def test_the_worker_module_installs_the_plugin_and_passes_the_exit_status_through(tmp_path):
    """``python -m shardbridge_hf._worker SCRIPT`` as a worker of `shardbridge launch` runs it (one subprocess)."""
    (tmp_path / "probe.py").write_text(_PROBE + "sys.exit(7 if RESULT['class'] == 'ShardbridgeAccelerator' else 3)\n")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", _plugin.WORKER_MODULE, "probe.py"], env=env, cwd=tmp_path, capture_output=True, timeout=300
    )
    assert run.returncode == 7, run.stderr[-3000:]
    assert b"RuntimeWarning" not in run.stderr, run.stderr[-3000:]  # runpy's: a module run twice
