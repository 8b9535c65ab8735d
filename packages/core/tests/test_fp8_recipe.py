"""FP8Recipe construction: an unknown backend name is refused at once.

Registered backends (the core's torchao, ones registered by an adapter's import, and those an
installed package declares in the ``shardbridge.fp8_backends`` entry-point group) are accepted,
also when their library does not import here (``require_runtime`` refuses that at launch).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from shardbridge import fp8
from shardbridge.fp8 import FP8Recipe
from shardbridge.fp8 import _recipe as _backend


def test_unknown_backend_is_refused_at_construction_with_the_available_names():
    with pytest.raises(ValueError) as e:
        FP8Recipe(backend="nonsense")
    message = str(e.value)
    assert message.startswith("FP8Recipe.backend='nonsense' is not a registered FP8 backend; choose one of ")
    assert str(list(fp8.backend_names())) in message and "'torchao'" in message
    assert "shardbridge.fp8.register_backend" in message and "'shardbridge.fp8_backends'" in message
    with pytest.raises(ValueError, match=r"FP8Recipe.backend='nonsense' is not a registered FP8 backend"):
        FP8Recipe(backend="nonsense", name="rowwise")
    with pytest.raises(ValueError, match=r"FP8Recipe.backend='nonsense'"):
        FP8Recipe.from_dict({"backend": "nonsense", "name": "tensorwise"})


def test_a_backend_registered_at_runtime_is_found():
    class Mine(fp8.FP8BackendBase):
        name, recipes = "test-mine", ("tensorwise",)

    with pytest.raises(ValueError, match="'test-mine' is not a registered FP8 backend"):
        FP8Recipe(backend="test-mine")
    fp8.register_backend(Mine())
    try:
        assert FP8Recipe(backend="test-mine").backend == "test-mine"
        assert "'test-mine'" in str(_refusal("other"))  # listed among the choices
    finally:
        _backend._BACKENDS.pop("test-mine")


def _refusal(name: str) -> ValueError:
    with pytest.raises(ValueError) as e:
        FP8Recipe(backend=name)
    return e.value


def _run(code: str, **env: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_declared_backends_are_accepted_without_importing_them_even_when_missing(tmp_path):
    # "te" is declared by shardbridge_te's entry point (TransformerEngine is not installed here);
    # "ghost" by a distribution whose module does not import on this machine. One subprocess.
    dist = tmp_path / "ghost_fp8-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ghost-fp8\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[shardbridge.fp8_backends]\nghost = ghost_fp8_not_installed:backend\n")
    out = _run(
        """
        import sys
        from shardbridge import FP8Recipe, fp8
        FP8Recipe(backend="te", name="delayed", fp8_params=True)
        print([m for m in ("shardbridge_te", "transformer_engine") if m in sys.modules])
        recipe = FP8Recipe(backend="ghost", name="tensorwise")   # accepted: the name is declared
        try:
            fp8.get_backend(recipe.backend)                       # using it fails, naming the module
        except ImportError as e:
            print(type(e).__name__, e.name)
        """,
        PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
    )
    assert out.splitlines() == ["[]", "ModuleNotFoundError ghost_fp8_not_installed"]
