"""The architecture sweep (``hf_sweep.py``) as a test: train, match one process gradient by gradient, resume, reshard, export.

Default run: ``hf_sweep.CI_ARCHS`` (``match_hsdp_tp2`` for ``hf_sweep.CI_HSDP``) and ``hf_sweep.CI_VARIANTS``. ``SHARDBRIDGE_HF_SWEEP=all`` runs
every ``*ForCausalLM`` of the installed transformers whose config has a TP plan (those with only
an EP plan and the documented exceptions of ``hf_sweep.KNOWN`` are listed, not run: docs/hf.md,
"Architecture sweep") and every variant of each; ``SHARDBRIDGE_HF_SWEEP=a,b`` runs the named ones.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_sweep as S  # noqa: E402


def _selected() -> list[str]:
    choice = os.environ.get("SHARDBRIDGE_HF_SWEEP", "")
    if choice == "all":
        return sorted(a for a in S.sweep_archs() if S.skip_reason(a) is None)
    if choice:
        return [a.strip() for a in choice.split(",") if a.strip()]
    return list(S.CI_ARCHS)


def _selected_variants() -> list[tuple[str, str]]:
    if not os.environ.get("SHARDBRIDGE_HF_SWEEP"):
        return list(S.CI_VARIANTS)
    return [(a, v) for a in _selected() for v in S.variants(a)]


def test_ci_slice_is_runnable():
    archs = S.sweep_archs()
    assert set(S.CI_ARCHS) <= set(archs) and all(S.skip_reason(a) is None for a in S.CI_ARCHS)
    assert set(S.CI_HSDP) <= set(S.CI_ARCHS)
    for arch, variant in S.CI_VARIANTS:
        assert S.skip_reason(arch) is None and variant in S.variants(arch), (arch, variant)


def test_architectures_not_run_say_why():
    """Every architecture with a plan is run or listed with its reason; only-EP ones point to the EP sweep."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    for arch in S.sweep_archs():
        config_cls = getattr(transformers, CONFIG_MAPPING_NAMES[arch])
        reason = S.skip_reason(arch)
        if not getattr(config_cls, "base_model_tp_plan", None):
            assert reason == S.NEEDS_EP, arch
        else:
            assert reason is None or arch in S.KNOWN, arch


def test_variants_come_from_the_config_fields():
    """The knobs are read from each config class: MLA without q-LoRA only where q_lora_rank exists, etc."""
    v2 = S.variants("deepseek_v2")
    assert v2["mla_without_q_lora"] == {"q_lora_rank": None} and "head_dim" not in v2  # MLA: head_dim is rope
    llama = S.variants("llama")
    assert set(llama) == {"odd_vocab", "head_dim", "tied"}
    assert llama["odd_vocab"]["vocab_size"] % 2 == 1
    assert S.tiny_config("llama", **llama["head_dim"]).head_dim * 8 != S.tiny_config("llama").hidden_size
    shared = S.variants("granitemoeshared")["shared_experts"]
    assert S.tiny_config("granitemoeshared").shared_intermediate_size == 0 < shared["shared_intermediate_size"]
    assert "shared_experts" not in S.variants("qwen2_moe")  # the tiny config already has them (BASE)


def test_gradient_comparison_catches_a_scaled_gradient():
    """The check the sweep relies on: one parameter's gradient x2 (DeepSeek-V2's tp x kv_a_layernorm) fails it."""
    g = {"a.weight": torch.randn(64, 64), "b.norm.weight": torch.randn(64) * 1e-2, "c.zero": torch.zeros(3)}
    ref = {"losses": [1.0], "grads": g, "grads64": {n: t.double() for n, t in g.items()}}
    total = sum(float(t.norm()) ** 2 for t in g.values()) ** 0.5
    same = S.compare_step1({"losses": [1.0], "grads": {n: t.clone() for n, t in g.items()}, "norm": total}, ref)
    assert same.verdict() == "pass" and same.max_rel == 0.0 and same.noise == 0.0
    doubled = {**g, "b.norm.weight": 2 * g["b.norm.weight"]}
    norm2 = sum(float(t.norm()) ** 2 for t in doubled.values()) ** 0.5
    bad = S.compare_step1({"losses": [1.0], "grads": doubled, "norm": norm2}, ref)
    assert "b.norm.weight: rel err 1.0e+00" in bad.verdict(), bad.verdict()
    missing = S.compare_step1({"losses": [1.0], "grads": {"a.weight": g["a.weight"]}, "norm": total}, ref)
    assert "b.norm.weight: rel err 1.0e+00 (norm 0.000e+00" in missing.verdict(), missing.verdict()
    off_norm = S.compare_step1({"losses": [1.0], "grads": g, "norm": total * 1.01}, ref)
    assert "total grad norm" in off_norm.verdict()


@pytest.mark.parametrize("model_type", _selected())
def test_architecture(model_type):
    hsdp = bool(os.environ.get("SHARDBRIDGE_HF_SWEEP")) or model_type in S.CI_HSDP
    result = S.run_arch(model_type, hsdp=hsdp)
    expected = [c for c in S.CHECKS if hsdp or c != "match_hsdp_tp2"]
    assert result.checks == dict.fromkeys(expected, "pass"), result.checks


@pytest.mark.parametrize(("model_type", "variant"), _selected_variants())
def test_variant(model_type, variant):
    result = S.run_variant(model_type, variant)
    assert result.passed(), result.checks


# CI: qwen3_moe; with SHARDBRIDGE_HF_SWEEP set (any value), also mixtral and gpt_oss.
_AUX_ARCHS = ["qwen3_moe"] + (["mixtral", "gpt_oss"] if os.environ.get("SHARDBRIDGE_HF_SWEEP") else [])


@pytest.mark.parametrize("model_type", _AUX_ARCHS)
def test_moe_load_balancing_loss_matches_the_per_dp_rank_oracle(model_type):
    """Router + load-balancing loss under FSDP2 x TP equal one process computing it per dp rank.

    The aux loss is a product of batch means (token fraction x router probability per expert),
    so it is computed per dp rank's rows (as DDP does); against the global batch it differs by
    ~4e-4 relative (docs/hf.md, "MoE and expert parallelism").
    """
    from shardbridge.testing import run_distributed

    got = run_distributed(S.first_step, model_type, world_size=4, timeout=180, output_router_logits=True)[0]
    ref = S.reference_per_dp_rank(model_type, output_router_logits=True)
    assert abs(got["losses"][0] - ref["loss"]) <= S.ATOL + S.RTOL * abs(ref["loss"])
    assert any(n.endswith(("mlp.gate.weight", "router.weight")) for n in ref["grads"])  # the router is trained
    for name, g in ref["grads"].items():
        torch.testing.assert_close(got["grads"][name], g, rtol=S.RTOL, atol=S.ATOL, msg=name)


def test_losses_match_either_oracle_and_nothing_else():
    """fp32 reference or float64 reference: a loss list close to one passes, one off both fails."""
    ref = {"losses": [5.55, 5.530, 5.507], "losses64": [5.55, 5.525, 5.500]}  # 1e-3 apart: beyond rtol 1e-4
    assert S.losses_match([5.55, 5.530, 5.507], ref)
    assert S.losses_match([5.55, 5.525, 5.500], ref)  # the float64 run's, not the fp32 one's
    assert not S.losses_match([5.55, 5.530, 5.500], ref)  # mixes them: step 2 of one, step 3 of the other
    assert not S.losses_match([5.55, 5.540, 5.507], ref)
    assert not S.losses_match([5.55, 5.525, 5.500], {**ref, "losses64": None})  # no float64 run: fp32 only
