"""``transformers.Trainer`` adapted under a ShardbridgeAccelerator (``_trainer``), against the real transformers.

The adaptations are installed with the accelerator and undone exactly; a Trainer whose accelerator is
not shardbridge's runs the original methods; a Trainer built under the plugin refuses, by name and
before training starts, what shardbridge cannot honour (4 gloo ranks). Training itself, checkpoints,
resume and save_model run end to end in ``integration_tests/test_trainer.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402
from shardbridge_hf import _compat, _trainer  # noqa: E402
from shardbridge_hf._accelerator import ShardbridgeAccelerator  # noqa: E402


@pytest.fixture
def trainer_module():
    import transformers.trainer

    return transformers.trainer


def test_adaptations_wrap_each_method_and_undo_restores_the_identical_originals(trainer_module):
    trainer = trainer_module.Trainer
    originals = {name: trainer.__dict__[name] for name in _trainer._ADAPTATIONS}
    assert not _trainer.is_adapted()
    undo = _trainer.adapt_trainer(ShardbridgeAccelerator)
    try:
        assert _trainer.is_adapted() and len(undo) == len(originals)
        for name, original in originals.items():
            assert trainer.__dict__[name].__shardbridge_original__ is original, name
        assert _trainer.adapt_trainer(ShardbridgeAccelerator) == []  # once per process
    finally:
        for u in reversed(undo):
            u()
    for name, original in originals.items():
        assert trainer.__dict__[name] is original, name


def test_an_adapted_method_refuses_an_unchecked_transformers_when_a_shardbridge_trainer_calls_it(trainer_module, monkeypatch):
    """Installing touches no version (a script without a Trainer runs anywhere); calling does."""
    monkeypatch.setattr(_compat, "transformers_version", lambda: (5, 12, 0))
    undo = _trainer.adapt_trainer(ShardbridgeAccelerator)
    try:
        monkeypatch.setattr(_trainer, "_ours", lambda trainer, accelerator: True)
        with pytest.raises(RuntimeError, match=r"'trainer.train'.*transformers 5.13 to 5.24.x; this is transformers 5.12.0"):
            trainer_module.Trainer.train(object())
    finally:
        for u in reversed(undo):
            u()


def test_a_trainer_with_accelerates_own_accelerator_runs_the_originals(trainer_module, tmp_path):
    """save_model of a plain (one-process) Trainer still writes transformers' own folder."""
    from transformers import Trainer, TrainingArguments

    undo = _trainer.adapt_trainer(ShardbridgeAccelerator)
    try:
        t = Trainer(model=H.tiny_model("llama"), args=TrainingArguments(output_dir=str(tmp_path), report_to="none"))
        t.save_model(str(tmp_path / "model"))
        assert (tmp_path / "model" / "model.safetensors").is_file()
        assert not _trainer._ours(t, ShardbridgeAccelerator)
    finally:
        for u in reversed(undo):
            u()


def _refusals(out: str) -> dict[str, str]:
    """Trainers built under the plugin (a `shardbridge launch` worker): what each option raises."""
    import dataclasses
    import os

    from shardbridge import ParallelDims
    from shardbridge_hf import ENV_VAR, HFConfig, _plugin
    from transformers import Trainer, TrainingArguments

    H.accelerate_env()
    dims = ParallelDims(dp_shard=2, tp=2).resolve(4)
    os.environ[ENV_VAR] = dataclasses.replace(HFConfig(use_cpu=True), dims=dims).to_json()
    os.environ["ACCELERATE_USE_CPU"] = "true"
    plugin = _plugin.install()
    undo = []
    got = {}
    try:
        data = [{"input_ids": t, "labels": t} for t in torch.randint(0, H.VOCAB, (8, H.SEQ))]
        cases = {
            "torch_compile": dict(torch_compile=True),
            "bf16": dict(bf16=True, use_cpu=True),
            "auto_find_batch_size": dict(auto_find_batch_size=True),
            "fsdp size-based wrap": dict(fsdp=True, fsdp_config={"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 1}),
        }
        for name, kwargs in cases.items():
            try:
                args = TrainingArguments(output_dir=out, max_steps=1, report_to="none", **kwargs)
                trainer = Trainer(model=H.tiny_model("llama"), args=args, train_dataset=data)
                undo += trainer.accelerator._sb_undo
                trainer.accelerator._sb_undo = []
                trainer.train()  # options only the Trainer sees are checked here, before any step
                got[name] = "trained"
            except (ValueError, NotImplementedError, RuntimeError) as e:  # RuntimeError: the gate, before 5.13
                got[name] = f"{type(e).__name__}: {e}"
    finally:
        for u in reversed(undo):
            u()
        plugin.uninstall()
        os.environ.pop(ENV_VAR, None)
        os.environ.pop("ACCELERATE_USE_CPU", None)
    return got


def test_trainer_options_that_cannot_be_honoured_are_refused_by_name_before_training(tmp_path):
    results = run_distributed(_refusals, str(tmp_path), world_size=4, timeout=240)
    assert results[0] == results[1] == results[2] == results[3]
    got = results[0]
    assert got["torch_compile"].startswith("NotImplementedError: torch.compile") and "torch_compile=True" in got["torch_compile"]
    assert "TrainingArguments(bf16=True)" in got["bf16"] and "precision='fp32' does not compute in bf16" in got["bf16"]
    if _compat.transformers_version() >= (5, 13):
        assert got["auto_find_batch_size"].startswith("NotImplementedError: TrainingArguments(auto_find_batch_size=True)")
    else:  # the Trainer scales its loss by num_processes: refused as a whole at train()
        assert got["auto_find_batch_size"].startswith("RuntimeError: shardbridge_hf's patch 'trainer.train'")
    assert "fsdp_config=...) passes it): auto_wrap_policy" in got["fsdp size-based wrap"]
