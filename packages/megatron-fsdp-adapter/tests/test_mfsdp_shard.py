"""shardbridge_megatron_fsdp._shard: shard_model's checks and its fix of the HFSDP gradient scale."""

from __future__ import annotations

import pytest
import torch
from mfsdp_helpers import HSDP, backward, build, grad_scale, reference_grads
from shardbridge.testing import run_distributed
from shardbridge_megatron_fsdp import _cpu_patch


def _errors() -> list[str]:
    from mfsdp_helpers import CFG
    from shardbridge import ParallelDims
    from shardbridge.models import Llama
    from shardbridge.models._parallelize import apply_tp
    from shardbridge_megatron_fsdp import shard_model

    out = []
    pm = ParallelDims(dp_shard=4).build_mesh("cpu")
    cases = [
        dict(strategy="zero3"),
        dict(average_in_collective=True),
        dict(outer_strategy="optim"),
    ]
    for kw in cases:
        try:
            shard_model(Llama(CFG), None, pm, **kw)
        except ValueError as e:
            out.append(str(e))
    hsdp = ParallelDims(dp_replicate=2, dp_shard=2).build_mesh("cpu")
    try:
        shard_model(Llama(CFG), None, hsdp, strategy="optim", outer_strategy="optim")
    except ValueError as e:
        out.append(str(e))
    tp = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    model = Llama(CFG)
    apply_tp(model, tp["tp"])  # the core plan: o_proj/down row-parallel (Shard(1))
    try:
        shard_model(model, None, tp)
    except NotImplementedError as e:
        out.append(str(e))
    # no FSDP unit with optim_grads_params: no `.layers`, and unit_modules matching nothing
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    for kw in ({}, {"unit_modules": [torch.nn.Conv1d]}):
        try:
            shard_model(plain, None, pm, strategy="optim_grads_params", **kw)
        except ValueError as e:
            out.append(str(e))
    return out


def _upstream_unitless() -> str:
    # the canary: what megatron-fsdp 0.6.1 does with the same model (shard_model's ValueError)
    import megatron_fsdp
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp._shard import _quiet_device_warning

    pm = ParallelDims(dp_shard=4).build_mesh("cpu")
    _cpu_patch.install()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    try:
        with _quiet_device_warning(True):
            megatron_fsdp.fully_shard_model(
                plain,
                device_mesh=pm.mesh,
                dp_shard_dim="dp_shard",
                tp_dim="tp",
                fsdp_unit_modules=[],
                zero_dp_strategy="optim_grads_params",
                device=torch.device("cpu"),
            )
    except ZeroDivisionError as e:
        return type(e).__name__
    return "no error"


def test_clear_errors():
    messages = run_distributed(_errors, world_size=4)[0]
    assert len(messages) == 7, messages
    assert "strategy='zero3' is not a Megatron-FSDP strategy" in messages[0]
    assert "average_in_collective=True" in messages[1] and "set average_in_collective=False" in messages[1]
    assert "needs HSDP (dp_replicate > 1)" in messages[2]
    assert "strategy='optim_grads_params'" in messages[3]
    assert "Shard(dim=1)" in messages[4] and "ColwiseParallel" in messages[4]
    for m in messages[5:]:
        assert "unit_modules=" in m and "Pass unit_modules=[YourBlock]" in m, m
    assert "model.layers" in messages[5] and "['Conv1d']" in messages[6] and "model.layers" not in messages[6]


def test_upstream_divides_by_zero_without_units():
    assert run_distributed(_upstream_unitless, world_size=4) == ["ZeroDivisionError"] * 4


# [Note: HFSDP gradient scaling] in _shard.py. Gradients are compared where the optimizer reads
# them (the local boxes of the distributed params' .grad) after one backward, before any step:
# a wrong gradient scale is invisible to Adam and only shows in SGD losses after step 1.


def _hfsdp_gradients(ref: dict[str, torch.Tensor]) -> dict[str, object]:
    import megatron_fsdp
    from mfsdp_helpers import CFG
    from shardbridge import ParallelDims
    from shardbridge.models import Llama
    from shardbridge_megatron_fsdp import _cpu_patch
    from shardbridge_megatron_fsdp._shard import _fix_hfsdp_gradient_scaling, _quiet_device_warning

    pm = ParallelDims(**HSDP).build_mesh("cpu")
    _cpu_patch.install()
    with _quiet_device_warning(True):
        # exactly what shard_model passes for HSDP outer "optim", without its fixes
        model = Llama(CFG, seed=0)
        model = megatron_fsdp.fully_shard_model(
            model,
            fsdp_unit_modules=[type(model.layers[0])],
            device_mesh=pm.mesh,
            dp_shard_dim="dp_shard",
            dp_outer_dim="dp_replicate",
            tp_dim="tp",
            hybrid_fsdp_group=pm["dp"].get_group(),
            zero_dp_strategy="optim_grads_params",
            outer_dp_sharding_strategy="optim",
            device=torch.device("cpu"),
            sync_model_each_microbatch=True,
        )
    model.ddp_config.gradient_reduce_div_fusion = False  # gloo: no PREMUL_SUM
    out = {"upstream": grad_scale(pm, backward(pm, model), ref)}
    model.zero_grad_buffer()
    out["fixed_buffers"] = _fix_hfsdp_gradient_scaling(model)
    out["fixed"] = grad_scale(pm, backward(pm, model), ref)
    _, sharded, _ = build(HSDP, "optim_grads_params", "optim")
    out["shard_model"] = grad_scale(pm, backward(pm, sharded), ref)
    return out


def test_hfsdp_gradients_are_averaged():
    ref = reference_grads()
    for result in run_distributed(_hfsdp_gradients, ref, world_size=4, timeout=300):
        # megatron-fsdp 0.6.1 alone: SUM over all 4 dp ranks (a canary: when upstream copies the
        # scaling factor this fails, and _fix_hfsdp_gradient_scaling becomes a no-op)
        lo, hi, _ = result["upstream"]
        assert lo == pytest.approx(4.0, rel=1e-5) and hi == pytest.approx(4.0, rel=1e-5)
        assert result["fixed_buffers"] > 0
        for key in ("fixed", "shard_model"):
            lo, hi, err = result[key]
            assert lo == pytest.approx(1.0, rel=1e-5) and hi == pytest.approx(1.0, rel=1e-5), key
            assert err < 1e-6, key
