"""Every transformers TP style mapped (or refused by name), per-head norms, tied embeddings under FSDP2 x TP.

Oracles: transformers' own ``ParallelInterface`` registry (the style list), a single-process model
on the global batch (losses, gradients), ``torch.equal`` (one tied parameter, checkpoint entries),
``from_pretrained`` (export).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402
from shardbridge import ParallelDims  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402
from shardbridge_hf._tp import REFUSED_STYLES, SUPPORTED_STYLES, installed_hf_styles, resolve_tp_plan  # noqa: E402

DP2_TP2 = {"dp_shard": 2, "tp": 2}


# -- the style registry -----------------------------------------------------------------------


def test_every_installed_style_is_mapped_or_refused():
    installed = installed_hf_styles()
    assert {"colwise", "rowwise", "replicated_with_grad_allreduce", "moe_tp_experts"} <= installed
    unknown = installed - set(SUPPORTED_STYLES) - set(REFUSED_STYLES)
    assert not unknown, f"transformers registers TP styles shardbridge_hf neither maps nor refuses: {sorted(unknown)}"


def test_expert_parallel_styles_are_refused_with_the_workaround():
    """In a TP plan: they belong in the EP plan (ep_size > 1, test_hf_ep.py)."""
    model = H.tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    with pytest.raises(NotImplementedError, match=r"'grouped_gemm'.*shardbridge.ep_plan.*ep_size > 1.*moe_tp_experts"):
        resolve_tp_plan(model, {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"})


def test_plan_entries_may_name_parameters():
    model = H.tiny_model("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)
    plan = resolve_tp_plan(model)
    assert plan["model.layers.1.mlp.experts.gate_up_proj"] == "packed_colwise"
    assert plan["model.layers.1.mlp.experts"] == "moe_tp_experts"


def test_unplanned_per_head_norm_gets_the_data_flow_rule():
    model = H.tiny_model("qwen3", head_dim=8)
    auto = resolve_tp_plan(model)  # the model's own plan names q_norm / k_norm
    assert auto["model.layers.0.self_attn.q_norm"] == "replicated_with_grad_allreduce"
    user = {
        "model.layers.*.self_attn.q_proj": "colwise",
        "model.layers.*.self_attn.k_proj": "colwise",
        "model.layers.*.self_attn.v_proj": "colwise",
        "model.layers.*.self_attn.o_proj": "rowwise",
    }
    # A user plan that leaves them out: they sit in a block with colwise and rowwise layers, so they
    # get the same rule (their gradients all-reduced iff partial, [Note: partial gradients over tp]).
    plan = resolve_tp_plan(model, user)
    assert len(plan) == 2 * 6
    assert plan["model.layers.1.self_attn.k_norm"] == "replicated_with_grad_allreduce"


# -- per-head norms: one Replicate DTensor on the tp mesh, no drift ---------------------------


def _head_norms() -> dict:
    from torch.distributed.tensor import DTensor

    acc = H.sb_accelerator(ParallelDims(**DP2_TP2))
    model = H.tiny_model("qwen3", seed=0, head_dim=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    H.train_steps(acc, model, opt, 3)
    w = model.model.layers[0].self_attn.q_norm.weight
    return {
        "dtensor": isinstance(w, DTensor),
        "mesh": w.device_mesh.mesh_dim_names,
        "placements": [type(p).__name__ for p in w.placements],
        "full": w.full_tensor(),
    }


def test_head_norms_are_replicate_dtensors_equal_on_every_rank():
    results = run_distributed(_head_norms, world_size=4, timeout=180)
    for r in results:
        assert r["dtensor"] and r["mesh"] == ("dp_shard_cp", "tp")
        assert r["placements"][1] == "Replicate"
        assert torch.equal(r["full"], results[0]["full"])
    assert not torch.equal(results[0]["full"], torch.ones_like(results[0]["full"]))  # it did train


# -- tied embeddings with tp > 1 ----------------------------------------------------------------

TIED = ("llama", "qwen2")
STEPS = 3


def _tied(arch: str, root: str) -> dict:
    import torch.distributed as dist
    from shardbridge import checkpoint
    from torch.distributed.tensor import Shard

    acc = H.sb_accelerator(ParallelDims(**DP2_TP2))
    model = H.tiny_model(arch, seed=dist.get_rank(), tie_word_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = acc.prepare(model, opt)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    pm = acc.parallel_mesh
    ids = H.local_batch(1, pm["dp"].get_local_rank(), pm.dims.degree("dp"))
    acc.backward(model(input_ids=ids, labels=ids).loss)
    grad = embed.grad.full_tensor()
    opt.step()
    opt.zero_grad()
    acc.step = 1
    losses = H.train_steps(acc, model, opt, STEPS - 1, start=1)
    acc.save_state(f"{root}/ckpt")
    acc.export_pretrained(f"{root}/ckpt", f"{root}/hf")
    with torch.no_grad():
        logits = model(input_ids=H.global_batch(99, 1)).logits
    info = checkpoint.inspect(f"{root}/ckpt")
    keys = {k: dict(v) for k, v in info.layout.get("tensors", {}).items()}
    return {
        "same_object": embed is head,
        "tp_shard0": embed.placements[1] == Shard(0),
        "num_params": len(list(model.parameters())),
        "grad": grad,
        "losses": losses,
        "weight": embed.full_tensor(),
        "logits": logits,
        "keys": keys,
    }


def _one_process_tied(arch: str) -> dict:
    model = H.tiny_model(arch, seed=0, tie_word_embeddings=True)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, grad = [], None
    for step in range(1, STEPS + 1):
        ids = H.global_batch(step, 2)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 1:
            grad = model.model.embed_tokens.weight.grad.clone()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grad": grad, "num_params": len(list(model.parameters())), "weight": model.lm_head.weight}


@pytest.mark.parametrize("arch", TIED)
def test_tied_embeddings_stay_one_parameter_under_fsdp2_x_tp(arch, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    ref = _one_process_tied(arch)
    results = run_distributed(_tied, arch, str(tmp_path), world_size=4, timeout=240)
    for r in results:
        assert r["same_object"], "lm_head.weight must be the embedding's DTensor"
        assert r["tp_shard0"]  # vocab rows over tp, for both uses
        assert r["num_params"] == ref["num_params"]
        torch.testing.assert_close(r["grad"], ref["grad"], rtol=1e-4, atol=1e-6)  # both uses' gradient, summed
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"][1:]), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(r["weight"], ref["weight"], rtol=1e-4, atol=1e-5)
    r0 = results[0]
    tied = {
        k: v for k, v in r0["keys"].items() if ("embed_tokens" in k or "lm_head" in k) and not k.startswith("optim")
    }
    # ONE checkpoint entry: stored under the embedding's name, lm_head.weight recorded as its alias
    # ([Note: tied tensors] in the core's checkpoint/_state.py).
    stored = sorted(k for k, v in tied.items() if v.get("stored_as") != "tied")
    assert stored == ["model.embed_tokens.weight"], tied
    assert tied["lm_head.weight"].get("tied_to") == "model.embed_tokens.weight", tied
    written = set()
    for f in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            written |= set(fh.keys())
    assert "model.embed_tokens.weight" in written
    exported = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=H.global_batch(99, 1)).logits, r0["logits"], rtol=1e-4, atol=1e-5)
