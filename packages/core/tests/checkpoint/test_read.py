"""[Note: reading boxes in place]: stored boxes read straight into the full tensor.

Oracle: torch's own ``dcp_to_torch_save`` of the same checkpoint.
"""

from __future__ import annotations

import io

import pytest
import torch
from ckpt_helpers import LAYOUTS, build
from shardbridge import checkpoint as ck
from shardbridge.checkpoint import _export
from shardbridge.checkpoint.storage import _read
from shardbridge.checkpoint.storage._read import read_box_into
from shardbridge.checkpoint.storage._reader import TrustedReader
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _save(path: str) -> None:
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    ck.save(path, model=model, optimizer=opt)


def test_every_box_of_a_4_rank_checkpoint_is_read_in_place(tmp_path, monkeypatch):
    """Shard(0) boxes (contiguous in the target) and Shard(1) boxes (rowwise ``down``: strided
    in the target, read through the bounded buffer), fused components, optimizer states; then
    through DCP's reader box by box (threshold above every box), the same values."""
    path = tmp_path / "c"
    run_distributed(_save, str(path), world_size=4)
    dcp_to_torch_save(path, tmp_path / "oracle.pt")
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)
    flat = {f"model.{k}": v for k, v in oracle["model"].items()}
    flat.update({f"optim.{k}": v for k, v in oracle["optim"].items() if k.startswith("state.")})
    calls: list[tuple[bool, bool]] = []

    def spy(file, offset, length, target):
        ok = read_box_into(file, offset, length, target)
        calls.append((ok, target.is_contiguous()))
        return ok

    monkeypatch.setattr(_export, "read_box_into", spy)
    reader = TrustedReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    for key, want in flat.items():
        got = _export.read_tensor(reader, metadata, key)
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert calls and all(ok for ok, _ in calls)
    assert any(not contiguous for _, contiguous in calls)  # the strided path ran
    monkeypatch.undo()
    monkeypatch.setattr(_export, "EXPORT_IN_PLACE_MIN_BYTES", 1 << 40)  # DCP's reader for every box
    for key, want in flat.items():
        assert torch.equal(_export.read_tensor(reader, metadata, key), want), key


def test_unusual_records_are_left_to_dcps_reader(tmp_path):
    """A transposed (non-contiguous) record, a view of a larger storage: False, target untouched."""
    file = tmp_path / "records"
    records = []
    with open(file, "wb") as f:
        for tensor in (torch.arange(12.0).reshape(3, 4).t(), torch.arange(12.0)[2:8], torch.arange(6.0)):
            buffer = io.BytesIO()
            torch.save(tensor, buffer)
            records.append((f.tell(), len(buffer.getvalue()), tensor))
            f.write(buffer.getvalue())
    for offset, length, tensor in records[:2]:
        target = torch.full(tensor.shape, -1.0)
        assert not read_box_into(file, offset, length, target)
        assert (target == -1).all()
    offset, length, tensor = records[2]
    target = torch.zeros(6)
    assert read_box_into(file, offset, length, target) and torch.equal(target, tensor)
    assert not read_box_into(file, offset, length, torch.zeros(5))  # a shape that does not fit
    assert not read_box_into(file, offset, length, torch.empty(6, device="meta"))  # not host memory (CUDA)
    assert not read_box_into(file, offset, length - 30, torch.zeros(6))  # truncated record


def test_parts_of_boxes_are_read_in_place_exactly():
    """``box_offsets``: any sub-box of a stored box (narrowed in the first, inner or every dim;
    1-d, 0-d; into a contiguous or strided target) equals slicing the saved tensor; a part that
    does not fit is refused, the target untouched."""
    import tempfile
    from pathlib import Path

    saved = {
        "3d": torch.arange(5 * 6 * 7, dtype=torch.float32).reshape(5, 6, 7),
        "1d": torch.arange(11, dtype=torch.int64),
        "0d": torch.tensor(3.5, dtype=torch.bfloat16),
    }
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "records"
        where = {}
        with open(file, "wb") as f:
            for name, tensor in saved.items():
                buffer = io.BytesIO()
                torch.save(tensor, buffer)
                where[name] = (f.tell(), len(buffer.getvalue()))
                f.write(buffer.getvalue())
        cases = [
            ("3d", (1, 0, 0), (3, 6, 7)),  # rows only: one contiguous range
            ("3d", (0, 2, 0), (5, 3, 7)),  # an inner dim
            ("3d", (2, 1, 3), (2, 4, 4)),  # every dim
            ("3d", (0, 0, 0), (5, 6, 7)),  # the whole box
            ("1d", (4,), (5,)),
            ("0d", (), ()),
        ]
        for name, offsets, lengths in cases:
            want = saved[name][tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
            for strided in (False, True):
                target = torch.full(lengths, -1, dtype=want.dtype)
                if strided and target.dim() >= 2:
                    target = (
                        torch.full(lengths[::-1], -1, dtype=want.dtype).t()
                        if target.dim() == 2
                        else (torch.full((lengths[0], lengths[2], lengths[1]), -1, dtype=want.dtype).transpose(1, 2))
                    )
                assert read_box_into(file, *where[name], target, offsets), (name, offsets, strided)
                assert torch.equal(target, want), (name, offsets, strided)
        target = torch.full((3, 6, 7), -1.0)
        assert not read_box_into(file, *where["3d"], target, (3, 0, 0))  # rows 3..5 of 5
        assert (target == -1).all()
        # Whole rows into a column slice of a wider row-major tensor (a TP box into a dp-sharded
        # parameter), over more rows than one buffer holds when the buffer is small.
        tall = torch.arange(1100 * 3, dtype=torch.float32).reshape(1100, 3)
        with open(file, "ab") as f:
            buffer = io.BytesIO()
            torch.save(tall, buffer)
            tall_at = (f.tell(), len(buffer.getvalue()))
            f.write(buffer.getvalue())
        for first, count in ((0, 1100), (5, 1045)):
            dest = torch.full((count, 8), -1.0)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(_read, "_BUFFER_BYTES", 4096)  # 341 rows at a time
                assert read_box_into(file, *tall_at, dest[:, 2:5], (first, 0))
            assert torch.equal(dest[:, 2:5], tall[first : first + count]), (first, count)
            assert (dest[:, :2] == -1).all() and (dest[:, 5:] == -1).all()  # nothing outside the slice


def _reshard_in_place(path: str):
    from ckpt_helpers import full_state
    from shardbridge.checkpoint.storage import _read

    calls = []
    real = _read.read_box_into
    _read.read_box_into = lambda *a: calls.append(real(*a)) or calls[-1]
    try:
        model, opt = build(LAYOUTS["fsdp4"], fused=True, seed=7, lr=0.5)
        ck.load(path, model=model, optimizer=opt, rng=False)
    finally:
        _read.read_box_into = real
    state = full_state(model, opt)
    return (state, calls) if torch.distributed.get_rank() == 0 else (None, calls)


def test_a_load_into_another_layout_reads_the_parts_of_boxes_in_place(tmp_path):
    """Saved at dp_shard=2 x tp=2, loaded at dp_shard=4: every item is a part of a stored box,
    read in place (no DCP torch.load); values equal torch's ``dcp_to_torch_save``."""
    from test_load import _oracle

    path = tmp_path / "c"
    run_distributed(_save, str(path), world_size=4)
    oracle = _oracle(path, tmp_path)
    results = run_distributed(_reshard_in_place, str(path), world_size=4)
    state = results[0][0]
    assert state.keys() == oracle.keys()
    for key, want in oracle.items():
        assert torch.equal(state[key], want), key
    for _, calls in results:
        assert calls and all(calls)


def test_load_reads_whole_boxes_in_place(tmp_path, monkeypatch):
    """``load`` into the same layout: every tensor item is read in place (no torch.load copy)."""
    from ckpt_helpers import Mlp, assert_equal_states, full_state
    from shardbridge.checkpoint.storage import _read

    model, opt = build(None)
    ck.save(tmp_path / "c", model=model, optimizer=opt)
    calls = []
    real = _read.read_box_into
    monkeypatch.setattr(_read, "read_box_into", lambda *a: calls.append(real(*a)) or calls[-1])
    fresh = Mlp()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    ck.load(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert_equal_states(full_state(fresh, fresh_opt), full_state(model, opt))
    tensors = len(full_state(model, opt))
    assert len(calls) == tensors and all(calls)
