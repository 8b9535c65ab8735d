"""TransformerEngine FP8 wiring (``_te``) without TE: the fp8_autocast wrap, its gate and its undo.

TE itself cannot be imported on CPU; ``require_te`` and ``build_recipe`` are replaced by a
stand-in that records when forward runs under ``fp8_autocast``. The wiring against TE's real
Python code is checked by ``integration_tests/test_hf_te_fp8_structural.py``.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

pytest.importorskip("accelerate")

from shardbridge_hf import FP8Config, _compat, _te  # noqa: E402


@pytest.fixture
def fake_te(monkeypatch):
    state = {"inside": False, "calls": []}

    @contextlib.contextmanager
    def fp8_autocast(enabled, fp8_recipe):
        state["inside"] = True
        try:
            yield
        finally:
            state["inside"] = False

    monkeypatch.setattr(_te, "require_te", lambda: types.SimpleNamespace(fp8_autocast=fp8_autocast))
    monkeypatch.setattr(_te, "build_recipe", lambda fp8: "recipe")
    return state


def test_fp8_autocast_wrap_is_idempotent_and_undone_exactly(fake_te):
    model = torch.nn.Linear(2, 2)
    undo = _te.apply_fp8_autocast(model, FP8Config(backend="te"))
    assert _te.apply_fp8_autocast(model, FP8Config(backend="te")) is undo  # once per model
    assert "forward" in vars(model)
    assert _te.remove_fp8_autocast(model) is True
    assert "forward" not in vars(model) and model.forward.__func__ is torch.nn.Linear.forward
    assert _te.remove_fp8_autocast(model) is False


def test_fp8_autocast_runs_forward_inside_the_context(fake_te):
    class Probe(torch.nn.Module):
        def forward(self, x):
            return torch.tensor(fake_te["inside"])

    model = Probe()
    _te.apply_fp8_autocast(model, FP8Config(backend="te"))
    assert bool(model(torch.ones(1))) is True
    _te.remove_fp8_autocast(model)
    assert bool(model(torch.ones(1))) is False


def test_fp8_autocast_is_gated_on_the_accelerate_version(fake_te, monkeypatch):
    monkeypatch.setattr(_compat, "accelerate_version", lambda: (1, 16, 0))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="'te_fp8_autocast'.*accelerate #3710"):
        _te.apply_fp8_autocast(model, FP8Config(backend="te"))
    assert "forward" not in vars(model)


def test_require_te_names_the_extra():
    with pytest.raises(ImportError, match=r'pip install "shardbridge\[te\]"'):
        _te.require_te()
