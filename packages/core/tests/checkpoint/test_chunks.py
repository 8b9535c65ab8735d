"""Tier 1: LocalChunks answers DCP's _Checkpointable protocol; the planners use it in place."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from shardbridge.checkpoint.state._chunks import LoadPlanner, LocalChunks, SavePlanner
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItemType


def test_protocol_describes_each_box():
    local = torch.arange(12.0).reshape(4, 3)
    top, bottom = local[:1], local[1:]
    chunks = LocalChunks((9, 3), [((2, 0), top), ((6, 0), bottom)])
    items = chunks.__create_write_items__("w", chunks)
    assert [tuple(i.index.offset) for i in items] == [(2, 0), (6, 0)]
    assert all(i.type == WriteItemType.SHARD and tuple(i.tensor_data.size) == (9, 3) for i in items)
    assert [tuple(c.sizes) for c in chunks.__create_chunk_list__()] == [(1, 3), (3, 3)]
    shard = chunks.__get_tensor_shard__(MetadataIndex("w", torch.Size([6, 0])))
    assert shard.data_ptr() == bottom.data_ptr()  # a view, not a copy
    with pytest.raises(ValueError, match=r"holds no box at offsets torch.Size\(\[0, 0\]\)"):
        chunks.__get_tensor_shard__(MetadataIndex("w", torch.Size([0, 0])))


def test_empty_boxes_are_dropped_but_empty_tensors_keep_their_key():
    assert LocalChunks((9, 3), [((9, 0), torch.empty(0, 3))]).__create_chunk_list__() == []
    kept = LocalChunks((0, 3), [((0, 0), torch.empty(0, 3))]).__create_chunk_list__()
    assert [tuple(c.sizes) for c in kept] == [(0, 3)]


def _quiet():
    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("ignore")
    return ctx


def test_save_and_load_through_dcp_in_place(tmp_path):
    full = torch.arange(20.0).reshape(5, 4)
    # One "rank" holding rows [3, 5) and [0, 3) in that local order: two boxes.
    local = torch.cat([full[3:], full[:3]])
    state = {"model": {"w": LocalChunks((5, 4), [((3, 0), local[:2]), ((0, 0), local[2:])]), "b": torch.ones(2)}}
    ctx = _quiet()
    try:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp_path / "c"), planner=SavePlanner(), no_dist=True)
        dcp_to_torch_save(tmp_path / "c", tmp_path / "c.pt")
        assert torch.equal(torch.load(tmp_path / "c.pt", weights_only=True)["model"]["w"], full)

        target = torch.zeros(5, 4)
        views = LocalChunks((5, 4), [((0, 0), target[:2]), ((2, 0), target[2:])])
        loaded = {"model": {"w": views, "b": torch.zeros(2)}}
        dcp.load(loaded, storage_reader=dcp.FileSystemReader(tmp_path / "c"), planner=LoadPlanner(), no_dist=True)
    finally:
        ctx.__exit__(None, None, None)
    assert torch.equal(target, full)  # written through the views
    assert loaded["model"]["w"] is views
    assert torch.equal(loaded["model"]["b"], torch.ones(2))
