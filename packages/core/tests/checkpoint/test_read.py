"""[Note: reading boxes in place]: stored boxes read straight into the full tensor.

Oracle: torch's own ``dcp_to_torch_save`` of the same checkpoint.
"""

from __future__ import annotations

import io

import torch
from ckpt_helpers import LAYOUTS, build
from shardbridge import checkpoint as ck
from shardbridge.checkpoint import _export
from shardbridge.checkpoint._read import read_box_into
from shardbridge.checkpoint._trust import TrustedReader
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _save(path: str) -> None:
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    ck.save(path, model=model, optimizer=opt)


def test_every_box_of_a_4_rank_checkpoint_is_read_in_place(tmp_path, monkeypatch):
    """Shard(0) boxes (contiguous in the target) and Shard(1) boxes (rowwise ``down``: strided
    in the target, read through the bounded buffer), fused components, optimizer states; then
    with the default threshold (these boxes all below it: DCP's reader box by box)."""
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
    monkeypatch.setattr(_export, "EXPORT_IN_PLACE_MIN_BYTES", 0)  # these boxes are tiny
    reader = TrustedReader(path)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    for key, want in flat.items():
        got = _export.read_tensor(reader, metadata, key)
        assert got.dtype == want.dtype and torch.equal(got, want), key
    assert calls and all(ok for ok, _ in calls)
    assert any(not contiguous for _, contiguous in calls)  # the strided path ran
    monkeypatch.undo()
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
    assert not read_box_into(file, offset, length - 30, torch.zeros(6))  # truncated record


def test_load_reads_whole_boxes_in_place(tmp_path, monkeypatch):
    """``load`` into the same layout: every tensor item is read in place (no torch.load copy);
    with the default threshold these small boxes all go through DCP's reader (the other tests)."""
    from ckpt_helpers import Mlp, assert_equal_states, full_state
    from shardbridge.checkpoint import _read

    model, opt = build(None)
    ck.save(tmp_path / "c", model=model, optimizer=opt)
    calls = []
    real = _read.read_box_into
    monkeypatch.setattr(_read, "read_box_into", lambda *a: calls.append(real(*a)) or calls[-1])
    monkeypatch.setattr(_read, "IN_PLACE_MIN_BYTES", 0)  # these boxes are tiny
    fresh = Mlp()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    ck.load(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert_equal_states(full_state(fresh, fresh_opt), full_state(model, opt))
    tensors = len(full_state(model, opt))
    assert len(calls) == tensors and all(calls)
