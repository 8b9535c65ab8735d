"""A hostile checkpoint loaded by ``shardbridge_megatron_fsdp.load``: refused, nothing runs.

See [Note: untrusted checkpoints] in ``shardbridge/checkpoint/storage/_trust.py``. The packed
optimizer hyperparameters (``optim.param_groups``, a DCP bytes item) are replaced by a pickle
that would create a marker directory if DCP's default ``weights_only=False`` load ran it.
"""

from __future__ import annotations

from mfsdp_helpers import build
from shardbridge.testing import run_distributed
from shardbridge.testing._hostile import Payload, plant_item, torch_save

NOT_TRUSTED = "not trusted; nothing from it was executed"


def _save(path: str) -> None:
    from shardbridge_megatron_fsdp import save

    _, model, opt = build({"dp_shard": 2}, "optim", adam=True)
    save(path, model=model, optimizer=opt, step=1)


def _load(path: str) -> str:
    from shardbridge_megatron_fsdp import load

    _, model, opt = build({"dp_shard": 2}, "optim", adam=True)
    try:
        load(path, model=model, optimizer=opt)
    except ValueError as err:
        return str(err)
    return "loaded"


def test_hostile_param_groups_refused_by_mfsdp_load(tmp_path):
    path, marker = tmp_path / "ckpt", tmp_path / "code-ran"
    run_distributed(_save, str(path), world_size=2, timeout=300)
    plant_item(path, "optim.param_groups", torch_save(Payload(marker)))
    errors = run_distributed(_load, str(path), world_size=2, timeout=300)
    assert all(NOT_TRUSTED in e and "optim.param_groups" in e for e in errors), errors
    assert not marker.exists(), "code from the checkpoint ran"
