"""[Note: reading records in one pass] and [Note: verifying while reading].

Oracles: the tensors as saved (slicing them), torch's own ``dcp_to_torch_save`` of a checkpoint,
``xxhash`` of the file's bytes, the source model's ``full_tensor()``.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil

import pytest
import torch
import xxhash
from ckpt_helpers import LAYOUTS, Mlp, assert_equal_states, build, full_state
from shardbridge import checkpoint as ck
from shardbridge._compat import torch_save_without_crc
from shardbridge.checkpoint import _export
from shardbridge.checkpoint.storage import _read
from shardbridge.checkpoint.storage._read import Record, read_box_into
from shardbridge.checkpoint.storage._reader import TrustedReader
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _save(path: str) -> None:
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    ck.save(path, model=model, optimizer=opt)


def test_every_box_of_a_4_rank_checkpoint_is_read_in_place(tmp_path, monkeypatch):
    """Export's reads: Shard(0) boxes (contiguous in the target) and Shard(1) boxes (rowwise
    ``down``: strided in the target, read through the bounded buffer), fused components, optimizer
    states; then through the reader's ``read_data`` box by box, the same values."""
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
    monkeypatch.setattr(_export, "EXPORT_IN_PLACE_MIN_BYTES", 1 << 40)  # the reader's read_data for every box
    for key, want in flat.items():
        assert torch.equal(_export.read_tensor(reader, metadata, key), want), key


def _records(tensors: list[tuple[torch.Tensor, bool]]) -> tuple[bytes, list[tuple[int, int, torch.Tensor]]]:
    """One file of ``torch.save`` records (``True``: CRC32 left at 0, as shardbridge writes them)."""
    buffer, where = io.BytesIO(), []
    for tensor, ours in tensors:
        start = buffer.tell()
        (torch_save_without_crc if ours else torch.save)(tensor, buffer)
        where.append((start, buffer.tell() - start, tensor))
    return buffer.getvalue(), where


class _Object:
    """An object read by ranged streams, counting the requests and the bytes they fetch."""

    def __init__(self, data: bytes) -> None:
        self.data, self.requests, self.fetched = data, 0, 0

    @contextlib.contextmanager
    def stream(self, start: int, end: int):
        self.requests += 1
        outer = self

        class Body:
            pos = start

            def readinto(self, out):
                n = min(len(out), end - self.pos)
                out[:n] = outer.data[self.pos : self.pos + n]
                self.pos += n
                outer.fetched += n
                return n

        yield Body()

    def reread(self, offset: int, length: int) -> bytes:
        self.requests += 1
        return self.data[offset : offset + length]


def test_records_that_are_not_the_template_are_torch_loaded_and_land_exactly(tmp_path):
    """A transposed record, a view of a larger storage, a record with its CRC32 written: each is not
    the template of its shape, so it is read whole and ``torch.load``-ed (weights_only); the values
    land exactly. A part outside the box, a truncated record: False."""
    transposed = torch.arange(12.0).reshape(3, 4).t()
    data, where = _records([(transposed, True), (torch.arange(12.0)[2:8], True), (torch.arange(6.0), False),
                            (torch.arange(6.0), True)])  # fmt: skip
    file = tmp_path / "records"
    file.write_bytes(data)
    for offset, length, tensor in where:
        target = torch.full(tensor.shape, -1.0)
        assert read_box_into(file, offset, length, target) and torch.equal(target, tensor)
    offset, length, tensor = where[3]
    assert not read_box_into(file, offset, length, torch.zeros(7))  # a shape that is not the box's
    assert not read_box_into(file, offset, length, torch.zeros(6), (1,))  # rows 1..7 of 6
    assert not read_box_into(file, offset, length - 30, torch.zeros(6))  # truncated record
    # the template path took the last one, no torch.load: its head is torch's own
    template = _read._template((6,), torch.float32)
    assert data[offset : offset + len(template.head)] == template.head


def test_parts_of_boxes_land_exactly_in_any_target():
    """Any sub-box of a stored box (narrowed in the first, inner or every dim; 1-d, 0-d), into
    contiguous, strided, other-dtype targets, several targets of one record, through a small
    buffer; records written as shardbridge writes them (template) and with their CRC32 (torch.load)."""
    saved = {
        "3d": torch.arange(5 * 6 * 7, dtype=torch.float32).reshape(5, 6, 7),
        "1d": torch.arange(11, dtype=torch.int64),
        "0d": torch.tensor(3.5, dtype=torch.bfloat16),
        "tall": torch.arange(1100 * 3, dtype=torch.float32).reshape(1100, 3),
    }
    cases = [
        ("3d", [((1, 0, 0), (3, 6, 7))]),  # rows only
        ("3d", [((0, 2, 0), (5, 3, 7))]),  # an inner dim
        ("3d", [((2, 1, 3), (2, 4, 4)), ((0, 0, 0), (2, 6, 7)), ((4, 5, 6), (1, 1, 1))]),  # several targets
        ("3d", [((0, 0, 0), (5, 6, 7))]),  # the whole box
        ("1d", [((4,), (5,))]),
        ("0d", [((), ())]),
        ("tall", [((5, 0), (1045, 3)), ((0, 1), (5, 2))]),  # more rows than the small buffer holds
    ]
    for ours in (True, False):
        data, where = _records([(t, ours) for t in saved.values()])
        at = dict(zip(saved, where))
        for name, parts in cases:
            offset, length, tensor = at[name]
            for how in ("contiguous", "strided", "double"):
                record = Record(offset, length, sizes=tuple(tensor.shape), dtype=tensor.dtype)
                expected = []
                for starts, lengths in parts:
                    want = tensor[tuple(slice(o, o + n) for o, n in zip(starts, lengths))]
                    target = torch.full(lengths, -1, dtype=torch.float64 if how == "double" else want.dtype)
                    if how == "strided" and target.dim() >= 2:  # a column slice of a wider tensor
                        target = torch.full((*lengths[:-1], lengths[-1] + 3), -1, dtype=want.dtype)[..., 1:-2]
                    record.wants.append((target, starts))
                    expected.append((target, want))
                obj = _Object(data)
                with pytest.MonkeyPatch.context() as mp:
                    mp.setattr(_read, "_BUFFER_BYTES", 4096)  # 341 rows of "tall" at a time
                    with obj.stream(offset, offset + length) as raw:
                        _read.read_records(_read.Stream(raw, offset, offset + length), [record])
                for target, want in expected:
                    assert torch.equal(target, want.to(target.dtype)), (name, parts, how, ours)


def test_a_plan_fetches_the_wanted_bytes_in_as_few_requests_as_pay():
    """Random records and random parts of them, read through planned ranges: exact values; one
    request per range, none for a gap under ``gap`` bytes; fewer bytes than the whole records
    where a large part is not wanted; and a stream over the whole file hashes it exactly."""
    rng = random.Random(0)
    torch.manual_seed(0)
    shapes = [(64, 33), (5,), (), (128, 7, 3), (4000, 16)]
    data, where = _records([(torch.randn(rng.choice(shapes)), i % 7 != 3) for i in range(40)])
    for trial in range(60):
        chosen = sorted(rng.sample(range(len(where)), rng.randint(1, 12)))
        records, expected = [], []
        for i in chosen:
            offset, length, tensor = where[i]
            record = Record(offset, length, sizes=tuple(tensor.shape), dtype=tensor.dtype)
            starts, want = (0,) * tensor.dim(), tensor
            if tensor.dim() and rng.random() < 0.7:
                a = rng.randrange(tensor.shape[0])
                b = rng.randrange(a + 1, tensor.shape[0] + 1)
                starts, want = (a,) + starts[1:], tensor[a:b]
            target = torch.full_like(want, -1)
            record.wants.append((target, starts))
            records.append(record)
            expected.append((target, want))
        gap = rng.choice([0, 1000, 1 << 30])
        obj = _Object(data)
        ranges = _read.plan_ranges(records, gap)
        assert all(b2 - e1 > gap for (_, e1), (b2, _) in zip(ranges, ranges[1:])), (ranges, gap)
        with _read.Ranges(obj.stream, ranges) as raw:
            stream = _read.Stream(raw, records[0].offset, records[-1].offset + records[-1].length, seek=True)
            assert _read.read_records(stream, records, reread=obj.reread) == []
        for target, want in expected:
            assert torch.equal(target, want), trial
        assert obj.requests <= len(ranges) + sum(1 for r in records if r.offset in {w[0] for w in where[3::7]})
        if gap == 1 << 30:
            assert len(ranges) == 1
        whole = sum(r.length for r in records)
        assert obj.fetched <= ranges[-1][1] - ranges[0][0]
        if gap == 0:
            assert obj.fetched <= whole
    # the hashing pass: every byte of the file, in order
    digest = xxhash.xxh3_128()
    obj = _Object(data)
    records = [Record(o, n, sizes=tuple(t.shape), dtype=t.dtype, wants=[(torch.empty_like(t), (0,) * t.dim())])
               for o, n, t in where]  # fmt: skip
    with obj.stream(0, len(data)) as raw:
        stream = _read.Stream(raw, 0, len(data), digest=digest)
        _read.read_records(stream, records)
        stream.skip(len(data) - stream.pos)
    assert digest.hexdigest() == xxhash.xxh3_128(data).hexdigest() and obj.requests == 1
    assert all(torch.equal(r.wants[0][0], t) for r, (_, _, t) in zip(records, where))


def _reshard(path: str):
    """Load into FSDP 4, counting the streams each file was opened with and the records torch.load-ed."""
    from ckpt_helpers import full_state
    from shardbridge.checkpoint.storage._local import LocalBackend

    opened, loaded = [], []
    real_stream, real_whole = LocalBackend.stream, _read._whole
    LocalBackend.stream = lambda self, p, a, b: opened.append(p.rsplit("/", 1)[-1]) or real_stream(self, p, a, b)
    _read._whole = lambda data, record: loaded.append(record.whole is None) or real_whole(data, record)
    try:
        model, opt = build(LAYOUTS["fsdp4"], fused=True, seed=7, lr=0.5)
        ck.load(path, model=model, optimizer=opt, rng=False)
    finally:
        LocalBackend.stream, _read._whole = real_stream, real_whole
    state = full_state(model, opt)
    return (state if torch.distributed.get_rank() == 0 else None), opened, loaded


def test_a_load_into_another_layout_opens_each_file_once(tmp_path):
    """Saved at dp_shard=2 x tp=2, loaded at dp_shard=4: each rank opens each file it reads once
    (its own hashed whole, the parts it needs of the others), no tensor record is torch.load-ed
    (each is the template), and the values are torch's ``dcp_to_torch_save``'s."""
    from test_load import _oracle

    path = tmp_path / "c"
    run_distributed(_save, str(path), world_size=4)
    oracle = _oracle(path, tmp_path)
    results = run_distributed(_reshard, str(path), world_size=4)
    assert_equal_states(results[0][0], oracle)
    for rank, (_, opened, loaded) in enumerate(results):
        assert len(opened) == len(set(opened)) and f"__{rank}_0.distcp" in opened, (rank, opened)
        assert not any(loaded), (rank, loaded)


def test_a_one_process_load_is_one_stream_per_file(tmp_path, monkeypatch):
    """One process hashes every file: one stream each, the data file's records filled on the way."""
    from shardbridge.checkpoint.storage._local import LocalBackend

    model, opt = build(None)
    ck.save(tmp_path / "c", model=model, optimizer=opt)
    opened = []
    real = LocalBackend.stream
    monkeypatch.setattr(LocalBackend, "stream", lambda self, p, a, b: opened.append(p) or real(self, p, a, b))
    fresh = Mlp()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    ck.load(tmp_path / "c", model=fresh, optimizer=fresh_opt)
    assert_equal_states(full_state(fresh, fresh_opt), full_state(model, opt))
    files = sorted(p.relative_to(tmp_path / "c").as_posix() for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert sorted(os.path.relpath(p, tmp_path / "c") for p in opened) == [f for f in files if f != "shardbridge.json"]


# -- a damaged byte is refused before the model sees it ----------------------------------------


def _save_steps(root: str):
    for step, seed in ((1, 0), (2, 3)):
        model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True, seed=seed)
        ck.save(ck.step_dir(root, step), model=model, optimizer=opt, step=step)
        state = full_state(model, opt)
        if step == 1:
            first = state
    return first if torch.distributed.get_rank() == 0 else None


def _load_damaged(root: str):
    from shardbridge.checkpoint import _load

    finished: list[int] = []
    real = _load._finish
    _load._finish = lambda *args, **kwargs: finished.append(1) or real(*args, **kwargs)
    try:
        model, opt = build(LAYOUTS["fsdp4"], fused=True, seed=7, lr=0.5)
        try:
            ck.load(ck.step_dir(root, 2), model=model, optimizer=opt, rng=False)
            error = None
        except ValueError as exc:
            error = str(exc)
        handed = len(finished)
        state = ck.load_latest(root, model=model, optimizer=opt, rng=False)
    finally:
        _load._finish = real
    got = full_state(model, opt)
    return error, handed, state.step, got if torch.distributed.get_rank() == 0 else None


@pytest.fixture(scope="module")
def two_saves(tmp_path_factory):
    root = tmp_path_factory.mktemp("damage") / "ckpt"
    first = run_distributed(_save_steps, str(root), world_size=4)[0]
    return root, first


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_damaged_byte_is_refused_before_the_model_sees_it(tmp_path, two_saves, where):
    """One byte of rank 1's data file flipped, in a record's tensor bytes or in its zip header (which
    then does not parse on the ranks that read it without hashing it), loaded into another layout:
    every rank raises the checksum mismatch (not a parse error), nothing is handed to the model (the
    hand-over step never runs), and ``load_latest`` loads step 1 over it, bit-exact."""
    from shardbridge.checkpoint.storage._trust import read_metadata

    source, first = two_saves
    root = tmp_path / "ckpt"
    shutil.copytree(source, root)
    step2 = ck.step_dir(root, 2)
    md = read_metadata(step2)
    boxes = {info.offset: (index, info) for index, info in md.storage_data.items() if info.relative_path == "__1_0.distcp"}
    index, info = max(boxes.values(), key=lambda pair: pair[1].length)  # its largest record: other ranks read it
    chunk = next(c for c in md.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
    head = len(_read._template(tuple(chunk.sizes), md.state_dict_metadata[index.fqn].properties.dtype).head)
    at = info.offset + (head + 5 if where == "data" else 0)  # byte 0: the zip local header's magic
    data = bytearray((step2 / "__1_0.distcp").read_bytes())
    data[at] ^= 0x10
    (step2 / "__1_0.distcp").write_bytes(data)
    for error, handed, step, got in run_distributed(_load_damaged, str(root), world_size=4):
        assert error is not None and "__1_0.distcp: checksum mismatch" in error and "in place" in error, error
        assert handed == 0 and step == 1
        if got is not None:
            assert_equal_states(got, first)
