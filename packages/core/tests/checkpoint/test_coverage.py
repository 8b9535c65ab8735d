"""Exact chunk coverage of ``.metadata`` (storage/_coverage.py, [Note: exact chunk coverage]).

Generated, not listed: for every placement kind the layout algebra knows (Shard on each dim,
_StridedShard, Replicate duplicates, uneven and empty shards, FSDP2 x TP / HSDP as fully_shard
lays them out) the true chunk set is built from :mod:`shardbridge.layout`, written as a
``.metadata`` and read back; then one chunk is mutated (shifted, shrunk, grown, duplicated,
dropped). The oracle is a dense count of how often each element is held. Originals pass,
every mutant the oracle calls inexact is refused naming the tensor and the file.
``SHARDBRIDGE_TRUST=all`` (``nox -s trust``) runs 20x the examples.
"""

from __future__ import annotations

import itertools
import math
import os
import pickle
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from shardbridge.checkpoint.storage._coverage import coverage_fault
from shardbridge.checkpoint.storage._trust import UntrustedCheckpointError, read_metadata
from shardbridge.layout import fsdp_chunk, fsdp_placements, local_chunk
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

FULL = os.environ.get("SHARDBRIDGE_TRUST") == "all"
SETTINGS = settings(
    max_examples=1000 if FULL else 15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
KEY = "model.layers.0.mlp.up_proj.weight"


# --------------------------------------------------------------------------- oracle and files


def _dense_exact(size, boxes) -> bool:
    """The oracle: every element of ``size`` held exactly once (boxes outside: not exact)."""
    count = torch.zeros(size, dtype=torch.int32)
    for offsets, sizes in boxes:
        if any(o < 0 or o + s > g for o, s, g in zip(offsets, sizes, size)):
            return False
        count[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] += 1
    return bool((count == 1).all())


def _write(tmp_path, size, boxes):
    """A .metadata describing one float32 tensor as ``boxes``, each with its own storage record."""
    chunks, storage, pos = [], {}, 0
    for offsets, sizes in boxes:
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
        length = 4 * math.prod(sizes)
        storage[MetadataIndex(KEY, torch.Size(offsets), len(chunks) - 1)] = _StorageInfo("__0_0.distcp", pos, length)
        pos += length
    md = Metadata(
        state_dict_metadata={
            KEY: TensorStorageMetadata(properties=TensorProperties(dtype=torch.float32), size=torch.Size(size), chunks=chunks)
        },
        storage_data=storage,
    )
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    return tmp_path


def _boxes(size, mesh, placements, chunk_of) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Every box the mesh holds, as DCP dedups them (Replicate copies written once)."""
    boxes = set()
    for coord in itertools.product(*(range(m) for m in mesh)):
        chunk = chunk_of(size, mesh, placements, coord)
        for parts in itertools.product(*chunk):  # a strided chunk is several boxes
            boxes.add((tuple(p[0] for p in parts), tuple(p[1] - p[0] for p in parts)))
    return sorted(boxes)


def _mutants(size, boxes):
    """One-chunk edits: shift by +-1 (same volume: the old volume sum passes), shrink, grow, duplicate, drop.

    Every chunk with ``SHARDBRIDGE_TRUST=all``; else the first, a middle and the last one.
    """
    picked = range(len(boxes)) if FULL else sorted({0, len(boxes) // 2, len(boxes) - 1} & set(range(len(boxes))))
    for i in picked:
        offsets, sizes = boxes[i]
        rest = boxes[:i] + boxes[i + 1 :]
        for d in range(len(size)):
            for step in (-1, 1):
                moved = tuple(o + step if k == d else o for k, o in enumerate(offsets))
                if all(o >= 0 and o + s <= g for o, s, g in zip(moved, sizes, size)):
                    yield f"shift chunk {i} dim {d} by {step}", rest + [(moved, sizes)]
            if sizes[d] > 0:
                yield f"shrink chunk {i} dim {d}", rest + [(offsets, tuple(s - (k == d) for k, s in enumerate(sizes)))]
            if offsets[d] + sizes[d] < size[d]:
                yield f"grow chunk {i} dim {d}", rest + [(offsets, tuple(s + (k == d) for k, s in enumerate(sizes)))]
        if math.prod(sizes):
            yield f"drop chunk {i}", rest
            yield f"duplicate chunk {i}", boxes + [(offsets, sizes)]


def _check_all(tmp_path, size, boxes):
    assert _dense_exact(size, boxes), "the layout algebra's chunk set must cover the tensor"
    read_metadata(_write(tmp_path / "original", size, boxes), data_files=False)
    refused = 0
    for n, (what, mutant) in enumerate(_mutants(size, boxes)):
        path = _write(tmp_path / f"m{n}", size, mutant)
        if _dense_exact(size, mutant):
            read_metadata(path, data_files=False)  # e.g. a shift of an empty chunk
            continue
        with pytest.raises(UntrustedCheckpointError, match=re.escape(KEY)) as err:
            read_metadata(path, data_files=False)
        assert str(path / ".metadata") in str(err.value), what
        refused += 1
    return refused


# --------------------------------------------------------------------------- generators

_PLACEMENT = st.one_of(
    st.just(Replicate()),
    st.builds(Shard, st.integers(0, 2)),
    st.builds(lambda d, sf: _StridedShard(d, split_factor=sf), st.integers(0, 2), st.integers(2, 3)),
)


@st.composite
def _dtensor_layouts(draw):
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.lists(st.integers(0, 7), min_size=ndim, max_size=ndim)))
    mesh = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=3)))
    placements = [p for p in draw(st.lists(_PLACEMENT, min_size=len(mesh), max_size=len(mesh)))]
    placements = [p if isinstance(p, Replicate) or p.dim < ndim else Shard(ndim - 1) for p in placements]
    return size, mesh, placements


@st.composite
def _fsdp_layouts(draw):
    size = tuple(draw(st.lists(st.integers(1, 11), min_size=2, max_size=2)))
    tp_dim = draw(st.sampled_from([None, 0, 1]))
    tp, dp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    hsdp = draw(st.booleans())
    mesh = ((2,) if hsdp else ()) + (dp, tp)
    return size, mesh, fsdp_placements(tp_dim=tp_dim, tp_size=tp, dp_replicate=hsdp)


@SETTINGS
@given(_dtensor_layouts())
def test_every_dtensor_layout_passes_and_every_mutant_is_refused(tmp_path_factory, layout):
    size, mesh, placements = layout
    _check_all(tmp_path_factory.mktemp("md"), size, _boxes(size, mesh, placements, local_chunk))


@SETTINGS
@given(_fsdp_layouts())
def test_every_fsdp_tp_layout_passes_and_every_mutant_is_refused(tmp_path_factory, layout):
    size, mesh, placements = layout
    _check_all(tmp_path_factory.mktemp("md"), size, _boxes(size, mesh, placements, fsdp_chunk))


def test_overlap_with_equal_volume_is_refused(tmp_path):
    """The case the old volume sum passed: rows [0, 5) and [4, 8) of a (9, 4) tensor hold 36
    elements, as many as the tensor, but row 4 twice and row 8 never."""
    size = (9, 4)
    boxes = [((0, 0), (5, 4)), ((4, 0), (4, 4))]  # rows 0-4 and 4-7: 36 elements, row 4 twice, row 8 never
    assert sum(math.prod(s) for _, s in boxes) == math.prod(size)
    with pytest.raises(UntrustedCheckpointError, match=r"\(size \(9, 4\)\) chunks that overlap \(2 chunks hold element \(4, 0\)\)"):
        read_metadata(_write(tmp_path, size, boxes), data_files=False)


@settings(max_examples=3000 if FULL else 60, deadline=None)
@given(
    st.lists(st.integers(1, 4), min_size=1, max_size=3).flatmap(
        lambda size: st.tuples(
            st.just(tuple(size)),
            st.lists(
                st.tuples(*(st.integers(0, g - 1) for g in size)).flatmap(
                    lambda o, size=size: st.tuples(
                        st.just(o), st.tuples(*(st.integers(1, g - x) for g, x in zip(size, o)))
                    )
                ),
                max_size=8,
            ),
        )
    )
)
def test_coverage_agrees_with_the_dense_count(case):
    """Random in-bounds boxes: the sweep says exact iff every element is held once."""
    size, boxes = case
    assert (coverage_fault(size, boxes) is None) == _dense_exact(size, boxes)


def test_load_and_export_refuse_an_equal_volume_overlap(tmp_path):
    """A real checkpoint with ``model.up.weight`` (9 rows) stored as rows [0, 5) and [4, 8), true
    values, resealed. Before: load left row 8 as it was and export wrote it as zeros."""
    from ckpt_helpers import Mlp
    from shardbridge import checkpoint as ck
    from shardbridge.testing._hostile import overlap_chunks

    torch.manual_seed(0)
    path = ck.save(tmp_path / "c", model=Mlp())
    overlap_chunks(path, "model.up.weight")
    refused = r"'model\.up\.weight' \(size \(9, 6\)\) chunks that overlap \(2 chunks hold element \(4, 0\)\)"
    torch.manual_seed(1)
    model = Mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UntrustedCheckpointError, match=refused):
        ck.load(path, model=model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # nothing written
    with pytest.raises(UntrustedCheckpointError, match=refused):
        ck.export_safetensors(path, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
