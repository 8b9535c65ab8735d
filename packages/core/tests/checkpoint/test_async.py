"""``save(..., async_=True)``: the same bit-exact, reshardable checkpoints as a synchronous save,
written in the background while the model changes; one save in flight; errors surface later.

Oracles: the source model's ``full_tensor()`` at the moment of the save (``full_state``),
torch's ``dcp_to_torch_save`` of the written checkpoint, and a load into another layout.
The crash test (kill -9 mid-flight) is in ``test_faults.py`` (it needs the fault zygote).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist
from ckpt_helpers import LAYOUTS, Mlp, assert_equal_states, build, full_state, step
from shardbridge import checkpoint as ck
from shardbridge._compat import local_tensor
from shardbridge.checkpoint import _async
from shardbridge.checkpoint.state._stage import Stager
from shardbridge.checkpoint.storage import _local
from shardbridge.testing import run_distributed
from test_load import _load, _oracle
from torch.distributed.tensor import DTensor, Replicate


def _save_async_twice(root: str, layout: str):
    """Two async saves, the model changed right after each returns; the states at each save."""
    model, opt = build(LAYOUTS[layout], fused=True)
    wants = []
    for s in (1, 2):
        wants.append(full_state(model, opt))
        pending = ck.save(ck.step_dir(root, s), model=model, optimizer=opt, step=s, async_=True)
        assert isinstance(pending, ck.AsyncSave) and pending.path == ck.step_dir(root, s)
        step(model, opt, seed=100 + s)  # training goes on while the writer runs
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(3.0)  # in place: a snapshot sharing memory with the model would see it
    assert ck.wait() == ck.step_dir(root, 2) and ck.wait() is None
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    return wants if rank0 else None


@pytest.mark.parametrize("layout", ["fsdp2_tp2", "single"])
def test_async_saves_snapshot_the_state_and_reshard_bit_exact(tmp_path, layout):
    """Each async save holds the state at its call (not the later, changed one); the second
    save waited for the first; both read back bit-exact by torch alone and into fsdp4."""
    if LAYOUTS[layout] is None:
        wants = _save_async_twice(str(tmp_path), layout)
    else:
        wants = run_distributed(_save_async_twice, str(tmp_path), layout, world_size=4)[0]
    for s, want in zip((1, 2), wants):
        path = ck.step_dir(tmp_path, s)
        assert ck.verify(path).ok
        oracle = {k: v for k, v in _oracle(path, tmp_path).items()}
        assert_equal_states(oracle, want)
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 2)
    got, lr, _ = run_distributed(_load, str(ck.step_dir(tmp_path, 1)), "fsdp4", True, world_size=4)[0]
    assert_equal_states(got, wants[0])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _blocked_commit(monkeypatch, *, fail: bool = False):
    """Make the writer's commit wait for the returned event (then commit, or raise OSError)."""
    go = threading.Event()
    real = _local.commit

    def commit(*args, **kwargs):
        assert go.wait(300), "the test never let the commit go"  # a loaded machine's stall is not a release
        if fail:
            raise OSError(28, "No space left on device (injected)")
        return real(*args, **kwargs)

    monkeypatch.setattr(_local, "commit", commit)
    return go


def test_if_busy_error_refuses_while_a_save_is_in_flight(tmp_path, monkeypatch):
    model = Mlp()
    go = _blocked_commit(monkeypatch)
    pending = ck.save(tmp_path / "a", model=model, async_=True)
    assert not pending.done() and "in flight" in repr(pending)
    with pytest.raises(RuntimeError, match=r"a save of '.*a' is still in flight and if_busy='error'"):
        ck.save(tmp_path / "b", model=model, if_busy="error")
    assert not (tmp_path / "b").exists()
    go.set()
    assert pending.wait() == tmp_path / "a" and pending.done()
    ck.save(tmp_path / "b", model=model, if_busy="error")  # nothing in flight now
    with pytest.raises(ValueError, match="if_busy='never' must be 'wait'"):
        ck.save(tmp_path / "c", model=model, if_busy="never")
    with pytest.raises(ValueError, match="async_=1 must be True"):
        ck.save(tmp_path / "c", model=model, async_=1)


def test_writer_error_surfaces_at_the_next_save_and_keeps_the_previous(tmp_path, monkeypatch):
    model = Mlp()
    ck.save(ck.step_dir(tmp_path, 1), model=model, step=1)
    go = _blocked_commit(monkeypatch, fail=True)
    ck.save(ck.step_dir(tmp_path, 2), model=model, step=2, async_=True)
    go.set()
    with pytest.raises(OSError, match="No space left on device"):
        ck.save(ck.step_dir(tmp_path, 3), model=model, step=3)  # the previous save's error
    monkeypatch.undo()
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # tmp dir removed
    assert ck.wait() is None  # reported once
    ck.save(ck.step_dir(tmp_path, 3), model=model, step=3, async_=True).wait()
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 3)


def _stage_dtensor():
    model, opt = build(LAYOUTS["fsdp2_tp2"])
    state = {"model": {"w": model.up.weight, "plain": torch.ones(3), "lr": [("x", 0.5)], "in_list": [model.up.weight]}}
    stager = Stager()
    first, _ = stager.stage(state)
    # A list holding a tensor is deep-copied as a whole (DCP plans it item by item only as a DTensor)
    assert first["model"]["lr"] == [("x", 0.5)] and first["model"]["lr"] is not state["model"]["lr"]
    (held,) = first["model"]["in_list"]
    assert isinstance(held, DTensor) and torch.equal(held.to_local(), local_tensor(model.up.weight))
    chunks = first["model"]["w"]
    local = model.up.weight.to_local()
    assert isinstance(model.up.weight, DTensor) and chunks.shape == model.up.weight.shape
    (offsets, copy), *_ = chunks.pieces
    assert torch.equal(copy, local) and copy.data_ptr() != local.data_ptr()
    calls, real = [], DTensor.__create_write_items__

    def counted(self, fqn, obj):
        calls.append(fqn)
        return real(self, fqn, obj)

    DTensor.__create_write_items__ = counted
    try:
        again = stager.stage(state)[0]["model"]["w"].pieces[0][1]
        # The same name in another layout: its own boxes (DCP's for that layout), not the kept ones.
        other = model.up.weight.redistribute(placements=[Replicate()] * model.up.weight.device_mesh.ndim)
        moved = stager.stage({"model": {"w": other}})[0]["model"]["w"]
    finally:
        DTensor.__create_write_items__ = real
    want = [(item.tensor_data.chunk.offsets, other.to_local()) for item in real(other, "model.w", other)]
    assert [o for o, _ in moved.pieces] == [o for o, _ in want] and moved.origin.placements == other.placements
    assert all(torch.equal(t, w) for (_, t), (_, w) in zip(moved.pieces, want, strict=True))
    assert calls == ["model.w"], calls  # DCP's boxes asked once per name and layout, not once per save
    return copy.data_ptr() == again.data_ptr() and stager.nbytes > 0  # buffers reused


def test_stager_copies_dtensor_boxes_and_reuses_its_buffers():
    assert all(run_distributed(_stage_dtensor, world_size=4))


def test_staging_buffers_belong_to_the_model_saved(tmp_path):
    """Each model keeps its own host buffers across saves ([Note: background staging]): another
    model's save in between does not reallocate them, and they are freed with the model."""
    policy, other = Mlp(), torch.nn.Sequential(torch.nn.Linear(4, 3))  # other names: a shared stager drops policy's
    ck.save(tmp_path / "p1", model=policy, step=1, async_=True).wait()
    kept = dict(_async._STAGERS[policy]._buffers)
    ck.save(tmp_path / "o1", model=other, step=1, async_=True).wait()
    ck.save(tmp_path / "p2", model=policy, step=2, async_=True).wait()
    now = _async._STAGERS[policy]._buffers
    assert kept and now.keys() == kept.keys() and all(now[key] is buf for key, buf in kept.items())
    del kept, now
    stager, buffer = weakref.ref(_async._STAGERS[policy]), weakref.ref(next(iter(_async._STAGERS[policy]._buffers.values())))
    assert ck.wait() is None
    del policy
    gc.collect()
    assert stager() is None and buffer() is None and other in _async._STAGERS


def test_bounded_returns_raises_and_times_out():
    from shardbridge.checkpoint._dist import bounded

    assert bounded(lambda: 7, seconds=5, what="x") == 7
    with pytest.raises(KeyError, match="inner"):
        bounded(lambda: {}["inner"], seconds=5, what="x")
    never = threading.Event()
    with pytest.raises(RuntimeError, match=r"making a group did not finish within 0 s .* restart the job"):
        bounded(never.wait, seconds=0.2, what="making a group")
    never.set()  # lets the abandoned daemon thread end


def _hung_writer_group(root: str):
    """gloo's connect never returning (a peer died mid-rendezvous: [Note: a bounded writer group])."""
    from datetime import timedelta

    from shardbridge.checkpoint import _dist

    model, opt = build(LAYOUTS["fsdp2_tp2"])
    ck.save(ck.step_dir(root, 1), model=model, optimizer=opt, step=1)
    never = threading.Event()
    real = (dist.new_group, _dist.group_timeout, _dist._SIDE.copy(), _dist._GROUP_MARGIN_S)
    dist.new_group = lambda *a, **k: never.wait()
    # The bound is the group's timeout plus a margin (10 s); the fake rendezvous never returns, so
    # 1 s + 1 s proves the same (the save fails instead of hanging) without waiting 11 s.
    _dist.group_timeout = lambda group=None: timedelta(seconds=1)
    _dist._GROUP_MARGIN_S = 1.0
    _dist._SIDE.pop("writer", None)
    try:
        errors = []
        for s in (2, 3):
            try:
                ck.save(ck.step_dir(root, s), model=model, optimizer=opt, step=s, async_=True)
            except RuntimeError as exc:
                errors.append(str(exc))
        ck.save(ck.step_dir(root, 4), model=model, optimizer=opt, step=4)  # a synchronous save still works
    finally:
        never.set()
        dist.new_group, _dist.group_timeout = real[:2]
        _dist._SIDE.clear()
        _dist._SIDE.update(real[2])
        _dist._GROUP_MARGIN_S = real[3]
    return errors


def test_a_hung_writer_group_rendezvous_fails_the_save_instead_of_hanging(tmp_path):
    for errors in run_distributed(_hung_writer_group, str(tmp_path), world_size=4):
        assert len(errors) == 2, errors
        assert "creating the checkpoint's writer gloo group" in errors[0] and "did not finish within 2 s" in errors[0]
        assert "cannot make asynchronous saves any more" in errors[1]
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 4)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001", "step-00000004"]  # no tmp dir left


def _writer_group_on_some_ranks(root: str):
    """The writer group made on ranks 0, 2, 3 but failed on rank 1 (its rendezvous timed out there only)."""
    from shardbridge.checkpoint import _dist

    model, opt = build(LAYOUTS["fsdp2_tp2"])
    ck.save(ck.step_dir(root, 1), model=model, optimizer=opt, step=1, async_=True).wait()
    made = _dist._SIDE["writer"]
    if dist.get_rank() == 1:
        _dist._SIDE["writer"] = None
    start = time.monotonic()
    try:
        ck.save(ck.step_dir(root, 2), model=model, optimizer=opt, step=2, async_=True).wait()
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    finally:
        _dist._SIDE["writer"] = made
    return None, time.monotonic() - start


def test_a_writer_group_made_on_some_ranks_only_raises_on_every_rank(tmp_path):
    # Without the argument round's agreement the ranks that have the group start writers that wait
    # in it for the rank that never joins (the pool's group times out at 30 s, a job's at 30 min).
    for error, seconds in run_distributed(_writer_group_on_some_ranks, str(tmp_path), world_size=4):
        assert error is not None and "writer gloo group exists on some ranks only" in error, error
        assert seconds < 25, seconds  # not the pool's 30 s collective timeout
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 1)


def test_extra_is_the_value_of_the_call(tmp_path):
    """``extra`` mutated in place after ``save(async_=True)`` returns: the checkpoint holds the call's."""
    model = Mlp()
    extra = {"a": [1, 2], "sched": {"last_epoch": 1}}
    pending = ck.save(tmp_path / "c", model=model, extra=extra, async_=True)
    extra["a"].append(3)
    extra["sched"]["last_epoch"] = 2
    extra["new"] = True
    pending.wait()
    assert ck.load(tmp_path / "c", model=Mlp()).extra == {"a": [1, 2], "sched": {"last_epoch": 1}}


def test_a_load_waits_for_this_processs_overwrite_in_flight(tmp_path, monkeypatch):
    """load(P) while save(P, overwrite=True, async_=True) is in flight reads the new version whole (it
    waits for the save), never some files of each version."""
    old, new = Mlp(), Mlp()
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1.0)
    ck.save(tmp_path / "c", model=old)
    go = _blocked_commit(monkeypatch)
    pending = ck.save(tmp_path / "c", model=new, overwrite=True, async_=True)
    threading.Timer(0.3, go.set).start()  # the commit proceeds while load waits
    fresh = Mlp()
    ck.load(tmp_path / "c", model=fresh)
    assert pending.done()
    for a, b in zip(fresh.parameters(), new.parameters()):
        assert torch.equal(a, b)


def test_a_directory_replaced_during_a_load_is_refused(tmp_path, monkeypatch):
    """Another job renames a new version into place while this one reads: ValueError, not a mix."""
    from shardbridge.checkpoint.storage import _reader

    ck.save(tmp_path / "c", model=Mlp())
    ck.save(tmp_path / "other", model=Mlp())
    real = _reader.TrustedReader.read_data

    def swap_then_read(self, plan, planner):
        if (tmp_path / "other").exists():
            (tmp_path / "c").rename(tmp_path / "c.old")
            (tmp_path / "other").rename(tmp_path / "c")
        return real(self, plan, planner)

    monkeypatch.setattr(_reader.TrustedReader, "read_data", swap_then_read)
    with pytest.raises(ValueError, match=r"was replaced while it was being loaded .* load it again"):
        ck.load(tmp_path / "c", model=Mlp())
    monkeypatch.undo()
    ck.load(tmp_path / "c", model=Mlp())  # a load that sees one version works


def test_the_previous_saves_error_says_the_next_save_did_not_start(tmp_path, monkeypatch):
    model = Mlp()
    go = _blocked_commit(monkeypatch, fail=True)
    ck.save(ck.step_dir(tmp_path, 1), model=model, step=1, async_=True)
    go.set()
    with pytest.raises(OSError, match="No space left on device") as info:
        ck.save(ck.step_dir(tmp_path, 2), model=model, step=2)
    assert any("that next save did not start" in note for note in info.value.__notes__)
    assert not ck.step_dir(tmp_path, 2).exists()


def _slow_staging(monkeypatch):
    """Hold the writer thread's copies ([Note: background staging]) until the returned event is set."""
    from shardbridge.checkpoint.state import _stage

    go = threading.Event()
    real = _stage.Pending._copy

    def held(self):
        assert go.wait(300), "the test never let the copy go"
        return real(self)

    monkeypatch.setattr(_stage.Pending, "_copy", held)
    return go


def test_optimizer_step_waits_for_the_background_copy(tmp_path, monkeypatch):
    """The optimizer's parameters and state are copied by the writer thread; the next step() waits for
    the copy, so the checkpoint holds the values at the call (bit-exact), not the stepped ones."""
    model, opt = build(LAYOUTS["single"])
    step(model, opt, seed=1)
    want = full_state(model, opt)
    go = _slow_staging(monkeypatch)
    pending = ck.save(tmp_path / "a", model=model, optimizer=opt, step=1, async_=True)
    stepped = threading.Thread(target=lambda: step(model, opt, seed=2))
    stepped.start()
    stepped.join(0.5)
    assert stepped.is_alive()  # held by the hook: the copy has not been made
    go.set()
    stepped.join(30)
    assert pending.wait() == tmp_path / "a" and not stepped.is_alive()
    assert not opt._optimizer_step_pre_hooks and ck.wait() is None  # the hook is gone once waited
    assert_equal_states(_oracle(tmp_path / "a", tmp_path), want)


def test_an_in_place_change_before_the_background_copy_fails_the_save_by_name(tmp_path, monkeypatch):
    model, opt = build(LAYOUTS["single"])
    step(model, opt, seed=1)
    ck.save(ck.step_dir(tmp_path, 1), model=model, optimizer=opt, step=1)
    go = _slow_staging(monkeypatch)
    pending = ck.save(ck.step_dir(tmp_path, 2), model=model, optimizer=opt, step=2, async_=True)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # not through optimizer.step(): nothing waits for the copy
    go.set()
    with pytest.raises(RuntimeError, match=r"model\.up\.weight was changed in place before the asynchronous save"):
        pending.wait()
    assert ck.latest(tmp_path) == ck.step_dir(tmp_path, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
