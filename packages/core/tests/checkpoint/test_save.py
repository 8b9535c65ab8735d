"""``save``: argument checks, the manifest, and the portable format (readable by torch alone)."""

from __future__ import annotations

import io
import json
import pickle
import subprocess
import sys

import pytest
import torch
from ckpt_helpers import LAYOUTS, Mlp, assert_equal_states, build, full_state, step, without_strides
from shardbridge import checkpoint as ck
from shardbridge._mesh import ParallelDims
from shardbridge.checkpoint.storage._manifest import MANIFEST_NAME
from shardbridge.testing import run_distributed
from torch import nn


def test_extra_that_is_not_json_names_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"extra\['loader'\]\['state'\] is a Tensor.*\.tolist\(\)"):
        ck.save(tmp_path / "c", model=Mlp(), extra={"loader": {"state": torch.ones(2)}})
    with pytest.raises(ValueError, match="extra must be a dict"):
        ck.save(tmp_path / "c", model=Mlp(), extra=[1])
    with pytest.raises(ValueError, match="step=-3 must be an int >= 0 or None"):
        ck.save(tmp_path / "c", model=Mlp(), step=-3)
    with pytest.raises(ValueError, match="on_bad_layout='fix' must be 'repair' or 'error'"):
        ck.save(tmp_path / "c", model=Mlp(), on_bad_layout="fix")
    assert not (tmp_path / "c").exists() and list(tmp_path.iterdir()) == []


def _save_fused(root: str):
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    ck.save(f"{root}/c", model=model, optimizer=opt, step=9, parallel_dims=ParallelDims(dp_shard=2, tp=2))
    return full_state(model, opt)


@pytest.fixture(scope="module")
def fused_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("portable")
    want = run_distributed(_save_fused, str(root), world_size=4)[0]
    return root / "c", want


def test_manifest_records_the_run(fused_ckpt):
    path, _ = fused_ckpt
    m = json.loads((path / MANIFEST_NAME).read_text())
    assert m["step"] == 9 and m["world_size"] == 4 and m["has_optimizer"] and m["torch_version"] == torch.__version__
    assert m["layout"]["parallel_dims"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "ep": 1}
    assert m["layout"]["mesh_axes"] == {"dp_shard_cp": 2, "tp": 2}
    assert m["layout"]["tensors"]["up.weight"] == {
        "mesh": {"dp_shard_cp": 2, "tp": 2},
        "placements": ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        "stored_as": "dtensor",
    }
    assert m["layout"]["tensors"]["gate_up.weight"]["stored_as"] == "components"
    assert m["fused"]["gate_up.weight"] == {
        "dim": 0,
        "tp_size": 2,
        "components": [
            {"name": "gate_proj", "size": 4, "fqn": "gate_proj.weight"},
            {"name": "up_proj", "size": 4, "fqn": "up_proj.weight"},
        ],
    }


_TORCH_ONLY = """
import sys
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
dcp_to_torch_save(sys.argv[1], sys.argv[2])
sd = torch.load(sys.argv[2], weights_only=True)
assert not [m for m in sys.modules if m.startswith("shardbridge")]
print(sorted(sd), len(sd["model"]), len(sd["optim"]))
"""


def test_checkpoint_loads_with_torch_alone_and_weights_only(fused_ckpt, tmp_path):
    path, want = fused_ckpt
    out = tmp_path / "full.pt"
    proc = subprocess.run([sys.executable, "-c", _TORCH_ONLY, str(path), str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("['model', 'optim']")
    sd = torch.load(out, weights_only=True)
    got = {f"model.{k}": v for k, v in sd["model"].items()}
    got.update({f"optim.{k}": v for k, v in sd["optim"].items() if k.startswith("state.")})
    assert_equal_states(got, want)
    # Hyperparameters: one packed entry of (key, value) pairs (format 2).
    assert dict(sd["optim"]["param_groups"])["param_groups.up.weight.lr"] == 0.01


def test_metadata_pickles_only_torch_classes(fused_ckpt):
    path, _ = fused_ckpt
    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add(module)
            return super().find_class(module, name)

    Recorder(io.BytesIO((path / ".metadata").read_bytes())).load()
    assert all(m.startswith("torch") or m in ("builtins", "collections", "pathlib") for m in seen), seen
    assert not any(m.startswith("shardbridge") for m in seen)


def test_saving_does_not_touch_the_model(tmp_path):
    model = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ck.save(tmp_path / "c", model=model)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def _saves_reusing_and_replanning(root: str):
    a, opt_a = build(LAYOUTS["fsdp2_tp2"], seed=1)
    b, opt_b = build(LAYOUTS["fsdp4"], seed=2)  # another layout: another plan
    wanted = {}
    for name, (model, opt) in [("a1", (a, opt_a)), ("a2", (a, opt_a)), ("b", (b, opt_b)), ("a3", (a, opt_a))]:
        step(model, opt, seed=len(wanted))  # new values every save
        ck.save(f"{root}/{name}", model=model, optimizer=opt, step=len(wanted), protocol="dcp")
        wanted[name] = full_state(model, opt)
    async_save = ck.save(f"{root}/a4", model=a, optimizer=opt_a, async_=True, protocol="dcp")
    wanted["a4"] = full_state(a, opt_a)
    async_save.wait()
    loaded = {}
    for name in wanted:
        model, opt = build(LAYOUTS["fsdp2_tp2" if name != "b" else "fsdp4"], seed=9)
        ck.load(f"{root}/{name}", model=model, optimizer=opt)
        loaded[name] = full_state(model, opt)
    return wanted, loaded


def test_dcp_plan_caching_saves_every_layout_change_right(tmp_path):
    # [Note: save protocols], "dcp": DCP's cached global plan is reused while no rank's plan changes (a2, and
    # the async a4: same boxes from the staged copy), recomputed for another layout (b) and back (a3).
    results = run_distributed(_saves_reusing_and_replanning, str(tmp_path), world_size=4)
    for wanted, loaded in results:
        for name in wanted:
            assert_equal_states(loaded[name], wanted[name])  # bit-exact, every save


def test_data_files_are_laid_out_as_dcps_own_writer_lays_them_out(tmp_path):
    # [Note: the data file writer]: the same items at the same offsets and lengths as DCP's
    # FileSystemWriter writes for the same state (one file per rank), tensors equal; only the
    # records' zip CRC32 fields differ (0 here), which torch.load does not check.
    import zipfile

    import torch.distributed.checkpoint as dcp
    from shardbridge.checkpoint.state._chunks import SavePlanner
    from shardbridge.checkpoint.state._state import build_portable_state
    from shardbridge.checkpoint.storage._trust import read_metadata
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    model, opt = build(None)
    step(model, opt, seed=3)
    ck.save(tmp_path / "ours", model=model, optimizer=opt)
    state = build_portable_state(model, opt, on_bad_layout="repair", log=False, provider=None)
    dcp.save(
        state.dcp_state, storage_writer=dcp.FileSystemWriter(tmp_path / "dcp"), planner=SavePlanner(), no_dist=True
    )
    ours, theirs = read_metadata(tmp_path / "ours"), read_metadata(tmp_path / "dcp")
    assert ours.state_dict_metadata == without_strides(theirs.state_dict_metadata)
    assert len(ours.storage_data) == len(theirs.storage_data) > 10
    for index, info in theirs.storage_data.items():
        mine = ours.storage_data[index]
        assert (mine.relative_path, mine.offset, mine.length) == (info.relative_path, info.offset, info.length), index
        record = (tmp_path / "ours" / mine.relative_path).read_bytes()[mine.offset : mine.offset + mine.length]
        dcps = (tmp_path / "dcp" / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
        if isinstance(theirs.state_dict_metadata[index.fqn], TensorStorageMetadata):  # one torch.save zip
            mine_t, dcp_t = (torch.load(io.BytesIO(b), weights_only=True) for b in (record, dcps))
            assert torch.equal(mine_t, dcp_t), index
            assert {i.CRC for i in zipfile.ZipFile(io.BytesIO(record)).infolist()} == {0}
        else:  # a bytes item: its bytes
            assert record == dcps, index
    assert ck.verify(tmp_path / "ours").ok  # the records computed while writing match a fresh read


def _save_with(protocol: str, root: str):
    from shardbridge.checkpoint.storage._trust import read_metadata

    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True, seed=3)
    path = f"{root}/{protocol}"
    ck.save(path, model=model, optimizer=opt, step=1, protocol=protocol)
    step(model, opt, seed=5)  # a second save: DCPSave's cached plan
    ck.save(f"{path}-2", model=model, optimizer=opt, step=2, async_=True, protocol=protocol).wait()
    want = full_state(model, opt)
    fresh, fresh_opt = build(LAYOUTS["fsdp4"], fused=True, seed=9, lr=0.5)
    ck.load(f"{path}-2", model=fresh, optimizer=fresh_opt)
    got = full_state(fresh, fresh_opt)
    return want, got, read_metadata(path).state_dict_metadata


def test_both_save_protocols_write_the_same_checkpoint(tmp_path):
    """[Note: save protocols]: dcp.save (DCP's plan caching) and the derived protocol drive the same
    storage writer: the same metadata, and each of two saves (sync, then async) loads bit-exact."""
    metadata = {}
    for protocol in ("dcp", "derived"):
        want, got, metadata[protocol] = run_distributed(_save_with, protocol, str(tmp_path), world_size=4)[0]
        assert_equal_states(got, want)
        assert ck.verify(tmp_path / protocol).ok and ck.verify(tmp_path / f"{protocol}-2").ok
    assert without_strides(metadata["dcp"]) == metadata["derived"]


def test_a_save_hashes_and_fsyncs_each_file_once(tmp_path, monkeypatch):
    """The save's I/O counted, not timed (issue 37.4): every byte of every file is hashed once, while
    it is written (no read-back pass), every file is fsynced once, rng/ once (its files' names, before
    the manifest), and the directories twice: the temporary one after the manifest's rename (the
    commit point), the parent after the final rename."""
    import os
    from collections import Counter
    from pathlib import Path

    import xxhash
    from shardbridge.checkpoint.storage import _integrity

    hashed = [0]

    class Counted:
        def __init__(self) -> None:
            self._digest = xxhash.xxh3_128()

        def update(self, data) -> None:
            hashed[0] += memoryview(data).nbytes
            self._digest.update(data)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    synced: Counter[str] = Counter()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced[os.readlink(f"/proc/self/fd/{fd}")] += 1
        real_fsync(fd)

    model, opt = build(None)
    monkeypatch.setattr(_integrity, "xxhash", type("Xxhash", (), {"xxh3_128": Counted}))
    monkeypatch.setattr(os, "fsync", fsync)
    path = ck.save(tmp_path / "c", model=model, optimizer=opt, step=1)
    files = {p.relative_to(path).as_posix(): p.stat().st_size for p in Path(path).rglob("*") if p.is_file()}
    assert {".metadata", MANIFEST_NAME, "rng/rank-00000.pt"} < set(files) and len(files) >= 4
    assert hashed[0] == sum(size for name, size in files.items() if name != MANIFEST_NAME)
    tmp = next(p for p in synced if Path(p).name.startswith(".c.tmp-"))
    inside = {os.path.relpath(p, tmp).removesuffix(".tmp"): n for p, n in synced.items() if p.startswith(tmp + "/")}
    by_name = Counter(inside)  # the manifest is fsynced under its temporary name, then renamed
    dirs = [p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_dir()]  # rng/: its names durable
    assert dirs == ["rng"] and by_name == Counter(dict.fromkeys([*files, *dirs], 1)), by_name
    assert {p: n for p, n in synced.items() if not p.startswith(tmp + "/")} == {tmp: 1, str(tmp_path): 1}
