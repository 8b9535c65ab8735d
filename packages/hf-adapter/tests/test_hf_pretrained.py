"""Pretrained weights, shard-on-read (``_pretrained``), through ShardbridgeAccelerator on 4 gloo ranks.

Oracles: the ``save_pretrained`` model itself (``full_tensor()`` of every parameter equals it,
``torch.equal``), its unsharded first-step loss on the global batch, and the bytes each rank read.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402
from shardbridge import ParallelDims  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402

DP2_TP2 = {"dp_shard": 2, "tp": 2}


def _save(folder, tied: bool) -> torch.nn.Module:
    model = H.tiny_model("llama", seed=0, tie_word_embeddings=tied)
    model.save_pretrained(folder, max_shard_size="150KB")  # several shards + index
    return model


def _load(folder: str, empty: str, dims: dict) -> dict:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    acc = H.sb_accelerator(ParallelDims(**dims))
    # init_empty_weights: parameters on meta, RoPE buffers real, ties lost (prepare re-ties).
    # torch.device("meta"): everything on meta (prepare recomputes RoPE's inv_freq).
    with init_empty_weights() if empty == "init_empty_weights" else torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    try:
        model(input_ids=H.local_batch(1, 0, 2))
        guard = "no error"
    except RuntimeError as exc:
        guard = str(exc)
    acc.load_pretrained(folder)
    # Again after a forward (no backward): FSDP2 then registers the unsharded parameters, whose
    # storage the reshard frees -- the load must write into the shards (it once wrote into freed
    # storage: a segfault).
    model(input_ids=H.local_batch(1, 0, 2))
    report = acc.load_pretrained(folder)
    full = H.full_params(model)
    losses = H.train_steps(acc, model, opt, 1)
    return {
        "guard": guard,
        "full": full,
        "losses": losses,
        "bytes": report.bytes_read,
        "total": report.checkpoint_bytes,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


# Every world size: one process (no FSDP2, no TP), tp only (no FSDP2), dp only, dp x tp. A tied folder
# once failed in one process ("'lm_head.weight' not in the checkpoint": to_empty untied the embedding).
LAYOUTS = {"1": {}, "tp2": {"tp": 2}, "dp4": {"dp_shard": 4}, "dp2_tp2": DP2_TP2}


@pytest.mark.parametrize(
    ("tied", "empty", "layout"),
    [
        (False, "init_empty_weights", "dp2_tp2"),
        (True, "init_empty_weights", "dp2_tp2"),
        (True, "meta", "dp2_tp2"),
        (True, "meta", "1"),
        (True, "init_empty_weights", "1"),
        (False, "meta", "1"),
        (True, "meta", "tp2"),
        (True, "meta", "dp4"),
    ],
    ids=lambda v: {True: "tied", False: "untied"}.get(v, v) if isinstance(v, bool) else v,
)
def test_load_pretrained_shard_on_read_matches_the_unsharded_model(tmp_path, tied, empty, layout):
    ref = _save(tmp_path / "hf", tied)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 2
    dims = LAYOUTS[layout]
    world = math.prod(dims.values())
    results = run_distributed(_load, str(tmp_path / "hf"), empty, dims, world_size=world, timeout=180)
    ids = H.global_batch(1, dims.get("dp_shard", 1))  # the batch every dp rank's share comes from
    with torch.no_grad():
        ref_loss = ref(input_ids=ids, labels=ids).loss.item()
    for rank, r in enumerate(results):
        assert "call accelerator.load_pretrained(path) after prepare()" in r["guard"]
        for name, p in ref.named_parameters():
            assert torch.equal(r["full"][name], p), (rank, name)
        assert r["tied"] == tied
        torch.testing.assert_close(r["losses"][0], ref_loss, rtol=1e-5, atol=1e-6)
        # A rank reads ~1/world of the weights (norms replicated over tp: 1/dp of them); one process all.
        assert r["bytes"] <= (1 / world + 0.05) * r["total"], (rank, r["bytes"], r["total"])


def _load_moe(folder: str, dims: dict) -> dict:
    """Build on meta, prepare in ``dims`` (ep from the dims), load; which expert keys this rank read."""
    from accelerate import init_empty_weights
    from shardbridge import pretrained
    from shardbridge_hf import HFConfig
    from transformers import AutoConfig, AutoModelForCausalLM

    dims = dict(dims)
    acc = H.sb_accelerator(ParallelDims(**{k: v for k, v in dims.items() if k != "ep"}), config=HFConfig(ep_size=dims.get("ep", 1)))
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    read_keys: set[str] = set()
    original = pretrained._read

    def recording(handle, key, offsets, sizes):
        read_keys.add(key)
        return original(handle, key, offsets, sizes)

    pretrained._read = recording
    try:
        report = acc.load_pretrained(folder)
    finally:
        pretrained._read = original
    return {
        "full": H.full_params(model),
        "experts_read": sorted(k for k in read_keys if ".experts." in k),
        "bytes": report.bytes_read,
        "total": report.checkpoint_bytes,
    }


MOE = {
    # qwen3_moe: mlp.experts.N.{gate,up,down}_proj.weight; mixtral: renamed too (block_sparse_moe -> mlp), w1/w3/w2
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, head_dim=8),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8),
}


# Each layout: its ParallelDims (ep included), and the experts rank r holds (so must read).
MOE_LAYOUTS = {
    "dp4_ep4": ({"dp_shard": 4, "ep": 4}, lambda r: {r}),
    # ep rank r % 2 holds experts {2j, 2j+1}; FSDP2 splits those 2 over efsdp (rank r // 2) on dim 0:
    # (_StridedShard(0, sf=2), Shard(0)) on (efsdp, ep), one whole expert per rank
    "dp4_ep2": ({"dp_shard": 4, "ep": 2}, lambda r: {2 * (r % 2) + r // 2}),
    # the TP plan (ep=1): FSDP2 on the expert dim over dp_shard=2, [gate; up] rows over tp
    "dp2_tp2": ({"dp_shard": 2, "tp": 2}, lambda r: {2 * (r // 2), 2 * (r // 2) + 1}),
}

# CI (budget): mixtral (renamed keys and merged experts) at ep=4; every pair with SHARDBRIDGE_MOE_MATRIX=all.
_MOE_CASES = (
    [(a, layout) for a in MOE for layout in MOE_LAYOUTS]
    if os.environ.get("SHARDBRIDGE_MOE_MATRIX") == "all"
    else [("mixtral", "dp4_ep4")]
)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout"), _MOE_CASES)
def test_per_expert_moe_checkpoint_loads_shard_on_read(tmp_path, arch, layout):
    """A hub-style folder (one tensor per expert, as transformers' own save_pretrained writes it) into
    the fused experts: each rank reads the tensors of the experts it holds and no other (at ep=4
    its own expert; at ep=2 x efsdp=2 one expert of its ep rank's two; under the TP plan, FSDP2 on
    the expert dim over dp_shard=2 and packed [gate; up] rows over tp, a slice of the two experts
    of its dp shard)."""
    from safetensors import safe_open

    ref = H.tiny_model(arch, seed=0, **MOE[arch])
    ref.save_pretrained(tmp_path / "hf", max_shard_size="200KB")
    keys = set()
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            keys |= set(h.keys())
    assert any(".experts.3." in k for k in keys) and not any("gate_up_proj" in k for k in keys)  # one per expert
    dims, held = MOE_LAYOUTS[layout]
    results = run_distributed(_load_moe, str(tmp_path / "hf"), dims, world_size=4, timeout=240)
    for rank, r in enumerate(results):
        for name, p in ref.named_parameters():
            assert torch.equal(r["full"][name], p), (rank, name)
        experts = {int(k.split(".experts.")[1].split(".")[0]) for k in r["experts_read"]}
        assert experts == held(rank), (rank, experts)
        assert r["bytes"] < 0.35 * r["total"], (rank, r["bytes"], r["total"])


# -- which files: the ones from_pretrained reads (issue 28, item 2; [Note: file selection]) -------


def _two_models_in_one_folder(tmp_path, *, leftover: bool):
    """A (seed 1) in ``model.safetensors``; beside it B's (seed 2) index and shards, the shards deleted
    when ``leftover`` (an index left over from an earlier sharded save)."""
    import shutil

    H.tiny_model("llama", seed=1).save_pretrained(tmp_path / "a")
    H.tiny_model("llama", seed=2).save_pretrained(tmp_path / "b", max_shard_size="150KB")
    folder = tmp_path / "f"
    shutil.copytree(tmp_path / "a", folder)
    for f in (tmp_path / "b").glob("model*.safetensors*"):
        if not (leftover and f.name.startswith("model-")):
            shutil.copy(f, folder / f.name)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


def _load_one_rank(folder: str) -> dict:
    """ShardbridgeAccelerator.load_pretrained into a model built on meta and prepared (one rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    acc = H.sb_accelerator(ParallelDims())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    model, _ = acc.prepare(model, torch.optim.AdamW(model.parameters()))
    acc.load_pretrained(folder)
    return H.full_params(model)


@pytest.mark.parametrize("leftover", [False, True], ids=["single+index", "single+leftover-index"])
def test_load_pretrained_reads_the_file_from_pretrained_reads(tmp_path, leftover):
    """Oracle: transformers' from_pretrained on the same folder. Before: the adapter read B's shards
    (both present) or refused the folder (the index names deleted shards)."""
    from transformers import AutoModelForCausalLM

    folder = _two_models_in_one_folder(tmp_path, leftover=leftover)
    oracle = dict(AutoModelForCausalLM.from_pretrained(folder).named_parameters())
    other = H.tiny_model("llama", seed=2).state_dict()
    assert not torch.equal(oracle["model.embed_tokens.weight"], other["model.embed_tokens.weight"])  # two models
    (got,) = run_distributed(_load_one_rank, str(folder), world_size=1, timeout=180)
    assert set(got) == set(oracle)
    for key, value in oracle.items():
        assert torch.equal(got[key], value), key
