"""A hostile checkpoint loaded by ``ShardbridgeAccelerator.load_state``: refused, nothing runs.

See [Note: untrusted checkpoints] in ``shardbridge/checkpoint/storage/_trust.py``. The packed
optimizer hyperparameters (``optim.param_groups``, a DCP bytes item) are replaced by a pickle
that would create a marker directory if DCP's default ``weights_only=False`` load ran it.
"""

from __future__ import annotations

import pytest
import torch
from shardbridge import ParallelDims
from shardbridge.testing import run_distributed
from shardbridge.testing._hostile import Payload, plant_item, torch_save

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402

NOT_TRUSTED = "not trusted; nothing from it was executed"


def _prepared():
    acc = H.sb_accelerator(ParallelDims(dp_shard=2))
    model = H.tiny_model("llama")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _save(path: str) -> None:
    acc, model, opt = _prepared()
    H.train_steps(acc, model, opt, 1)
    acc.save_state(path)


def _load(path: str) -> str:
    acc, _, _ = _prepared()
    try:
        acc.load_state(path)
    except ValueError as err:
        return str(err)
    return "loaded"


def test_hostile_param_groups_refused_by_load_state(tmp_path):
    path, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    run_distributed(_save, str(path), world_size=2, timeout=240)
    plant_item(path, "optim.param_groups", torch_save(Payload(marker)))
    errors = run_distributed(_load, str(path), world_size=2, timeout=240)
    assert all(NOT_TRUSTED in e and "optim.param_groups" in e for e in errors), errors
    assert not marker.exists(), "code from the checkpoint ran"
