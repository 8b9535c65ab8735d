"""The patch plan (``_patches``): each Accelerate patch is gated by its checked versions and undone exactly.

The version probe (``shardbridge_hf._compat.accelerate_version``) is monkeypatched; the
objects patched are Accelerate's real ones.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")

from shardbridge import ParallelDims  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402
from shardbridge_hf import _compat, _patches  # noqa: E402


@pytest.mark.parametrize("patch", _patches.PATCHES, ids=[p.name for p in _patches.PATCHES])
def test_each_patch_is_gated_by_its_checked_range(patch, monkeypatch):
    assert patch.target and patch.covers and patch.undo
    for inside in ((1, 10, 1), (1, 15, 0), (1, 15, 9)):
        monkeypatch.setattr(_compat, "accelerate_version", lambda v=inside: v)
        assert _patches.gate(patch.name) is True
    for outside in ((1, 9, 0), (1, 16, 0)):
        monkeypatch.setattr(_compat, "accelerate_version", lambda v=outside: v)
        if patch.outside == "error":
            with pytest.raises(RuntimeError, match=rf"'{patch.name}'.*accelerate 1\.10 to 1\.15\.x"):
                _patches.gate(patch.name)
        else:
            with pytest.warns(UserWarning, match=rf"'{patch.name}'.*the patch is skipped"):
                assert _patches.gate(patch.name) is False


@pytest.mark.parametrize("patch", _patches.TRAINER_PATCHES, ids=[p.name for p in _patches.TRAINER_PATCHES])
def test_each_trainer_patch_is_gated_by_its_checked_transformers(patch, monkeypatch):
    assert patch.target and patch.covers and patch.undo and patch.outside == "error"
    for inside in ((5, 13, 0), (5, 24, 0), (5, 24, 3)):
        assert _patches.trainer_gate(patch.name, inside) is True
    for outside in ((5, 12, 0), (5, 25, 0)):  # 5.12 scales the loss by num_processes (tp times too much)
        with pytest.raises(RuntimeError, match=rf"'{patch.name}'.*transformers 5\.13 to 5\.24\.x"):
            _patches.trainer_gate(patch.name, outside)


def test_the_trainer_plan_adapts_exactly_the_methods_the_trainer_module_replaces():
    from shardbridge_hf import _trainer

    assert [p.name for p in _patches.TRAINER_PATCHES] == [f"trainer.{m}" for m in _trainer._ADAPTATIONS]


def test_an_untested_transformers_is_named_in_one_warning(monkeypatch):
    """[Note: version policy]: transformers has no upper bound; outside TRANSFORMERS_CHECKED one warning names it."""
    from shardbridge import UntestedVersionWarning

    low, high = _compat.TRANSFORMERS_CHECKED
    assert low <= _compat.transformers_version()[: len(low)] and _compat.transformers_version()[: len(high)] <= high
    newer = (high[0], high[1] + 1, 0)
    monkeypatch.setattr(_compat, "transformers_version", lambda: newer)
    _compat.require_accelerate.cache_clear()
    try:
        with pytest.warns(UntestedVersionWarning, match=rf"transformers {newer[0]}\.{newer[1]}\.0 is untested"):
            _compat.require_accelerate()
    finally:
        _compat.require_accelerate.cache_clear()


def test_accelerator_refuses_an_unchecked_accelerate_before_any_work(monkeypatch):
    from shardbridge_hf import ShardbridgeAccelerator

    monkeypatch.setattr(_compat, "accelerate_version", lambda: (1, 16, 0))
    with pytest.raises(RuntimeError, match="'partial_state_fsdp'"):
        ShardbridgeAccelerator(cpu=True)


def test_prepare_tp_override_is_skipped_outside_its_range(monkeypatch):
    import accelerate
    from shardbridge_hf import ShardbridgeAccelerator

    monkeypatch.setattr(accelerate.Accelerator, "_prepare_tp", lambda self, *args: ("upstream", *args))
    acc = object.__new__(ShardbridgeAccelerator)  # _prepare_tp reads no instance state
    assert acc._prepare_tp(1, 2) == (1, 2)  # checked accelerate: the no-op override
    monkeypatch.setattr(_compat, "accelerate_version", lambda: (1, 16, 0))
    with pytest.warns(UserWarning, match="'prepare_tp_noop'.*ReplicateParallel"):
        assert acc._prepare_tp(1, 2) == ("upstream", 1, 2)


def test_patch_item_and_attr_undo_restore_the_identical_object():
    from accelerate.state import PartialState

    shared = PartialState._shared_state
    missing = object()
    before = shared.get("distributed_type", missing)
    undo = _patches.patch_item(shared, "distributed_type", "FSDP-sentinel")
    assert PartialState._shared_state["distributed_type"] == "FSDP-sentinel"
    undo()
    assert shared.get("distributed_type", missing) is before

    module = torch.nn.Linear(2, 2)
    undo = _patches.patch_attr(module, "forward", lambda x: x)
    assert "forward" in vars(module)
    undo()
    assert "forward" not in vars(module) and module.forward.__func__ is torch.nn.Linear.forward


def _partial_state_undo() -> dict:
    import hf_helpers as H
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    # Pool workers live on: start from an empty Accelerate state, as a fresh process would.
    AcceleratorState._reset_state(reset_partial_state=True)
    acc = H.sb_accelerator(ParallelDims(dp_shard=4))
    during = PartialState._shared_state["distributed_type"]
    acc.unpatch()
    after = PartialState._shared_state["distributed_type"]
    acc.unpatch()  # idempotent
    # Restored to Accelerate's own choice on CPU (upstream bug 4: DDP), the value before the patch.
    return {"during": during == DistributedType.FSDP, "restored": after == DistributedType.MULTI_CPU}


def test_accelerator_unpatch_restores_partial_state():
    for r in run_distributed(_partial_state_undo, world_size=4, timeout=120):
        assert r == {"during": True, "restored": True}
