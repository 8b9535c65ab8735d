"""The architecture sweep (``hf_sweep.py``) as a test: train, match one process, resume, reshard, export.

Default run: ``hf_sweep.CI_ARCHS``. ``SHARDBRIDGE_HF_SWEEP=all`` runs every ``*ForCausalLM``
of the installed transformers whose config has a TP plan and that ``hf_sweep.KNOWN`` does not
list as a documented exception (docs/hf.md, "Architecture sweep"); ``SHARDBRIDGE_HF_SWEEP=a,b``
runs the named ones.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_sweep as S  # noqa: E402


def _selected() -> list[str]:
    choice = os.environ.get("SHARDBRIDGE_HF_SWEEP", "")
    if choice == "all":
        return sorted(a for a in S.sweep_archs() if a not in S.KNOWN)
    if choice:
        return [a.strip() for a in choice.split(",") if a.strip()]
    return list(S.CI_ARCHS)


def test_ci_archs_have_tp_plans():
    archs = S.sweep_archs()
    assert set(S.CI_ARCHS) <= set(archs) and not set(S.CI_ARCHS) & set(S.KNOWN)


@pytest.mark.parametrize("model_type", _selected())
def test_architecture(model_type):
    result = S.run_arch(model_type)
    assert result == {c: "pass" for c in S.CHECKS}, result
