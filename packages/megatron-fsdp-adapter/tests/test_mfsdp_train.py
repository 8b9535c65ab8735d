"""Every Megatron-FSDP strategy, HSDP mode and FSDP x TP on 4 gloo ranks vs the fp32 oracle."""

from __future__ import annotations

import math

import pytest
import torch
from mfsdp_helpers import build, full_params, item_to_plain, reference, train
from shardbridge.testing import run_distributed

# (name, mesh dims, strategy, outer strategy)
CONFIGS = [
    ("no_shard", {"dp_shard": 4}, "no_shard", None),
    ("optim", {"dp_shard": 4}, "optim", None),
    ("optim_grads", {"dp_shard": 4}, "optim_grads", None),
    ("optim_grads_params", {"dp_shard": 4}, "optim_grads_params", None),
    ("hsdp_no_shard", {"dp_replicate": 2, "dp_shard": 2}, "optim_grads_params", "no_shard"),
    ("hsdp_optim", {"dp_replicate": 2, "dp_shard": 2}, "optim_grads_params", "optim"),
    ("fsdp2_tp2", {"dp_shard": 2, "tp": 2}, "optim_grads_params", None),
    ("optim_tp2", {"dp_shard": 2, "tp": 2}, "optim", None),
]

# fp32 everywhere; only the reduction order differs from the single-process oracle.
RTOL_LOSS, ATOL_PARAM = 1e-5, 1e-5


def _run_all() -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    out = {}
    for name, dims, strategy, outer in CONFIGS:
        pm, model, opt = build(dims, strategy, outer)
        losses = train(pm, model, opt)
        full = {fqn: item_to_plain(fqn, t, pm.dims.tp) for fqn, t in full_params(model).items()}
        groups = [(g["weight_decay"], len(g["params"])) for g in opt.param_groups]
        out[name] = (losses, full, groups)
    # AdamW: the upstream zero-gradient step must not count (step == STEPS, not STEPS + 1).
    pm, model, opt = build({"dp_shard": 4}, "optim_grads_params", adam=True)
    losses = train(pm, model, opt)
    steps = {float(s["step"]) for s in opt.state.values()}
    out["adam"] = (losses, steps)
    pm, model, opt = build({"dp_replicate": 2, "dp_shard": 2}, "optim_grads_params", "optim", adam=True)
    out["adam_hsdp_optim"] = (train(pm, model, opt), {float(s["step"]) for s in opt.state.values()})
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run_all, world_size=4, timeout=300)


@pytest.fixture(scope="module")
def oracle():
    return reference()


# HSDP with outer_strategy="optim" under SGD+momentum diverges from the oracle on gloo (step-1
# loss 5.20 vs 5.32): not a constant gradient scale (Adam, which is scale-invariant, matches
# to 1e-5 below). Unexplained as of megatron-fsdp 0.6.1; strict xfail so a fix is noticed.
_HSDP_OPTIM_SGD = pytest.mark.xfail(strict=True, reason="HSDP outer 'optim' + SGD momentum diverges (open)")


@pytest.mark.parametrize(
    "name", [pytest.param(c[0], marks=_HSDP_OPTIM_SGD) if c[0] == "hsdp_optim" else c[0] for c in CONFIGS]
)
def test_matches_fp32_reference(results, oracle, name):
    ref_losses, ref_params = oracle
    for rank_result in results:
        losses, params, groups = rank_result[name]
        assert losses == pytest.approx(ref_losses, rel=RTOL_LOSS)
        assert set(params) == set(ref_params)
        for fqn, value in params.items():
            torch.testing.assert_close(value, ref_params[fqn], rtol=0, atol=ATOL_PARAM, msg=f"{name}: {fqn}")
        # the user's two param groups survive (upstream fully_shard merges them into one)
        assert groups == [(0.1, 10), (0.0, 5)]


@pytest.mark.parametrize("name", ["adam", "adam_hsdp_optim"])
def test_adam_matches_and_counts_steps_from_zero(results, name):
    ref_losses, _ = reference(adam=True)
    for rank_result in results:
        losses, steps = rank_result[name]
        # Adam amplifies reduction-order noise (see make_optimizer): 1e-4; the extra upstream
        # step would shift step 2's bias correction by ~1e-3 relative.
        assert losses == pytest.approx(ref_losses, rel=1e-4)
        assert steps == {3.0}


def test_training_moves_weights(results, oracle):
    # guard against a vacuous comparison: 3 AdamW steps at lr 1e-2 move every weight
    ref_losses, _ = oracle
    assert ref_losses[-1] < ref_losses[0]
    assert all(math.isfinite(x) for x in ref_losses)
