"""Shard-on-read loading of a from_pretrained folder (``shardbridge.pretrained``).

Oracles: the unsharded reference model's tensors (``full_tensor()`` of every parameter after the
load must equal them, ``torch.equal``), safetensors' own ``load_file`` (what the folder holds), and
the bytes each rank read (its slices only).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from shardbridge import ParallelDims
from shardbridge.checkpoint.state._components import component_fqn
from shardbridge.fused import fused_params, split_fused
from shardbridge.models import Llama, LlamaConfig, hf_llama_name, parallelize_llama, synthetic_batch
from shardbridge.pretrained import load_pretrained, read_index
from shardbridge.testing import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

# vocab 250: the embedding and output rows split unevenly over tp=2 x dp=2 (63/62/63/62).
CONFIG = LlamaConfig.tiny(vocab_size=250)


def _reference(seed: int = 0) -> Llama:
    model = Llama(CONFIG)
    model.init_weights(seed=seed)
    return model


def _hf_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The reference model under Hugging Face names, fused params split into their components."""
    fused = fused_params(model)
    out = {}
    for fqn, p in model.named_parameters():
        if fqn in fused:
            for comp, t in split_fused(p.detach(), fused[fqn], 1).items():
                out[hf_llama_name(component_fqn(fqn, comp))] = t.contiguous()
        else:
            out[hf_llama_name(fqn)] = p.detach().clone()
    return out


def _write_folder(folder, tensors: dict[str, torch.Tensor], num_files: int = 3) -> None:
    """A save_pretrained-style folder: ``num_files`` safetensors shards and the index."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(tensors)
    weight_map = {}
    for i in range(num_files):
        name = f"model-{i + 1:05d}-of-{num_files:05d}.safetensors"
        part = {k: tensors[k] for k in keys[i::num_files]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained") / "hf"
    _write_folder(root, _hf_tensors(_reference()))
    return root


def _load_sharded(folder: str, dims: dict) -> dict:
    pm = ParallelDims(**dims).build_mesh("cpu")
    model = _reference(seed=7)  # different weights: everything must come from the folder
    parallelize_llama(model, pm)
    report = load_pretrained(model, folder, name_map=hf_llama_name)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}
    dp = pm["dp"]
    tokens, labels = synthetic_batch(CONFIG, 4, 16, dp_rank=dp.get_local_rank(), dp_size=dp.size())
    logits = model(tokens)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    return {"full": full, "bytes": report.bytes_read, "total": report.checkpoint_bytes, "loss": loss.item()}


@pytest.mark.parametrize("dims", [{"dp_shard": 2, "tp": 2}, {"dp_shard": 4}], ids=["dp2_tp2", "dp4"])
def test_every_rank_reads_its_slices_and_the_model_equals_the_reference(folder, dims):
    ref = _reference()
    results = run_distributed(_load_sharded, str(folder), dims, world_size=4, timeout=180)
    tokens, labels = synthetic_batch(CONFIG, 4, 16)
    with torch.no_grad():
        ref_losses = []
        for dp_rank in range(dims["dp_shard"]):
            t, lab = synthetic_batch(CONFIG, 4, 16, dp_rank=dp_rank, dp_size=dims["dp_shard"])
            ref_losses.append(torch.nn.functional.cross_entropy(ref(t).flatten(0, 1), lab.flatten()).item())
    fused = fused_params(ref)
    tp = dims.get("tp", 1)
    for rank, r in enumerate(results):
        for name, p in ref.named_parameters():
            got = r["full"][name]
            if name in fused:  # the DTensor global is in item coordinates: [q_0 k_0 v_0 | q_1 k_1 v_1]
                got = torch.cat(list(split_fused(got, fused[name], tp).values()), dim=fused[name].dim)
            assert torch.equal(got, p), (rank, name)  # fused qkv / gate_up assembled from q,k,v / gate,up
        # Each rank read about 1/4 of the checkpoint (norms replicated over tp are read twice).
        assert r["bytes"] < 0.3 * r["total"], (rank, r["bytes"], r["total"])
        dp_rank = rank // (4 // dims["dp_shard"])
        torch.testing.assert_close(r["loss"], ref_losses[dp_rank], rtol=1e-5, atol=1e-6)
    total = sum(t.numel() * t.element_size() for t in _hf_tensors(ref).values())
    assert results[0]["total"] == total
    assert sum(r["bytes"] for r in results) < 1.2 * total


def test_read_index_matches_safetensors(folder):
    index = read_index(folder)
    everything = {}
    for name in {f.name for f, _, _ in index.values()}:
        everything.update(load_file(folder / name))
    assert set(index) == set(everything)
    for key, (_, shape, dtype) in index.items():
        assert shape == tuple(everything[key].shape) and dtype == everything[key].dtype


def test_single_file_and_plain_model(tmp_path):
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    src = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    save_file({k: v.detach().contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    report = load_pretrained(model, tmp_path)
    assert report.num_tensors == 4 and report.bytes_read == report.checkpoint_bytes
    for (n, a), b in zip(model.state_dict().items(), src.state_dict().values()):
        assert torch.equal(a, b), n


def test_wrapped_model_reads_the_plain_names(tmp_path):
    """Activation checkpointing's wrapper adds names the folder does not have
    (``0._checkpoint_wrapped_module.weight``); a submodule merely named ``module`` keeps its name
    (torch.compile's ``_orig_mod``: test_state.py's wrapper test)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(4, 3), nn.ModuleDict({"module": nn.Linear(3, 2)}))

    src = build()
    save_file({k: v.detach().contiguous() for k, v in src.state_dict().items()}, str(tmp_path / "model.safetensors"))
    model = build()
    model = nn.Sequential(checkpoint_wrapper(model[0]), model[1])
    report = load_pretrained(model, tmp_path)
    assert report.num_tensors == 4
    for (n, a), b in zip(model.state_dict().items(), src.state_dict().values()):
        assert torch.equal(a, b), n


def test_tied_weight_loads_once_from_whichever_name_is_stored(tmp_path):
    model = nn.ModuleDict({"embed": nn.Embedding(5, 3), "head": nn.Linear(3, 5, bias=False)})
    model["head"].weight = model["embed"].weight
    w = torch.randn(5, 3)
    save_file({"embed.weight": w}, str(tmp_path / "model.safetensors"))
    report = load_pretrained(model, tmp_path)
    assert report.num_tensors == 1 and torch.equal(model["head"].weight, w)


def _write_one(tmp_path, tensors):
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


@pytest.mark.parametrize(
    ("tensors", "kwargs", "match"),
    [
        ({"weight": torch.zeros(3, 4)}, {}, r"1 model tensor\(s\) are not in the checkpoint: 'bias'.*name_map="),
        (
            {"weight": torch.zeros(3, 4), "bias": torch.zeros(3), "extra": torch.zeros(1)},
            {},
            r"1 checkpoint key\(s\) match no model tensor: 'extra'.*ignore_unexpected",
        ),
        (
            {"weight": torch.zeros(4, 3), "bias": torch.zeros(3)},
            {},
            r"'weight': checkpoint shape \(4, 3\), model 'weight' expects \(3, 4\)",
        ),
        (
            {"weight": torch.zeros(3, 4, dtype=torch.bfloat16), "bias": torch.zeros(3)},
            {},
            r"'weight': checkpoint dtype torch.bfloat16, model 'weight' is torch.float32; pass cast_dtype=True",
        ),
        ({"w": torch.zeros(3, 4), "bias": torch.zeros(3)}, {"name_map": {"weight": "w"}}, None),
        ({"weight": torch.ones(3, 4, dtype=torch.bfloat16), "bias": torch.ones(3)}, {"cast_dtype": True}, None),
        ({"weight": torch.ones(3, 4)}, {"ignore_missing": ["bias"]}, None),
    ],
    ids=["missing", "unexpected", "shape", "dtype", "name_map", "cast", "ignore_missing"],
)
def test_strict_checks_name_the_key_and_the_fix(tmp_path, tensors, kwargs, match):
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    folder = _write_one(tmp_path, tensors)
    if match is None:
        load_pretrained(model, folder, **kwargs)
        assert torch.equal(model.weight, next(iter(tensors.values())).float())
        return
    with pytest.raises(ValueError, match=match):
        load_pretrained(model, folder, **kwargs)
    assert torch.equal(model.weight, before)  # checked before anything is written


def test_integer_dtypes_are_never_cast(tmp_path):
    model = nn.Module()
    model.register_buffer("count", torch.zeros(2, dtype=torch.int64))
    folder = _write_one(tmp_path, {"count": torch.zeros(2, dtype=torch.int32)})
    with pytest.raises(ValueError, match="integer / bool tensors are never cast"):
        load_pretrained(model, folder, cast_dtype=True)


def test_malformed_folders_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing does not exist; pass the folder written by save_pretrained"):
        load_pretrained(nn.Linear(2, 2), tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="file is a file, not a folder"):
        load_pretrained(nn.Linear(2, 2), tmp_path / "file")
    (tmp_path / "file").unlink()
    with pytest.raises(ValueError, match="has neither model.safetensors.index.json nor model.safetensors"):
        load_pretrained(nn.Linear(2, 2), tmp_path)
    save_file({"weight": torch.zeros(2, 2)}, str(tmp_path / "a.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"weight": "../a.safetensors"}}))
    with pytest.raises(ValueError, match="must be a plain"):
        read_index(tmp_path)
    index.write_text(json.dumps({"weight_map": {"bias": "a.safetensors"}}))
    with pytest.raises(ValueError, match="that file has no such tensor"):
        read_index(tmp_path)
    index.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_index(tmp_path)
    (tmp_path / "b.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken")
    index.write_text(json.dumps({"weight_map": {"weight": "b.safetensors"}}))
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        read_index(tmp_path)


def test_meta_parameters_are_refused(tmp_path):
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    folder = _write_one(tmp_path, {"weight": torch.zeros(2, 2), "bias": torch.zeros(2)})
    with pytest.raises(ValueError, match="is on the meta device; materialise the model first"):
        load_pretrained(model, folder)
