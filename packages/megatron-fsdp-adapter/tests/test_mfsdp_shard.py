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
    from shardbridge.models import Llama, apply_llama_tp
    from shardbridge_megatron_fsdp import shard_model
    from torch.distributed.tensor import DTensor, Partial

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
    apply_llama_tp(model, tp["tp"])  # the core plan: row-parallel Shard(1) is accepted; a Partial param is not
    w = model.layers[0].attention.o_proj.weight
    partial = DTensor.from_local(w.to_local().detach(), tp["tp"], [Partial()], run_check=False)
    model.layers[0].attention.o_proj.weight = torch.nn.Parameter(partial)
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
    assert "'layers.0.attention.o_proj.weight'" in messages[4] and "Partial(sum)" in messages[4]
    assert "Shard(d) (column-parallel d=0, row-parallel d=1) or Replicate()" in messages[4]
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


# -- Megatron-style TP parameters (plain local tensors with partition_dim 0 / 1) ----------------
# The layout Megatron-Core's ColumnParallelLinear / RowParallelLinear use: Megatron-FSDP builds
# their DTensors itself; shard_model must accept them (and gather them for the main weights).
MLP_DIM, MLP_HIDDEN, MLP_STEPS = 8, 16, 3


class _MegatronBlock(torch.nn.Module):
    """x + fc2(tanh(fc1(x))): fc1 column-parallel (partition_dim 0), fc2 row-parallel (partition_dim 1)."""

    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, tp_mesh=None) -> None:
        super().__init__()
        tp, j = (1, 0) if tp_mesh is None else (tp_mesh.size(), tp_mesh.get_local_rank())
        self.tp_mesh = tp_mesh
        self.fc1 = torch.nn.Parameter(fc1.chunk(tp, 0)[j].clone())
        self.fc2 = torch.nn.Parameter(fc2.chunk(tp, 1)[j].clone())
        for param, dim in ((self.fc1, 0), (self.fc2, 1)):
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor, Partial, Replicate

        tp = self.tp_mesh is not None and self.tp_mesh.size() > 1
        h = x
        if tp:
            # Megatron's copy_to_tensor_model_parallel_region: identity; the gradient is all-reduced
            h = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False).to_local(
                grad_placements=[Partial()]
            )
        y = torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(h, self.fc1)), self.fc2)
        if tp:
            # reduce_from_tensor_model_parallel_region: partial sums over tp -> all-reduce
            y = DTensor.from_local(y, self.tp_mesh, [Partial()]).redistribute(self.tp_mesh, [Replicate()]).to_local()
        return x + y


class _MegatronNet(torch.nn.Module):
    def __init__(self, tp_mesh=None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.layers = torch.nn.ModuleList(
            _MegatronBlock(
                torch.randn(MLP_HIDDEN, MLP_DIM, generator=gen) / 3,
                torch.randn(MLP_DIM, MLP_HIDDEN, generator=gen) / 4,
                tp_mesh,
            )
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _megatron_batch(step: int) -> torch.Tensor:
    return torch.randn(8, MLP_DIM, generator=torch.Generator().manual_seed(100 + step))


def _megatron_reference() -> dict[str, torch.Tensor]:
    model = _MegatronNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(MLP_STEPS):
        model(_megatron_batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _megatron_style(root: str, strategy: str) -> dict[str, object]:
    from mfsdp_helpers import full_params
    from shardbridge import ParallelDims, PrecisionPolicy
    from shardbridge_megatron_fsdp import load, save, shard_model

    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    dp = pm["dp"]
    out: dict[str, object] = {}
    # bf16 compute: the main weights must still be the fp32 originals (gathered over tp)
    model, _ = shard_model(_MegatronNet(pm["tp"]), None, pm, PrecisionPolicy.bf16(), strategy=strategy)
    out["bf16_main"] = full_params(model)
    model = _MegatronNet(pm["tp"])
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = shard_model(model, opt, pm, strategy=strategy)
    for step in range(MLP_STEPS):
        x = _megatron_batch(step).chunk(dp.size())[dp.get_local_rank()]
        # the dp-mean of per-rank means is the full-batch mean (equal chunks)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    out["trained"] = full_params(model)
    save(f"{root}/megatron_style", model=model, optimizer=opt, step=MLP_STEPS)
    pm4 = ParallelDims(dp_shard=4).build_mesh("cpu")
    m4 = _MegatronNet(pm4["tp"])  # tp=1: the full weights, still tagged partition_dim
    o4 = torch.optim.SGD(m4.parameters(), lr=0.1, momentum=0.9)
    m4, o4 = shard_model(m4, o4, pm4, strategy="optim_grads_params")
    load(f"{root}/megatron_style", model=m4, optimizer=o4)
    out["loaded_tp1"] = full_params(m4)
    return out


@pytest.mark.parametrize("strategy", ["optim_grads_params", "no_shard"])
def test_megatron_style_partition_dims(tmp_path, strategy):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ref = _megatron_reference()
    initial = dict(_MegatronNet().named_parameters())
    results = run_distributed(_megatron_style, str(tmp_path), strategy, world_size=4, timeout=300)
    dcp_to_torch_save(tmp_path / "megatron_style", tmp_path / "megatron_style.pt")
    saved = torch.load(tmp_path / "megatron_style.pt", weights_only=True)["model"]
    for r in results:
        for fqn, value in r["bf16_main"].items():
            assert torch.equal(value, initial[fqn].detach()), fqn  # fp32 originals, bit-exact
        for fqn, value in r["trained"].items():
            torch.testing.assert_close(value, ref[fqn], rtol=0, atol=1e-6, msg=fqn)
            assert torch.equal(saved[fqn], value), fqn  # the checkpoint holds the global tensor
            assert torch.equal(r["loaded_tp1"][fqn], value), fqn  # tp2 -> tp1, bit-exact
