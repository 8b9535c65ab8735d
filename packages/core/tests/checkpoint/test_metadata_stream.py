"""The streamed ``.metadata`` ([Note: streamed .metadata] in ``storage/_metadata_stream.py``).

The oracle is the standard pickler: the stream must unpickle (plain ``pickle``, and shardbridge's
restricted reader) to exactly the ``Metadata`` whose ``pickle.dumps`` DCP's own writer would write.
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch
from shardbridge._compat import DCPStorageInfo
from shardbridge.checkpoint.storage._metadata_stream import StorageGroup, write_metadata
from shardbridge.checkpoint.storage._trust import MetadataUnpickler
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)


def _random_metadata(seed: int) -> tuple[Metadata, list[str], list[StorageGroup]]:
    g = torch.Generator().manual_seed(seed)

    def rand(hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=g))

    names = [f"__{r}_{f}.distcp" for r in range(rand(5) + 1) for f in range(rand(3) + 1)]
    described, storage, groups = {}, {}, []
    for e in range(rand(6) + 1):
        fqn = f"model.layers.{e}.w\u00e9ight" if e % 3 == 0 else f"optim.state.{e}.exp_avg"
        ndim = rand(4)
        n = rand(5) + 1
        big = e % 2 == 1  # values past 2**31: LONG1 fields
        if ndim == 0:
            n = 1
        offsets = torch.randint(0, 3_000_000_000 if big else 1000, (n, ndim), generator=g)
        if ndim:
            offsets[:, 0] = torch.arange(n) * 7  # distinct boxes
        chunks = [ChunkStorageMetadata(torch.Size(o.tolist()), torch.Size([1] * ndim)) for o in offsets]
        described[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([1] * ndim), chunks)
        name = torch.randint(0, len(names), (n,), generator=g)
        where = torch.randint(0, 1 << 40, (n,), generator=g)
        length = torch.randint(0, 1 << 35, (n,), generator=g)
        for i in range(n):
            key = MetadataIndex(fqn, offsets[i].tolist(), i)
            storage[key] = DCPStorageInfo(names[int(name[i])], int(where[i]), int(length[i]))
        groups.append(StorageGroup(fqn, offsets, torch.arange(n), name, where, length))
    described["optim.param_groups"] = BytesStorageMetadata()
    storage[MetadataIndex("optim.param_groups")] = DCPStorageInfo(names[0], 0, 99)
    groups.append(StorageGroup("optim.param_groups", None, None, torch.tensor([0]), torch.tensor([0]), torch.tensor([99])))
    head = Metadata(described, planner_data={k: tuple(k.split(".")) for k in described},
                    storage_meta=StorageMeta(checkpoint_id="/ckpt/step-1"), version="1.0.0")  # fmt: skip
    return Metadata(**{**head.__dict__, "storage_data": storage}), names, groups


@pytest.mark.parametrize("seed", range(12))
def test_the_stream_unpickles_to_what_dcp_pickles(seed):
    want, names, groups = _random_metadata(seed)
    out = io.BytesIO()
    write_metadata(want, names, groups, out.write)
    data = out.getvalue()
    for got in (pickle.loads(data), MetadataUnpickler(io.BytesIO(data), where="x").load()):
        assert got == want
        # the same state as DCP's objects: every key's __dict__ and every record's pickled state
        for (k1, v1), (k2, v2) in zip(sorted(got.storage_data.items(), key=repr), sorted(want.storage_data.items(), key=repr)):
            assert k1.__dict__ == k2.__dict__ and v1.__getstate__() == v2.__getstate__()
            assert type(k1.offset) is type(k2.offset)


@pytest.mark.parametrize("seed", range(6))
def test_reading_the_stream_builds_what_the_restricted_unpickler_builds(seed):
    from shardbridge.checkpoint.storage._metadata_stream import check_records, read_streamed

    want, names, groups = _random_metadata(seed)
    out = io.BytesIO()
    write_metadata(want, names, groups, out.write)
    data = out.getvalue()
    got = read_streamed(data, lambda head: MetadataUnpickler(io.BytesIO(head), where="x").load(), lambda head: None)
    assert got is not None
    metadata, records = got
    assert metadata == MetadataUnpickler(io.BytesIO(data), where="x").load() == want
    assert all(k.__dict__ == w.__dict__ for k, w in zip(sorted(metadata.storage_data, key=repr), sorted(want.storage_data, key=repr)))
    # the records' check, as tensor operations, judges them as the restricted reader's check does
    from shardbridge.checkpoint.storage._trust import UntrustedCheckpointError, _check_storage

    try:
        _check_storage(metadata, None, "x")
        slow = True
    except UntrustedCheckpointError:
        slow = False
    assert check_records(metadata, records, None) is slow


def _real_checkpoint(root) -> tuple[bytes, object]:
    from shardbridge import checkpoint
    from shardbridge.models import Llama, LlamaConfig

    model = Llama(LlamaConfig.tiny(vocab_size=100), seed=1)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 100, (2, 8))).sum().backward()
    opt.step()
    return checkpoint.save(root / "c", model=model, optimizer=opt, step=1)


def _outcome(path, fast: bool, monkeypatch) -> object:
    from shardbridge.checkpoint.storage import _metadata_stream, _trust

    real = _metadata_stream.read_streamed
    monkeypatch.setattr(_metadata_stream, "read_streamed", real if fast else (lambda *args: None))
    try:
        md = _trust.read_metadata(path)
        return ("ok", sorted((repr(k), repr(v)) for k, v in md.storage_data.items()), md.state_dict_metadata)
    except ValueError as exc:  # UntrustedCheckpointError included
        return (type(exc).__name__, str(exc))
    finally:
        monkeypatch.setattr(_metadata_stream, "read_streamed", real)


def test_a_damaged_stream_is_judged_as_the_restricted_reader_judges_it(tmp_path, monkeypatch):
    # [Note: reading a streamed .metadata]: the fast path changes how long a valid file takes, never
    # what is accepted: every mutation of a real checkpoint's .metadata gets the restricted reader's verdict.
    path = _real_checkpoint(tmp_path)
    meta = path / ".metadata"
    good = meta.read_bytes()
    assert _outcome(path, True, monkeypatch) == _outcome(path, False, monkeypatch) and _outcome(path, True, monkeypatch)[0] == "ok"
    g = torch.Generator().manual_seed(0)
    start = good.find(b"MetadataIndex")  # mutate the definitions and the records
    accepted = 0
    for trial in range(150):
        data = bytearray(good)
        at = start + int(torch.randint(0, len(good) - start, (1,), generator=g))
        data[at] = (data[at] + 1 + int(torch.randint(0, 255, (1,), generator=g))) % 256
        meta.write_bytes(bytes(data))
        fast, slow = _outcome(path, True, monkeypatch), _outcome(path, False, monkeypatch)
        assert fast == slow, (trial, at, fast, slow)
        accepted += fast[0] == "ok"
    assert accepted < 150  # most mutations are refused


# Files a reviewer built to break the fast path (each once accepted, or crashed, where the
# restricted reader refuses): the two readers must now give the same verdict on each.


def _small(chunks_spec=((0, 2), (2, 2)), size=4, entry=None, first_slot=None) -> bytes:
    from shardbridge.checkpoint.storage import _metadata_stream as ms

    chunks = [ChunkStorageMetadata(torch.Size([o]), torch.Size([s])) for o, s in chunks_spec]
    described = {"w": entry or TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([size]), chunks),
                 "b": BytesStorageMetadata()}  # fmt: skip
    head = Metadata(described, planner_data={"w": ("w",), "b": ("b",)}, storage_meta=StorageMeta(checkpoint_id="/x"),
                    version="1.0.0")  # fmt: skip
    n = len(chunks_spec)
    lengths = [max(1, s * 4) + 1000 for _, s in chunks_spec]
    offs = [100 + sum(lengths[:i]) for i in range(n)]
    groups = [
        StorageGroup("w", torch.tensor([[o] for o, _ in chunks_spec]), torch.arange(n), torch.zeros(n, dtype=torch.int64),
                     torch.tensor(offs), torch.tensor(lengths)),  # fmt: skip
        StorageGroup("b", None, None, torch.tensor([0]), torch.tensor([0]), torch.tensor([50])),
    ]
    real = ms._Memo.__init__
    if first_slot is not None:  # the same stream, memo slots numbered from first_slot (a legal pickle)
        ms._Memo.__init__ = lambda self, start: real(self, first_slot)
    try:
        out = io.BytesIO()
        write_metadata(head, ["__0_0.distcp"], groups, out.write)
    finally:
        ms._Memo.__init__ = real
    return out.getvalue()


def _split(data: bytes, insert: bytes) -> bytes:
    from shardbridge.checkpoint.storage._metadata_stream import _DEFINITIONS_START

    at = data.find(_DEFINITIONS_START)
    return data[:at] + insert + data[at:]


_PROPS = TensorProperties(dtype=torch.float32)
_OK_CHUNK = ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))
_HOSTILE = {
    "a BINPUT straddling the records' start": lambda: _split(_small(), b"uq"),
    "records landing in planner_data": lambda: _split(_small(), b"X" + (12).to_bytes(4, "little") + b"planner_data}"),
    "memo slots from 1e9": lambda: _small(first_slot=10**9),
    "two empty chunks at one offset": lambda: _small(chunks_spec=((0, 4), (4, 0), (4, 0))),
    "a size that is an int": lambda: _small(entry=TensorStorageMetadata(_PROPS, 5, [_OK_CHUNK]), chunks_spec=((0, 4),)),
    "a chunk that is an int": lambda: _small(entry=TensorStorageMetadata(_PROPS, torch.Size([4]), [7]), chunks_spec=((0, 4),)),
    "chunks that are an int": lambda: _small(entry=TensorStorageMetadata(_PROPS, torch.Size([4]), 3), chunks_spec=((0, 4),)),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_hostile_streams_get_the_restricted_readers_verdict(tmp_path, monkeypatch, case):
    data = _HOSTILE[case]()
    (tmp_path / ".metadata").write_bytes(data)
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 10000)
    fast, slow = _outcome(tmp_path, True, monkeypatch), _outcome(tmp_path, False, monkeypatch)
    assert fast == slow
    assert fast[0] != "ok" or case == "memo slots from 1e9"  # a legal pickle: accepted by both, read right
