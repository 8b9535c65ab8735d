"""Expert parallelism through the hf adapter: transformers' EP plans on the core ep axis.

``hf_ep_sweep.py`` holds the checks (train at dp_shard x ep and dp_shard x tp x ep against one
process, reshard into the TP-plan layout and back, export). Default run (the CI budget):
``hf_ep_sweep.CI_ARCHS`` at ``CI_CHECKS`` (dp_shard x tp x ep: both expert axes and tp at once) and
the plan-level refusal of a MoE architecture without an EP plan; ``SHARDBRIDGE_MOE_MATRIX=all``
(``nox -s moe``) every check of every MoE architecture of the installed transformers (the TP
sweep's generator), the refusals through a 4-rank prepare.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

import hf_ep_sweep as E  # noqa: E402
import hf_helpers as H  # noqa: E402
import hf_sweep as S  # noqa: E402
from shardbridge import ParallelDims  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402
from shardbridge_hf import HFConfig  # noqa: E402
from shardbridge_hf._ep import resolve_ep_plan, without_experts  # noqa: E402

_ALL = os.environ.get("SHARDBRIDGE_MOE_MATRIX") == "all"


def _with_plan() -> list[str]:
    table = E.ep_archs()
    return sorted(a for a, has in table.items() if has and a not in E.KNOWN) if _ALL else list(E.CI_ARCHS)


def _without_plan() -> list[str]:
    table = E.ep_archs()
    return sorted(a for a, has in table.items() if not has)


def test_the_generator_finds_the_moe_architectures():
    table = E.ep_archs()
    for arch in ("qwen3_moe", "mixtral", "olmoe", "gpt_oss", "zaya", *E.CI_ARCHS):
        assert table[arch] is True, arch
    # zaya: an EP plan and no TP plan; runs dp4_ep2 instead of dp2_tp2_ep2, which is refused by name
    assert not E.has_tp_plan("zaya") and "dp4_ep2" in E.checks_for("zaya")
    assert E.expected("zaya", E.checks_for("zaya"))["dp2_tp2_ep2"] == E.REFUSED_NO_TP
    # every architecture the TP sweep leaves out for having only an EP plan runs here
    only_ep = [a for a in S.sweep_archs() if S.skip_reason(a) == S.NEEDS_EP]
    assert only_ep and all(table.get(a) is True for a in only_ep), only_ep
    assert table["llama4_text"] is False  # MoE, with a TP plan and no EP plan
    assert "llama" not in table  # dense


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _with_plan())
def test_architecture_trains_with_expert_parallelism(model_type):
    checks = E.checks_for(model_type) if _ALL else E.CI_CHECKS
    assert E.run_arch(model_type, checks=checks) == E.expected(model_type, checks)


@pytest.mark.parametrize("model_type", _without_plan())
def test_moe_without_an_ep_plan_is_refused_by_name(model_type):
    if _ALL:  # through ShardbridgeAccelerator.prepare on 4 ranks
        messages = set(run_distributed(E.refused, model_type, world_size=4))
        assert len(messages) == 1  # every rank raises the same
        (message,) = messages
    else:  # the plan step prepare runs first, in this process
        with pytest.raises(ValueError) as info:
            resolve_ep_plan(S.build(model_type, seed=0))
        message = str(info.value)
    assert "declares no expert-parallel plan" in message and "fsdp_config.shardbridge.ep_plan" in message


def _route_to_the_first_half(model) -> None:
    """Every token's experts mapped into the first half (``index % (E / 2)``): at ep=2 the ranks holding
    the second half receive no rows at all. Applied alike to the one-process oracle."""
    for layer in model.model.layers:
        gate, half = layer.mlp.gate, layer.mlp.experts.num_experts // 2
        original = gate.forward

        def routed(hidden_states, original=original, half=half):
            logits, scores, indices = original(hidden_states)
            return logits, scores, indices % half

        gate.forward = routed


def _first_step_routed(model_type: str) -> dict | None:
    import torch
    import torch.distributed as dist

    acc = H.sb_accelerator(ParallelDims(dp_shard=4), config=HFConfig(ep_size=2))
    model = S.build(model_type, seed=dist.get_rank())
    _route_to_the_first_half(model)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=S.LR))
    loss = acc.reduce_loss(S._step(acc, model, opt, 1)).item()
    grads, norm = S._grads_and_norm(acc, model)
    return {"losses": [loss], "grads": grads, "norm": norm} if dist.get_rank() == 0 else None


@pytest.mark.slow
def test_an_ep_rank_without_tokens_still_joins_the_backward_exchange():
    """An ep rank whose experts receive no rows must still take part in the reverse all-to-all.

    The experts' forward then runs one row so every expert parameter gets a gradient; that row must
    stay connected to the received (empty) rows, or autograd never reaches this rank's backward
    all-to-all while the other ranks wait in it (a hang: seen with zaya's top-1 routing at ep=4).
    dp_shard=4 x ep=2: the experts are also FSDP-sharded over the 2 ranks holding them (efsdp=2).
    """
    model = S.build("qwen3_moe", seed=0)
    _route_to_the_first_half(model)
    losses, grads = S._train_one_process(model, steps=1, dp=4)
    got = run_distributed(_first_step_routed, "qwen3_moe", world_size=4, timeout=240)[0]
    assert S.compare_step1(got, {"losses": losses, "grads": grads}).verdict() == "pass"


# -- tier 1: plans and config ----------------------------------------------------------------------


def test_ep_plan_resolves_to_experts_modules_and_their_parameters():
    model = S.build("gpt_oss", seed=0)
    experts = resolve_ep_plan(model)
    assert experts == {
        f"model.layers.{i}.mlp.experts": ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
        for i in range(2)
    }
    tp = {"model.layers.0.mlp.experts": "moe_tp_experts", "model.layers.0.mlp.experts.down_proj": "rowwise", "x": "c"}
    assert without_experts(tp, experts) == {"x": "c"}


def test_bad_ep_plans_are_refused_by_name():
    model = S.build("qwen3_moe", seed=0)
    partial = {"model.layers.*.mlp.experts": "ep_dispatch_experts", "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}
    with pytest.raises(ValueError, match=r"parameter\(s\) \['down_proj'\] are not 'grouped_gemm'"):
        resolve_ep_plan(model, partial)
    with pytest.raises(ValueError, match="outside an 'ep_dispatch_experts' module"):
        resolve_ep_plan(model, {"model.layers.*.mlp.experts.down_proj": "grouped_gemm"})
    with pytest.raises(NotImplementedError, match="EP style 'ep_router'"):
        resolve_ep_plan(model, {"model.layers.*.mlp.gate": "ep_router"})
    with pytest.raises(ValueError, match="matches no module or parameter"):
        resolve_ep_plan(model, {"model.layers.*.mlp.nope": "ep_dispatch_experts"})
    with pytest.raises(ValueError, match="declares no expert-parallel plan"):
        resolve_ep_plan(S.build("llama", seed=0))


def test_ep_config_keys_are_validated_by_name():
    with pytest.raises(ValueError, match=r"fsdp_config.shardbridge.ep_size=0 must be an int >= 1"):
        HFConfig(ep_size=0)
    with pytest.raises(ValueError, match=r"ep_implementation='deepgemm_megamoe' is not allowed"):
        HFConfig(ep_implementation="deepgemm_megamoe")
    with pytest.raises(ValueError, match=r"ep_plan=.* use 'auto' or a mapping of module / parameter patterns"):
        HFConfig(ep_plan={"model.layers.*.mlp.experts": "moe_tp_experts"})
    with pytest.raises(ValueError, match=r"ep_size=3: ep\(3\) does not divide dp_shard\(2\) \* cp\(1\) \* tp\(2\)"):
        HFConfig(ep_size=3, dims=ParallelDims(dp_shard=2, tp=2).resolve(4))
    with pytest.raises(ValueError, match=r"ep_size=4 disagrees with the parallel dims' ep=2"):
        HFConfig(ep_size=4).parallel_dims(ParallelDims(dp_shard=4, ep=2))
    assert HFConfig(ep_size=2).parallel_dims(ParallelDims(dp_shard=4)).ep == 2
    assert HFConfig().parallel_dims(ParallelDims(dp_shard=4, ep=4)).ep == 4  # dims' own ep is honoured
    assert HFConfig(ep_implementation="all_reduce").ep_dispatch == "all_gather"


def _six_experts_at_ep4() -> str:
    import torch

    acc = H.sb_accelerator(ParallelDims(dp_shard=4), config=HFConfig(ep_size=4))
    model = S.build("qwen3_moe", seed=0, num_experts=6, num_local_experts=6)  # the alias too (hf_sweep.BASE sets both)
    try:
        acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=S.LR))
    except ValueError as exc:
        return str(exc)
    return "prepared"


def test_ep_size_that_does_not_divide_the_experts_names_the_key_and_what_fits():
    """Qwen3-MoE with 6 experts at ep_size 4 named neither the yaml key nor the valid sizes (issue 38)."""
    messages = set(run_distributed(_six_experts_at_ep4, world_size=4, timeout=240))
    assert len(messages) == 1, messages  # every rank, the same line, before any expert is sharded
    (message,) = messages
    assert message.startswith(
        "fsdp_config.shardbridge.ep_size=4 (ParallelDims.ep) does not divide the 6 experts of model.layers.0.mlp.experts"
    ), message
    assert "set ep_size to one of [1, 2]" in message and "\n" not in message, message


def test_launcher_reads_ep_size_from_the_block(tmp_path):
    import hf_helpers as H
    from shardbridge_hf import read_config_file

    text = H.ACCELERATE_YAML.replace("    precision: bf16\n", "    precision: bf16\n    ep_size: 4\n    ep_implementation: all_gather\n")
    plan = read_config_file(H.write_config(tmp_path, text))
    assert plan.dims == ParallelDims(dp_shard=2, tp=2, ep=4)
    assert plan.config.ep_dispatch == "all_gather"
    assert HFConfig.from_json(plan.config.to_json()) == plan.config
    bad = H.ACCELERATE_YAML.replace("    precision: bf16\n", "    precision: bf16\n    ep_size: 3\n")
    with pytest.raises(ValueError, match=r"ep_size=3: ep\(3\) does not divide"):
        read_config_file(H.write_config(tmp_path, bad))
    # Accelerate's parallelism_config has no ep: the key is refused, pointing at the block
    wrong = H.ACCELERATE_YAML.replace("  parallelism_config_tp_size: 2\n", "  parallelism_config_tp_size: 2\n  parallelism_config_ep_size: 2\n")
    with pytest.raises(ValueError, match=r"parallelism_config_ep_size=2: .* write fsdp_config.shardbridge.ep_size: 2"):
        read_config_file(H.write_config(tmp_path, wrong))
