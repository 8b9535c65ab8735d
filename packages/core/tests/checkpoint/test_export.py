"""Streaming safetensors export ([Note: streaming export]) checked against dcp_to_torch_save."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from ckpt_helpers import LAYOUTS, build
from safetensors import safe_open
from shardbridge import checkpoint as ck
from shardbridge.checkpoint._export import parse_size
from shardbridge.testing import run_distributed
from torch import nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _save(root: str):
    model, opt = build(LAYOUTS["fsdp2_tp2"], fused=True)
    ck.save(f"{root}/c", model=model, optimizer=opt, step=4)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    run_distributed(_save, str(root), world_size=4)
    dcp_to_torch_save(root / "c", root / "oracle.pt")
    return root / "c", torch.load(root / "oracle.pt", weights_only=True)["model"]


def _read_all(out_dir):
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    tensors, sizes = {}, {}
    for file_name in sorted(set(index["weight_map"].values())):
        with safe_open(str(out_dir / file_name), framework="pt") as f:
            names = list(f.keys())
            sizes[file_name] = (len(names), sum(f.get_tensor(n).nbytes for n in names))
            tensors.update({n: f.get_tensor(n) for n in names})
    return index, tensors, sizes


def test_export_matches_the_oracle_and_respects_shard_size(ckpt, tmp_path):
    path, oracle = ckpt
    index_path = ck.export_safetensors(path, tmp_path / "hf", max_shard_size=200, progress=False)
    index, tensors, sizes = _read_all(tmp_path / "hf")
    assert index_path == tmp_path / "hf" / "model.safetensors.index.json"
    assert set(index["weight_map"]) == set(oracle) == set(tensors)
    assert "gate_proj.weight" in tensors and "gate_up.weight" not in tensors  # fused params split
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in oracle.values())
    for name, t in oracle.items():
        assert torch.equal(tensors[name], t), name
    assert len(sizes) > 1
    for file_name, (count, nbytes) in sizes.items():
        assert nbytes <= 200 or count == 1, (file_name, nbytes)
        assert file_name.endswith(f"-of-{len(sizes):05d}.safetensors")


def test_export_casts_and_renames(ckpt, tmp_path):
    path, oracle = ckpt

    def name_map(fqn):
        return None if fqn.startswith("norm.") else f"model.{fqn}"

    ck.export_safetensors(path, tmp_path / "hf", dtype="bfloat16", name_map=name_map, progress=False)
    index, tensors, sizes = _read_all(tmp_path / "hf")
    assert len(sizes) == 1
    assert set(tensors) == {f"model.{k}" for k in oracle if not k.startswith("norm.")}
    for name, t in tensors.items():
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, oracle[name.removeprefix("model.")].to(torch.bfloat16))

    with pytest.raises(ValueError, match="maps both 'down.weight' and 'head.bias' to 'x'"):
        ck.export_safetensors(path, tmp_path / "bad", name_map={"down.weight": "x", "head.bias": "x"})


def test_parse_size():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1GiB") == 2**30 and parse_size("10 mb") == 10**7
    with pytest.raises(ValueError, match="is not a size"):
        parse_size("lots")
    with pytest.raises(ValueError, match="must be > 0"):
        parse_size(0)


_MEASURE = """
import sys
from shardbridge.checkpoint import export_safetensors
from shardbridge.checkpoint.storage import _integrity  # noqa: F401 (imported before the baseline, as export imports it)

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS")
export_safetensors(sys.argv[1], sys.argv[2], max_shard_size="1GB", progress=False)
print(status("VmHWM") - base)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS via /proc/self/clear_refs")
def test_export_peak_memory_is_about_one_tensor(tmp_path):
    """96 MiB of tensors in ONE output shard, largest 8 MiB: the peak must track the tensor.

    Measured ~20 MiB: the assembled tensor plus DCP's reader holding the stored record while
    it copies it in. A shard buffer would cost the whole 96 MiB.
    """
    big = 2 * 2**20  # float32 elements: 8 MiB
    model = nn.Module()
    model.big = nn.Parameter(torch.ones(big))
    for i in range(22):
        model.register_parameter(f"p{i}", nn.Parameter(torch.full((big // 2,), float(i))))
    ck.save(tmp_path / "c", model=model)
    del model
    proc = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path / "c"), str(tmp_path / "hf")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    growth = int(proc.stdout.split()[-1])
    largest = big * 4
    assert growth < 4 * largest, f"peak RSS grew {growth / 2**20:.1f} MiB; largest tensor {largest / 2**20:.0f} MiB"
    with safe_open(str(tmp_path / "hf" / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("p21"), torch.full((big // 2,), 21.0))
        assert len(f.keys()) == 23


@pytest.mark.parametrize("dtype", ["int8", torch.int32, "bool"])
def test_export_refuses_non_floating_dtypes(tmp_path, dtype):
    # Before: int8 wrote zeros... rather, nothing was cast and the export claimed success.
    ck.save(tmp_path / "c", model=nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"is not a floating dtype .*use one of bfloat16, float16, float32"):
        ck.export_safetensors(tmp_path / "c", tmp_path / "hf", dtype=dtype, progress=False)
    assert not (tmp_path / "hf").exists()


# --------------------------------------------------------------------------- verified before export


def _flip_byte(path, name="__0_0.distcp"):
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / name).write_bytes(bytes(data))


@pytest.fixture
def two_steps(tmp_path):
    """step 1 and step 2 of one run: same shapes, different values."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    one = ck.save(ck.step_dir(tmp_path / "root", 1), model=model, step=1)
    with torch.no_grad():
        model.weight.add_(1.0)
    two = ck.save(ck.step_dir(tmp_path / "root", 2), model=model, step=2)
    return one, two


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (_flip_byte, "__0_0.distcp: checksum mismatch"),
        (
            lambda p: (p / "__0_0.distcp").write_bytes((p.parent / "step-00000001" / "__0_0.distcp").read_bytes()),
            "__0_0.distcp: checksum mismatch (corrupted or from another checkpoint)",
        ),
        (lambda p: (p / "stray.distcp").write_bytes(b"x"), "stray.distcp: not recorded in the manifest"),
        (lambda p: os.truncate(p / "__0_0.distcp", 100), "__0_0.distcp: size 100 != "),
    ],
    ids=["flipped-byte", "foreign-file", "extra-file", "truncated"],
)
def test_export_refuses_a_damaged_checkpoint(two_steps, tmp_path, damage, problem):
    """Export verifies like load: before, a flipped byte or another step's file exported silently."""
    path = two_steps[1]
    assert (path / "__0_0.distcp").stat().st_size == (two_steps[0] / "__0_0.distcp").stat().st_size
    damage(path)
    with pytest.raises(ValueError, match=rf"{re.escape(problem)}.*not exporting it.*shardbridge ckpt verify"):
        ck.export_safetensors(path, tmp_path / "hf", progress=False)
    assert not (tmp_path / "hf").exists()
    if "checksum" in problem:  # verify=False: sizes and listing only, documented
        ck.export_safetensors(path, tmp_path / "hf", progress=False, verify=False)
    else:
        with pytest.raises(ValueError, match=re.escape(problem)):
            ck.export_safetensors(path, tmp_path / "hf", progress=False, verify=False)


def test_export_verify_must_be_a_bool(two_steps, tmp_path):
    with pytest.raises(ValueError, match="verify='yes' must be True"):
        ck.export_safetensors(two_steps[1], tmp_path / "hf", progress=False, verify="yes")


# --------------------------------------------------------------------------- the output folder


def _user_folder(out):
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    (out / "tokenizer.json").write_text("{}")
    for i in (1, 2, 3):
        (out / f"model-0000{i}-of-00003.safetensors").write_bytes(b"old")
    (out / "model.safetensors.index.json").write_text('{"old": true}')


def test_export_refuses_a_non_empty_folder(two_steps, tmp_path):
    """Before: a user's model folder was silently overwritten (index replaced, old shards left)."""
    out = tmp_path / "hf"
    _user_folder(out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ValueError, match=r"is not empty .*overwrite=True"):
        ck.export_safetensors(two_steps[1], out, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_export_overwrite_replaces_only_its_own_files(two_steps, tmp_path):
    out = tmp_path / "hf"
    _user_folder(out)
    ck.export_safetensors(two_steps[1], out, progress=False, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
    ]
    assert (out / "config.json").read_text() == '{"mine": true}'
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}
    # exporting again into its own output: the same files
    ck.export_safetensors(two_steps[0], out, progress=False, overwrite=True)
    assert len(list(out.iterdir())) == 4


def test_export_overwrite_refuses_a_single_file_model(two_steps, tmp_path):
    """``model.safetensors`` would be loaded by from_pretrained instead of the new index: not ours to delete."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(ValueError, match=r"model\.safetensors.*from_pretrained"):
        ck.export_safetensors(two_steps[1], out, progress=False, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]


def test_export_into_an_empty_folder_and_empty_path(two_steps, tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    ck.export_safetensors(two_steps[1], tmp_path / "empty", progress=False)
    monkeypatch.chdir(tmp_path / "empty")
    for bad in ("", "  "):
        with pytest.raises(ValueError, match="out_dir=.* is empty"):
            ck.export_safetensors(two_steps[1], bad, progress=False)
    assert len(list((tmp_path / "empty").iterdir())) == 2


def test_a_tied_model_exports_its_weight_once_and_from_pretrained_ties_it_again(tmp_path):
    """A tied-embedding model's export wrote ``lm_head.weight`` beside ``model.embed_tokens.weight``
    (593 MiB more for Qwen3-0.6B in fp32). Now once, as ``save_pretrained`` writes a tied model;
    transformers' ``from_pretrained`` ties the head again and gives the same logits."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ck.save(tmp_path / "c", model=model)
    index = ck.export_safetensors(tmp_path / "c", tmp_path / "hf", progress=False)
    config.save_pretrained(tmp_path / "hf")
    weight_map = json.loads(index.read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map and "model.embed_tokens.weight" in weight_map
    unique = {id(p): p for p in model.parameters()}.values()  # each tensor once: the oracle of the size
    assert json.loads(index.read_text())["metadata"]["total_size"] == sum(p.numel() * p.element_size() for p in unique)
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)
