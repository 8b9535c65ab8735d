"""[Note: untrusted checkpoints]: no code runs from any file of a checkpoint.

Each hostile file carries a pickle that, if anything unpickled it without restriction, would
create a marker directory (``os.mkdir``). Every read path must refuse it with a ValueError
naming the file, and the marker must not exist afterwards. The positive side: the restricted
unpickler reads every real checkpoint (4-rank FSDP2 x TP with fused params, optimizer and a
bytes ``_extra_state``; format 1) to exactly what ``pickle`` reads.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from ckpt_helpers import LAYOUTS, Mlp, build
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.state import _state
from shardbridge.checkpoint.storage._manifest import rng_file
from shardbridge.checkpoint.storage._trust import UntrustedCheckpointError, read_metadata
from shardbridge.testing import run_distributed
from shardbridge.testing._hostile import Payload, plant_item, reseal, torch_save
from torch import nn

NOT_TRUSTED = "not trusted; nothing from it was executed"


class ExtraState(nn.Module):
    """A module with a bytes ``_extra_state``, as shardbridge_te makes TE's (torch.save of plain values)."""

    def __init__(self) -> None:
        super().__init__()
        self.loaded: object = None

    def get_extra_state(self) -> bytes:
        buf = io.BytesIO()
        torch.save({"format": "test/1", "scale": torch.arange(3.0), "recipe": None}, buf)
        return buf.getvalue()

    def set_extra_state(self, state: object) -> None:
        self.loaded = state


def _mlp_with_optimizer(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "code-ran"


@pytest.fixture
def good(tmp_path) -> Path:
    model, opt = _mlp_with_optimizer()
    return ck.save(ck.step_dir(tmp_path / "root", 3), model=model, optimizer=opt, step=3)


@pytest.fixture
def bad_metadata(good, marker) -> Path:
    (good / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(good)
    return good


@pytest.fixture
def bad_param_groups(good, marker) -> Path:
    plant_item(good, "optim.param_groups", torch_save(Payload(marker)))
    return good


@pytest.fixture
def bad_tensor(good, marker) -> Path:
    plant_item(good, "model.up.weight", torch_save(Payload(marker)))
    return good


def _refused(marker: Path, match: str = NOT_TRUSTED):
    class Check:
        def __enter__(self):
            self.raises = pytest.raises(ValueError, match=match)
            return self.raises.__enter__()

        def __exit__(self, *exc):
            handled = self.raises.__exit__(*exc)
            assert not marker.exists(), "code from the checkpoint ran"
            return handled

    return Check()


# --------------------------------------------------------------------------- .metadata


def _load_with_optimizer(path: Path) -> None:
    model, opt = _mlp_with_optimizer(seed=1)
    ck.load(path, model=model, optimizer=opt)


def test_metadata_refused_by_load(bad_metadata, marker):
    with _refused(marker, match=r"\.metadata' references pickle global '(posix|os)\.mkdir'.*" + NOT_TRUSTED):
        _load_with_optimizer(bad_metadata)


def test_a_hostile_metadata_beside_an_intact_layout_derived_is_refused_by_load_too(good, marker):
    # One checkpoint, one meaning ([Note: derived loads]): an intact layout.derived does not make a
    # load skip a .metadata every other reader refuses. Rank 0 renders .metadata from the derivation,
    # finds the file differs, reads it with the restricted reader and refuses it, as inspect does.
    (good / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    reseal(good, keep_derived=True)
    with _refused(marker, match=r"\.metadata' references pickle global '(posix|os)\.mkdir'.*" + NOT_TRUSTED):
        _load_with_optimizer(good)
    with _refused(marker):
        ck.inspect(good)


def test_metadata_refused_by_load_latest(bad_metadata, marker):
    with _refused(marker):
        ck.load_latest(bad_metadata.parent, model=Mlp())


def test_metadata_refused_by_inspect(bad_metadata, marker):
    with _refused(marker):
        ck.inspect(bad_metadata)


def test_metadata_refused_by_export(bad_metadata, marker, tmp_path):
    with _refused(marker):
        ck.export_safetensors(bad_metadata, tmp_path / "hf", progress=False)


@pytest.mark.parametrize("command", ["inspect", "export"])
def test_metadata_refused_by_cli(bad_metadata, marker, tmp_path, command, capsys):
    # The console script's entry point, in this process (integration_tests/test_cli.py starts the
    # `shardbridge ckpt` process itself): its exit status and its one-line error.
    from shardbridge.cli._main import main

    args = [str(bad_metadata)] + ([str(tmp_path / "hf")] if command == "export" else [])
    code = main(["ckpt", command, *args])
    out = capsys.readouterr()
    assert code != 0, out.out
    assert NOT_TRUSTED in out.err and ".metadata" in out.err, out.err
    assert not marker.exists(), "code from the checkpoint ran"


def test_metadata_setting_state_of_a_class_is_refused(good, tmp_path):
    """BUILD on a class (``setattr(Metadata, ...)`` for the whole process) is refused."""
    from torch.distributed.checkpoint.metadata import Metadata

    module, name = Metadata.__module__.encode(), Metadata.__name__.encode()
    # PROTO 4; push the class (STACK_GLOBAL); state (None, {"hacked": True}); BUILD; STOP.
    data = (
        b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"
        b"N}\x8c\x06hacked\x88s\x86b."
    )
    assert pickle.loads(data) is Metadata and Metadata.hacked is True  # what plain pickle does
    del Metadata.hacked
    (good / ".metadata").write_bytes(data)
    with pytest.raises(ValueError, match=r"sets the state of a type object.*" + NOT_TRUSTED):
        read_metadata(good)
    assert not hasattr(Metadata, "hacked")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda info: info.__class__("../../etc/passwd", 0, 10), "not a .distcp file of this directory"),
        (lambda info: info.__class__("/etc/x.distcp", 0, 10), "not a .distcp file of this directory"),
        (lambda info: info.__class__(info.relative_path, info.offset, 3), r"in a 3-byte record"),
        (lambda info: info.__class__(info.relative_path, 0, info.length, ["zstd/1"]), "stream transforms"),
    ],
    ids=["parent-dir", "absolute", "short-record", "transform"],
)
def test_metadata_structure_is_checked(good, change, match):
    md = pickle.loads((good / ".metadata").read_bytes())
    index = next(i for i in md.storage_data if i.fqn == "model.up.weight")
    md.storage_data[index] = change(md.storage_data[index])
    (good / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UntrustedCheckpointError, match=match):
        read_metadata(good)


def test_huge_declared_shape_is_refused(good, tmp_path):
    """A shape the stored chunks do not cover (export would allocate it) is refused."""
    md = pickle.loads((good / ".metadata").read_bytes())
    md.state_dict_metadata["model.up.weight"].size = torch.Size([10**6, 10**6])
    (good / ".metadata").write_bytes(pickle.dumps(md))
    reseal(good)
    with pytest.raises(UntrustedCheckpointError, match=r"chunks of 54 elements for a size \(1000000, 1000000\)"):
        ck.export_safetensors(good, tmp_path / "hf", progress=False)


# --------------------------------------------------------------------------- bytes and tensor items


def test_bytes_item_refused_by_load(bad_param_groups, marker):
    with _refused(marker, match=r"__0_0\.distcp' \(item 'optim\.param_groups'\).*weights_only.*" + NOT_TRUSTED):
        _load_with_optimizer(bad_param_groups)


def test_bytes_item_refused_by_load_latest(bad_param_groups, marker):
    model, opt = _mlp_with_optimizer(seed=1)
    with _refused(marker):
        ck.load_latest(bad_param_groups.parent, model=model, optimizer=opt)


def _load_on_every_rank(path: str) -> str:
    model, opt = build(LAYOUTS["fsdp4"], seed=1)
    try:
        ck.load(path, model=model, optimizer=opt, rng=False)
    except ValueError as err:
        return str(err)
    return "loaded"


def test_bytes_item_refused_on_every_rank(marker, tmp_path):
    run_distributed(_save_fsdp4, str(tmp_path / "c"), world_size=4)
    plant_item(tmp_path / "c", "optim.param_groups", torch_save(Payload(marker)))
    errors = run_distributed(_load_on_every_rank, str(tmp_path / "c"), world_size=4)
    assert all(NOT_TRUSTED in e and "optim.param_groups" in e for e in errors), errors
    assert not marker.exists()


def _save_fsdp4(path: str) -> None:
    model, opt = build(LAYOUTS["fsdp4"])
    ck.save(path, model=model, optimizer=opt)


def test_extra_state_bytes_item_refused(tmp_path, marker):
    """A TE-like bytes ``_extra_state`` loads with weights_only; a hostile one is refused."""
    model = nn.Sequential(ExtraState())
    path = ck.save(tmp_path / "c", model=model)
    fresh = nn.Sequential(ExtraState())
    ck.load(path, model=fresh)
    assert torch.equal(torch.load(io.BytesIO(fresh[0].loaded), weights_only=True)["scale"], torch.arange(3.0))
    plant_item(path, "model.0._extra_state", torch_save(Payload(marker)))
    with _refused(marker, match=r"item 'model\.0\._extra_state'.*" + NOT_TRUSTED):
        ck.load(path, model=nn.Sequential(ExtraState()))


def test_tensor_record_refused(bad_tensor, marker, tmp_path):
    with _refused(marker, match=r"tensor record.*weights_only.*" + NOT_TRUSTED):
        ck.load(bad_tensor, model=Mlp())
    with _refused(marker, match=r"tensor record.*" + NOT_TRUSTED):
        ck.export_safetensors(bad_tensor, tmp_path / "hf", progress=False)


def test_planner_without_weights_only_bytes_is_refused(good):
    """TrustedReader never hands bytes items to DCP's default planner (weights_only=False)."""
    import torch.distributed.checkpoint as dcp
    from shardbridge.checkpoint.storage._reader import TrustedReader

    state = {"optim": {"param_groups": []}}
    with pytest.raises(BaseException, match="without weights_only"):
        dcp.load(state, storage_reader=TrustedReader(good), no_dist=True)


# --------------------------------------------------------------------------- RNG files


def test_rng_file_refused(good, marker):
    (good / rng_file(0)).write_bytes(torch_save({"cpu": Payload(marker)}))
    reseal(good)
    with _refused(marker, match=r"rank-00000\.pt' holds a pickle.*" + NOT_TRUSTED):
        ck.load(good, model=Mlp())


# --------------------------------------------------------------------------- positive: real checkpoints


def _save_real(path: str) -> None:
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    model.extra = ExtraState()
    ck.save(path, model=model, optimizer=opt, step=1)


def test_every_real_checkpoint_reads_as_with_pickle(tmp_path, monkeypatch):
    run_distributed(_save_real, str(tmp_path / "fused"), world_size=4)
    model, opt = _mlp_with_optimizer()
    monkeypatch.setattr(_state, "_pack_param_groups", lambda state: None)  # format 1: unpacked
    ck.save(tmp_path / "v1", model=model, optimizer=opt)
    monkeypatch.undo()
    for name in ("fused", "v1"):
        path = tmp_path / name
        want = pickle.loads((path / ".metadata").read_bytes())
        got = read_metadata(path)
        assert got.state_dict_metadata == want.state_dict_metadata
        assert got.storage_data == want.storage_data and got.planner_data == want.planner_data
        assert str(got.storage_meta.checkpoint_id) == str(want.storage_meta.checkpoint_id)
    keys = read_metadata(tmp_path / "fused").state_dict_metadata
    assert {"model.gate_proj.weight", "model.extra._extra_state", "optim.param_groups"} <= set(keys)
    assert "optim.param_groups.up.weight.lr" in read_metadata(tmp_path / "v1").state_dict_metadata


def _load_real(path: str) -> bool:
    model, opt = build(LAYOUTS["tp4"], fused=True, seed=5, lr=0.5)
    model.extra = ExtraState()
    ck.load(path, model=model, optimizer=opt, rng=False)
    return opt.param_groups[0]["lr"] == 0.01 and isinstance(model.extra.loaded, bytes)


def test_real_checkpoint_with_bytes_items_loads(tmp_path):
    run_distributed(_save_real, str(tmp_path / "c"), world_size=4)
    assert run_distributed(_load_real, str(tmp_path / "c"), world_size=4) == [True] * 4


# --------------------------------------------------------------------------- every chunk has its record


def _drop_record(md, key):
    for index in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[index]


def _add_unstored_tensor(md, key):
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    size = torch.Size([3 * 2**28])  # 3 GiB of float32; the checkpoint holds a few KiB
    chunk = ChunkStorageMetadata(offsets=torch.Size([0]), sizes=size)
    md.state_dict_metadata[key] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk])


def _add_unstored_bytes(md, key):
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md.state_dict_metadata[key] = BytesStorageMetadata()


def _duplicate_chunk(md, key):
    entry = md.state_dict_metadata[key]
    (chunk,) = entry.chunks  # a plain tensor: one chunk covering it
    half = chunk.sizes[0] // 2
    entry.chunks = [type(chunk)(chunk.offsets, torch.Size([half, *chunk.sizes[1:]]))] * 2
    entry.size = torch.Size([2 * half, *entry.size[1:]])


@pytest.mark.parametrize(
    ("craft", "key", "match"),
    [
        (_add_unstored_tensor, "model.huge", r"describes a chunk of 'model\.huge' at \(0,\) but stores no record"),
        (_drop_record, "model.up.weight", r"describes a chunk of 'model\.up\.weight' at \(0, 0\) but stores no record"),
        (_add_unstored_bytes, "optim.extra", r"describes 'optim\.extra' but stores no record of it"),
        # caught by the exact-coverage check ([Note: exact chunk coverage]) before the record check
        (_duplicate_chunk, "model.up.weight", r"gives 'model\.up\.weight' \(size \(8, 6\)\) chunks that overlap"),
    ],
    ids=["unstored-huge-tensor", "dropped-record", "unstored-bytes", "duplicate-chunk"],
)
def test_every_chunk_needs_exactly_one_storage_record(good, tmp_path, craft, key, match):
    """A declared chunk without its record is refused before export allocates its shape.

    Before: a 3 GiB tensor entry with no record passed the structure check; export zeroed 3 GiB
    (peak RSS 3.4 GB for a checkpoint of a few KiB) and then failed with a raw KeyError.
    """
    md = pickle.loads((good / ".metadata").read_bytes())
    craft(md, key)
    (good / ".metadata").write_bytes(pickle.dumps(md))
    reseal(good)  # as an attacker would: the integrity checks pass
    for data_files in (True, False):  # inspect's read (no data files) refuses it too
        with pytest.raises(UntrustedCheckpointError, match=match + ".*" + NOT_TRUSTED):
            read_metadata(good, data_files=data_files)
    with pytest.raises(UntrustedCheckpointError, match=match):
        ck.export_safetensors(good, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- links out of the directory


def _link_out(good: Path, name: str, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    (good / name).rename(outside)
    (good / name).symlink_to(outside)


@pytest.mark.parametrize("name", [".metadata", "__0_0.distcp", "shardbridge.json"])
def test_inspect_and_export_refuse_a_linked_file(good, tmp_path, name):
    """A checkpoint file that is a symbolic link (here: to a copy of itself outside) is never followed.

    Before: inspect and export read through the link (the same data: they succeeded).
    """
    _link_out(good, name, tmp_path)
    with pytest.raises(ValueError, match=rf"{re.escape(name)}: a symbolic link .*shardbridge ckpt verify"):
        ck.inspect(good)
    for verify in (True, False):
        with pytest.raises(ValueError, match=rf"{re.escape(name)}: .*link.*shardbridge ckpt verify"):
            ck.export_safetensors(good, tmp_path / "hf", progress=False, verify=verify)
    assert not (tmp_path / "hf").exists()


def test_load_latest_and_verify_refuse_a_linked_manifest(good, tmp_path, caplog):
    """``shardbridge.json`` as a link (to a copy of itself outside) is refused by every reader.

    Before: load, latest and verify read through it (the same data: they succeeded).
    """
    _link_out(good, "shardbridge.json", tmp_path)
    refused = r"shardbridge\.json is a symbolic link \(to '.*elsewhere.*'\).*not reading through it"
    with pytest.raises(ValueError, match=refused):
        _load_with_optimizer(good)
    for checksums in (True, False):
        with pytest.raises(ValueError, match=refused):
            ck.verify(good, checksums=checksums)
    with caplog.at_level("WARNING"):
        assert ck.latest(good.parent) is None
    assert re.search(rf"skipping {re.escape(str(good))}: .*{refused}", caplog.text)


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"hello", r"optim\.param_groups \(the optimizer's hyperparameters\) is a bytes, not a list of \(key, value\)"),
        ([("lr", 0.1)], r"is a list, not a list of \(key, value\) pairs"),
        ([("param_groups.up.weight.lr", "notanumber")], r"lacks \d+ of this optimizer's hyperparameters"),
    ],
)
def test_param_groups_item_of_the_wrong_shape_is_refused(good, payload, match):
    """weights_only stops code, not nonsense: a damaged or crafted item must not load silently."""
    plant_item(good, "optim.param_groups", torch_save(payload))
    with pytest.raises(ValueError, match=match):
        _load_with_optimizer(good)


def test_param_groups_value_of_the_wrong_kind_is_refused(good):
    model, opt = _mlp_with_optimizer(seed=1)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    flat = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    pairs = [(k, v) for k, v in flat.items() if k.startswith("param_groups.")]
    pairs = [(k, "notanumber" if k.endswith(".lr") else v) for k, v in pairs]
    plant_item(good, "optim.param_groups", torch_save(pairs))
    with pytest.raises(ValueError, match=r"\.lr' is a string \('notanumber'\) in the checkpoint but a number"):
        _load_with_optimizer(good)


# ------------------------------------------------------------------ bounded structure (issue 42)
#
# [Note: bounded structure] in shardbridge/_json.py: every .metadata object's nesting and every
# tuple's size are counted while the restricted unpickler builds them, so nothing recursive in C
# meets an unbounded structure. Each hostile file runs in a forked child: a crash (before: SIGSEGV)
# or a hang (before: hours of hashing) fails the test instead of killing pytest.

_SLOT = 4096  # memo slots above the pickler's own, below the stream's length (a slot past it is refused)


def _keep(slot: int) -> bytes:
    """Memoize the top of the stack in ``slot`` and pop it (LONG_BINPUT, POP)."""
    return b"r" + struct.pack("<I", slot) + b"0"


def _get(slot: int) -> bytes:
    return b"j" + struct.pack("<I", slot)


def _text(s: str) -> bytes:
    return b"X" + struct.pack("<I", len(s)) + s.encode()


def _dag(first: bytes, level: Callable[[bytes], bytes], levels: int) -> bytes:
    """One object: ``first``, then ``levels`` times ``level(a reference to the one before)``, each built on the last."""
    out = first + _keep(_SLOT)
    for k in range(levels):
        out += level(_get(_SLOT + k)) + _keep(_SLOT + k + 1)
    return out + _get(_SLOT + levels)


_INDEX = b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n)\x81}" + _text("fqn")


_TENSOR_PROPERTIES = b"ctorch.distributed.checkpoint.metadata\nTensorProperties\n)\x81"
_STRIDED = b"ctorch.serialization\n_get_layout\n" + _text("torch.strided") + b"\x85R"
HOSTILE_STRUCTURES = {  # field of Metadata -> (pickle opcodes building one object, what the refusal names)
    "a tuple nested 10**6 deep as a dict key (1 MB)": (
        "planner_data", b"})" + b"\x85" * 10**6 + b"K\x01s", r"nests objects 33 deep \(at most 32\)"),
    "lists nested 10**5 deep": ("version", b"(" * 10**5 + b"]" + b"l" * 10**5, r"nests objects 33 deep"),
    "a tuple of 2**40 elements in 800 bytes, as a dict key": (
        "planner_data", b"}" + _dag(b"K\x01\x85", lambda t: t * 2 + b"\x86", 40) + b"K\x01s",
        r"builds a tuple of \d+ elements \(at most 1024\)"),
    "a MetadataIndex holding 2**40 MetadataIndexes, as a dict key": (
        "planner_data", b"}" + _dag(_INDEX + _text("a") + b"sb", lambda m: _INDEX + m * 2 + b"\x86sb", 40) + b"K\x01s",
        r"gives a MetadataIndex the state a dict"),
    "a TensorProperties whose memory format is a list of 2**30 elements": (
        "version", _TENSOR_PROPERTIES + b"(ctorch\nfloat32\n" + _STRIDED + b"\x89"
        + _dag(b"]K\x01a", lambda x: b"](" + x * 2 + b"e", 30) + b"\x89tb", r"gives a TensorProperties the state a tuple"),
    "a list changed after a dict took it": (
        "version", b"]" + _keep(_SLOT) + b"}K\x01" + _get(_SLOT) + b"s" + _get(_SLOT) + b"K\x02a0",
        r"changes an object after another took it"),
}  # fmt: skip


def _with_field(path: Path, field: str, fragment: bytes) -> None:
    """``path``'s .metadata with ``Metadata.<field>`` built by ``fragment`` instead (our own file, resealed)."""
    md = pickle.loads((path / ".metadata").read_bytes())
    setattr(md, field, "SENTINEL-0123456789")
    data = pickle.dumps(md, protocol=3)
    sentinel = _text("SENTINEL-0123456789")
    assert data.count(sentinel) == 1
    (path / ".metadata").write_bytes(data.replace(sentinel, fragment))
    reseal(path)


def _in_child(fn, *args, timeout: float = 120):
    """``fn(*args)`` in a forked process: ("returned", value), ("raised", type, message), ("died", signal) or ("hung",)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def run():
        try:
            send.send(("returned", fn(*args)))
        except BaseException as exc:  # noqa: BLE001 (reported to the parent)
            send.send(("raised", type(exc).__name__, str(exc)))

    child = ctx.Process(target=run, daemon=True)
    child.start()
    child.join(timeout)
    if child.is_alive():
        child.kill()
        child.join()
        return ("hung",)
    return receive.recv() if receive.poll() else ("died", child.exitcode)


@pytest.mark.parametrize("case", sorted(HOSTILE_STRUCTURES))
def test_structure_is_bounded_while_metadata_is_read(good, case):
    field, fragment, names = HOSTILE_STRUCTURES[case]
    _with_field(good, field, fragment)
    outcome = _in_child(lambda: str(ck.inspect(good)))
    assert outcome[:2] == ("raised", "UntrustedCheckpointError"), outcome
    assert re.search(names + r".*" + NOT_TRUSTED, outcome[2]) and ".metadata" in outcome[2], outcome[2]


def test_a_1mb_metadata_nesting_a_tuple_is_refused_by_every_reader(good, tmp_path):
    # Before: every reader died with SIGSEGV (hash() of the key recursed in C).
    field, fragment, names = HOSTILE_STRUCTURES["a tuple nested 10**6 deep as a dict key (1 MB)"]
    _with_field(good, field, fragment)
    from shardbridge.cli._main import main

    readers = {
        "load": lambda: _load_with_optimizer(good),
        "export": lambda: ck.export_safetensors(good, tmp_path / "hf", progress=False),
        "cli inspect": lambda: main(["ckpt", "inspect", str(good)]),
    }
    for name, read in readers.items():
        outcome = _in_child(read)
        if name == "cli inspect":
            assert outcome == ("returned", 2), outcome
        else:
            assert outcome[:2] == ("raised", "UntrustedCheckpointError") and re.search(names, outcome[2]), (name, outcome)


@pytest.mark.parametrize("strides", [None, (4, 1), "x", (1.5,)])
def test_tensor_properties_of_torch_2_15_are_read_by_every_torch(tmp_path, monkeypatch, strides, caplog):
    # torch 2.15 pickles TensorProperties with a sixth field, `strides` (None or a tuple of ints: the
    # local strides of the first rank that wrote the tensor, read by nothing but ShardedTensor);
    # torch 2.11-2.14's class (and their own DCP) cannot take it. The restricted reader once refused
    # every such stream as "not trusted" (found by `nox -s torch_cross`), then refused it by name on
    # an older torch. A torch with the field reads it; an older one drops the field and says so at
    # info level, and the checkpoint loads bit-exact; a sixth field of another kind is hostile.
    import logging

    from torch.distributed.checkpoint.metadata import TensorProperties

    saved = Mlp()
    path = ck.save(tmp_path / "c", model=saved, step=1)
    md = read_metadata(path)
    five = TensorProperties.__getstate__
    monkeypatch.setattr(TensorProperties, "__getstate__", lambda self: (*five(self)[:5], strides))
    (path / ".metadata").write_bytes(pickle.dumps(md))
    monkeypatch.undo()
    reseal(path)
    if strides is None or strides == (4, 1):
        with caplog.at_level(logging.INFO, logger="shardbridge.checkpoint"):
            got = read_metadata(path)
        assert got.state_dict_metadata.keys() == md.state_dict_metadata.keys()
        for key, entry in md.state_dict_metadata.items():
            props = getattr(entry, "properties", None)
            if props is not None:
                assert five(got.state_dict_metadata[key].properties)[:5] == five(props)[:5], key
        dropped = "local strides (read only by ShardedTensor) are dropped" in caplog.text
        assert dropped == ("strides" not in TensorProperties.__dataclass_fields__ and strides is not None), caplog.text
        model = Mlp()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardbridge.checkpoint"):
            ck.load(path, model=model, rng=False)  # through .metadata (reseal drops layout.derived)
        assert ("local strides (read only by ShardedTensor) are dropped" in caplog.text) == dropped, caplog.text
        for (name, a), b in zip(model.state_dict().items(), saved.state_dict().values()):
            assert torch.equal(a, b), name
    else:
        with pytest.raises(UntrustedCheckpointError, match="gives a TensorProperties the state"):
            read_metadata(path)
