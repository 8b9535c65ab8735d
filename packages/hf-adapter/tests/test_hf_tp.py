"""The model's TP plan read from transformers and expanded to module FQNs (no process group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("transformers")

import hf_helpers as H  # noqa: E402
from shardbridge_hf import check_tp_divides, fsdp_units, resolve_tp_plan  # noqa: E402


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_auto_plan_covers_every_projection(arch):
    model = H.tiny_model(arch)
    plan = resolve_tp_plan(model)
    # transformers >= 5.x (5.23 here) also plans the embedding and the head; 5.0 plans only the
    # decoder layers (its class-level "lm_head: colwise_rep" is not part of model.tp_plan).
    declared = {k: v for k, v in model.tp_plan.items() if "layers" not in k}
    assert {k: plan[k] for k in declared} == declared
    assert declared in ({}, {"lm_head": "colwise_gather_output", "model.embed_tokens": "embedding_rowwise"})
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            assert plan[f"model.layers.{i}.self_attn.{proj}"] == "colwise"
        assert plan[f"model.layers.{i}.self_attn.o_proj"] == "rowwise"
        assert plan[f"model.layers.{i}.mlp.down_proj"] == "rowwise"


def test_explicit_plan_and_errors():
    model = H.tiny_model()
    plan = resolve_tp_plan(model, {"model.layers.*.mlp.up_proj": "colwise"})
    assert sorted(plan) == ["model.layers.0.mlp.up_proj", "model.layers.1.mlp.up_proj"]
    with pytest.raises(ValueError, match="matches no module"):
        resolve_tp_plan(model, {"model.layers.*.mlp.nope": "colwise"})
    with pytest.raises(NotImplementedError, match="supported"):
        resolve_tp_plan(model, {"model.layers.*.mlp.up_proj": "no_such_style"})


def test_tp_must_split_whole_heads():
    cfg = H.tiny_config(num_key_value_heads=2)
    check_tp_divides(cfg, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads\(2\) is not divisible by tp\(4\)"):
        check_tp_divides(cfg, 4)
    check_tp_divides(H.tiny_config(tie_word_embeddings=True), 2)  # tied embeddings: test_hf_styles.py


def test_fsdp_units_embed_layers_then_norm_and_head():
    model = H.tiny_model()
    units = fsdp_units(model)
    assert units[0] is model.model.embed_tokens
    assert units[1:3] == list(model.model.layers)
    assert units[3] == [model.model.norm, model.lm_head]


def _mla_without_q_lora() -> list[str]:
    import hf_sweep as S

    return [a for a in sorted(S.sweep_archs()) if "mla_without_q_lora" in S.variants(a)]


def test_mla_query_without_q_lora_is_sharded_like_q_b_proj():
    """Every MLA architecture that can drop q-LoRA: ``q_proj`` is sharded exactly like the keys and values.

    Where the plan shards the attention (``kv_b_proj`` colwise) the single ``q_proj`` is colwise;
    where it does not (Bailing-hybrid plans only the MLP) it stays unsharded.

    GLM-4-MoE-Lite's plan (transformers 5.24) names only ``q_b_proj``; left replicated, ``q_proj``
    made every head while keys and values held this rank's (a shape error at dp2 x tp2).
    """
    import hf_sweep as S
    import torch
    from transformers import AutoModelForCausalLM

    archs = _mla_without_q_lora()
    assert {"deepseek_v2", "glm4_moe_lite"} <= set(archs), archs
    for arch in archs:
        config = S.tiny_config(arch, q_lora_rank=None)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        plan = resolve_tp_plan(model)
        queries = [n for n, _ in model.named_modules() if n.endswith("self_attn.q_proj")]
        assert queries, arch
        for q in queries:
            kv = plan.get(q.replace("q_proj", "kv_b_proj"))
            assert plan.get(q) == kv or (kv is None and plan.get(q) == "replicated_with_grad_allreduce"), (arch, q)


def test_public_functions_refuse_misuse_by_parameter():
    """Swapped or half-built arguments: one TypeError naming the parameter and the fix (issue 38), before any work."""
    from shardbridge import ParallelDims
    from shardbridge_hf import HFConfig, apply_tp, cp_batch, enable_cp, parallelize

    model = H.tiny_model()
    cases = [
        (lambda: parallelize(HFConfig(), model, HFConfig()), r"^parallelize\(model=\.\.\.\): expected a Module, got a HFConfig; were `model` and `config` swapped\?$"),
        (lambda: parallelize(model, ParallelDims(tp=2), HFConfig()), r"^parallelize\(pm=\.\.\.\): expected a ParallelMesh, got a ParallelDims; call \.build_mesh"),
        (lambda: parallelize(model, None, {"precision": "bf16"}), r"^parallelize\(pm=\.\.\.\)"),
        (lambda: apply_tp(model, ParallelDims(tp=2), {}), r"^apply_tp\(tp_mesh=\.\.\.\): expected a DeviceMesh, got a ParallelDims$"),
        (lambda: enable_cp(model, 2), r"^enable_cp\(cp_mesh=\.\.\.\): expected a DeviceMesh, got an int$"),
        (lambda: cp_batch(model, None), r"^cp_batch\(batch=\.\.\.\): expected a Mapping, got a LlamaForCausalLM$"),
        (lambda: resolve_tp_plan(model, 3), r"^resolve_tp_plan\(plan=\.\.\.\): expected a str or Mapping, got an int$"),
    ]  # fmt: skip
    for call, message in cases:
        with pytest.raises(TypeError, match=message):
            call()
