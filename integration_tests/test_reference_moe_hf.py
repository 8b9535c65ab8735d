"""The reference MoE trained with expert parallelism -> checkpoint -> HF folder -> from_pretrained.

Oracles: transformers' own ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM`` loaded from the
export: its logits against the sharded model's, and its load-balancing loss
(``output_router_logits=True``, transformers' ``load_balancing_loss_func``) on the GLOBAL batch
against ``model.aux_loss`` of the sharded run, whose ranks each hold a slice of that batch. fp32.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from shardbridge import ParallelDims, checkpoint  # noqa: E402
from shardbridge.cp import cp_cross_entropy  # noqa: E402
from shardbridge.models import (  # noqa: E402
    MoEConfig,
    MoELlama,
    export_hf_moe,
    hf_moe_config,
    hf_moe_name,
    parallelize_moe,
    synthetic_batch,
)
from shardbridge.testing import run_distributed  # noqa: E402

MIXTRAL = MoEConfig.tiny(vocab_size=250, num_experts=8, top_k=2)
QWEN2_MOE = MoEConfig.tiny(num_experts=8, top_k=3, norm_topk_prob=False, shared_expert_intermediate_size=48)
CASES = {
    "mixtral_dp2_tp2_ep4": (MIXTRAL, dict(dp_shard=2, tp=2, ep=4), "MixtralForCausalLM"),
    "qwen2_moe_dp2_tp2_ep2": (QWEN2_MOE, dict(dp_shard=2, tp=2, ep=2), "Qwen2MoeForCausalLM"),
}
# CI runs Mixtral; SHARDBRIDGE_MOE_MATRIX=all (nox -s moe) both.
SELECTED = list(CASES) if os.environ.get("SHARDBRIDGE_MOE_MATRIX") == "all" else ["mixtral_dp2_tp2_ep4"]


def _train_and_save(path: str, config: MoEConfig, dims: dict):
    pm = ParallelDims(**dims).build_mesh("cpu")
    model = parallelize_moe(MoELlama(config, seed=0), pm)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm["dp"].size()
    for step in range(3):
        tokens, labels = synthetic_batch(config, 4, 16, step=step, dp_rank=dp_rank, dp_size=dp_size)
        loss = cp_cross_entropy(model(tokens), labels, pm) + config.router_aux_loss_coef * model.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(path, model=model, optimizer=opt, step=3)
    probe, _ = synthetic_batch(config, 2, 16, seed=7)
    with torch.no_grad():
        logits = model(probe)  # the same probe on every rank
        model(synthetic_batch(config, 4, 16, seed=9, dp_rank=dp_rank, dp_size=dp_size)[0])  # a slice each
    return (probe, logits, model.aux_loss.detach()) if dist.get_rank() == 0 else None


@pytest.mark.parametrize("case", SELECTED)
def test_expert_parallel_reference_moe_exports_to_from_pretrained(tmp_path, case):
    config, dims, architecture = CASES[case]
    probe, sharded_logits, sharded_aux = run_distributed(
        _train_and_save, str(tmp_path / "ckpt"), config, dims, world_size=4
    )[0]
    out = export_hf_moe(tmp_path / "ckpt", tmp_path / "hf", config, progress=False)
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == architecture
    with torch.no_grad():
        torch.testing.assert_close(hf(probe).logits, sharded_logits, rtol=1e-5, atol=1e-5)
        global_batch, _ = synthetic_batch(config, 4, 16, seed=9)
        hf_aux = hf(global_batch, output_router_logits=True).aux_loss
    torch.testing.assert_close(sharded_aux, hf_aux, rtol=1e-5, atol=0)
    # Every HF parameter came from the checkpoint (none left at its random init), experts fused.
    exported = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(exported) == {n for n, _ in hf.named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in exported


def test_load_balancing_loss_is_transformers_formula():
    """One process, no export: the loss equals load_balancing_loss_func on the same router logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    model = MoELlama(MIXTRAL)
    tokens, labels = synthetic_batch(MIXTRAL, 2, 8)
    logits = []
    hooks = [layer.feed_forward.router.register_forward_hook(lambda m, i, o: logits.append(o)) for layer in model.layers]
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    for hook in hooks:
        hook.remove()
    want = load_balancing_loss_func(tuple(logits), MIXTRAL.num_experts, MIXTRAL.top_k)
    torch.testing.assert_close(model.aux_loss, want, rtol=1e-6, atol=0)
    assert model.tokens_per_expert.shape == (MIXTRAL.num_layers, MIXTRAL.num_experts)
    assert int(model.tokens_per_expert.sum()) == MIXTRAL.num_layers * 16 * MIXTRAL.top_k


def test_names_and_configs_refuse_what_has_no_twin():
    assert hf_moe_name("layers.0.feed_forward.router.weight") == "model.layers.0.mlp.gate.weight"
    assert hf_moe_name("layers.2.feed_forward.shared_expert.down.weight") == "model.layers.2.mlp.shared_expert.down_proj.weight"
    with pytest.raises(ValueError, match="'layers.0.feed_forward.gate_up.weight' is not a reference-MoE checkpoint name"):
        hf_moe_name("layers.0.feed_forward.gate_up.weight")
    with pytest.raises(ValueError, match=r"norm_topk_prob=False without a shared expert has no transformers twin"):
        hf_moe_config(MoEConfig.tiny(norm_topk_prob=False))
    # the config transformers builds from it is the model's
    cfg = transformers.AutoConfig.for_model(**hf_moe_config(QWEN2_MOE))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 3, 32)
