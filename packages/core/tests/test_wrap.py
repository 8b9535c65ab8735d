"""Tier 3: apply_fsdp's units, reshard policy, placements, divide factor and CPU offload on gloo.

Training numerics against the single-process oracle live in test_models.py.
"""

import pytest
import torch
import torch.nn.functional as F
from shardbridge import ParallelDims, SupportsFSDPUnits, apply_fsdp, fsdp_unit_params
from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch
from shardbridge.testing import run_distributed
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _mesh(**dims):
    return ParallelDims(**dims).build_mesh("cpu")


def _step(model, pm, cfg=None):
    cfg = cfg or LlamaConfig.tiny()
    tokens, labels = synthetic_batch(cfg, 4, 8, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
    loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    loss.backward()
    return loss


def test_llama_implements_the_protocol():
    assert isinstance(Llama(LlamaConfig.tiny()), SupportsFSDPUnits)
    assert not isinstance(nn.Linear(2, 2), SupportsFSDPUnits)


# -- units ---------------------------------------------------------------------------------------


def _units():
    model = apply_fsdp(Llama(LlamaConfig.tiny()), _mesh(dp_shard=4))
    fsdp_modules = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
    return fsdp_unit_params(model), fsdp_modules


def test_default_units_follow_the_design():
    units, fsdp_modules = run_distributed(_units, world_size=4)[0]
    block = lambda i: tuple(  # noqa: E731
        f"layers.{i}.{p}.weight"
        for p in (
            "attention_norm",
            "attention.qkv",
            "attention.o_proj",
            "ffn_norm",
            "feed_forward.gate_up",
            "feed_forward.down",
        )
    )
    assert units == {
        "tok_embeddings": ("tok_embeddings.weight",),
        "layers.0": block(0),
        "layers.1": block(1),
        "norm+output": ("norm.weight", "output.weight"),  # one unit, one all-gather
        "": (),  # the root manages nothing
    }
    assert fsdp_modules == ["", "layers.0", "layers.1", "norm", "output", "tok_embeddings"]


def _reshard(policy):
    pm = _mesh(dp_shard=2)
    model = apply_fsdp(Llama(LlamaConfig.tiny()), pm, reshard_after_forward=policy)
    with torch.no_grad():
        model(synthetic_batch(model.config, 2, 8, dp_rank=pm["dp"].get_local_rank(), dp_size=2)[0])
    # After forward a unit that resharded holds its sharded DTensor again; one that did not
    # holds the unsharded plain tensor.
    return {
        "tok_embeddings": isinstance(model.tok_embeddings.weight, DTensor),
        "layers.1": isinstance(model.layers[1].attention.qkv.weight, DTensor),
        "output": isinstance(model.output.weight, DTensor),
    }


@pytest.mark.parametrize(
    ("policy", "resharded"),
    [
        ("default", {"tok_embeddings": True, "layers.1": True, "output": False}),
        (True, {"tok_embeddings": True, "layers.1": True, "output": True}),
        (False, {"tok_embeddings": False, "layers.1": False, "output": False}),
    ],
)
def test_reshard_after_forward_policy(policy, resharded):
    assert run_distributed(_reshard, policy, world_size=2)[0] == resharded


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _explicit_units_and_errors():
    pm = _mesh(dp_shard=2)
    net = _Net()
    with pytest.raises(ValueError, match=r"_Net does not name its FSDP units; pass units=\[...\]"):
        apply_fsdp(net, pm)
    with pytest.raises(ValueError, match=r"units\[1\] \('a'\) contains units\[2\] \('a.0'\) but comes first"):
        apply_fsdp(net, pm, units=[net.b, net.a, net.a[0]])
    with pytest.raises(ValueError, match=r"module 'b' appears in units\[0\] and units\[1\]"):
        apply_fsdp(net, pm, units=[net.b, [net.a, net.b]])
    with pytest.raises(ValueError, match=r"units\[0\] is the model itself"):
        apply_fsdp(net, pm, units=[net])
    with pytest.raises(ValueError, match=r"units\[0\] contains a Linear that is not a submodule"):
        apply_fsdp(net, pm, units=[nn.Linear(1, 1)])
    with pytest.raises(ValueError, match=r"reshard_after_forward='always' must be True, False or 'default'"):
        apply_fsdp(net, pm, units=[net.b], reshard_after_forward="always")
    with pytest.warns(UserWarning, match=r"the FSDP root manages 2 parameter\(s\) no unit claims"):
        apply_fsdp(net, pm, units=[net.a[0], [net.a[1]]])
    return fsdp_unit_params(net)


def test_explicit_units_and_validation():
    units = run_distributed(_explicit_units_and_errors, world_size=2)[0]
    assert units == {"a.0": ("a.0.weight", "a.0.bias"), "a.1": ("a.1.weight", "a.1.bias"), "": ("b.weight", "b.bias")}


# -- placements ----------------------------------------------------------------------------------


def _placements(dims):
    pm = _mesh(**dims)
    model = parallelize_llama(Llama(LlamaConfig.tiny()), pm)
    names = ["tok_embeddings.weight", "layers.0.attention.qkv.weight", "layers.0.attention.o_proj.weight"]
    names.append("norm.weight")
    params = dict(model.named_parameters())
    return {n: (params[n].placements, tuple(params[n].device_mesh.mesh_dim_names)) for n in names}


def test_fsdp_tp_and_hsdp_placements():
    fsdp_tp = run_distributed(_placements, dict(dp_shard=2, tp=2), world_size=4)[0]
    strided = _StridedShard(0, split_factor=2)
    assert fsdp_tp["layers.0.attention.qkv.weight"] == ((strided, Shard(0)), ("dp_shard_cp", "tp"))
    assert fsdp_tp["tok_embeddings.weight"] == ((strided, Shard(0)), ("dp_shard_cp", "tp"))
    assert fsdp_tp["layers.0.attention.o_proj.weight"][0] == (Shard(0), Shard(1))
    assert fsdp_tp["norm.weight"] == ((Shard(0),), ("dp_shard_cp",))  # plain over tp: FSDP only

    hsdp = run_distributed(_placements, dict(dp_replicate=2, dp_shard=2), world_size=4)[0]
    assert hsdp["layers.0.attention.qkv.weight"] == ((Replicate(), Shard(0)), ("dp_replicate", "dp_shard_cp"))

    hsdp_tp = run_distributed(_placements, dict(dp_replicate=2, dp_shard=1, tp=2), world_size=4)[0]
    placements, dims = hsdp_tp["layers.0.attention.qkv.weight"]
    assert dims == ("dp_replicate", "dp_shard_cp", "tp")
    assert placements[0] == Replicate() and placements[2] == Shard(0)


# -- gradient divide factor and CPU offload --------------------------------------------------------


def _grad(divide_factor, cpu_offload):
    pm = _mesh(dp_shard=4)
    model = apply_fsdp(Llama(LlamaConfig.tiny()), pm, gradient_divide_factor=divide_factor, cpu_offload=cpu_offload)
    offload = model.layers[0]._get_fsdp_state()._fsdp_param_group.offload_policy
    loss = _step(model, pm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()  # runs on the (offloaded) CPU shards
    return model.layers[0].feed_forward.down.weight.grad.full_tensor(), offload, loss.item()


def test_gradient_divide_factor_sums_on_gloo():
    # gloo has no PREMUL_SUM: without force-sum reduction this would fail.
    mean = run_distributed(_grad, None, False, world_size=4)[0][0]
    summed = run_distributed(_grad, 1.0, False, world_size=4)[0][0]
    torch.testing.assert_close(summed, 4 * mean)


def test_cpu_offload_on_cpu_does_not_pin():
    grad, offload, _ = run_distributed(_grad, None, True, world_size=4)[0]
    assert offload == CPUOffloadPolicy(pin_memory=False)
    reference = run_distributed(_grad, None, False, world_size=4)[0][0]
    torch.testing.assert_close(grad, reference)


def _world_of_tp(policy_name):
    from shardbridge import PrecisionPolicy

    pm = _mesh(dp_shard=1, tp=4)
    cfg = LlamaConfig.tiny(num_kv_heads=4)
    policy = None if policy_name is None else PrecisionPolicy.from_name(policy_name)
    model = parallelize_llama(Llama(cfg), pm, policy)
    _step(model, pm, cfg)
    weight = model.layers[0].feed_forward.gate_up.weight
    return isinstance(model, FSDPModule), weight.placements, tuple(weight.device_mesh.mesh_dim_names)


def test_degree_one_dp_skips_fsdp_unless_the_policy_casts():
    # Nothing to shard or reduce, nothing to cast: plain TP DTensors, no FSDP copies per step.
    for policy_name in (None, "fp32"):
        is_fsdp, placements, dims = run_distributed(_world_of_tp, policy_name, world_size=4)[0]
        assert not is_fsdp and dims == ("tp",) and placements == (Shard(0),)
    # bf16 compute: the policy only takes effect through FSDP2, so it shards over the size-1 mesh.
    is_fsdp, placements, dims = run_distributed(_world_of_tp, "bf16", world_size=4)[0]
    assert is_fsdp and dims == ("dp_shard_cp", "tp")
    assert placements == (_StridedShard(0, split_factor=4), Shard(0))


def _empty_tp_piece():
    import torch.nn as nn
    from shardbridge import ParallelDims, apply_fsdp
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    pm = ParallelDims(tp=4).build_mesh("cpu")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 3)  # 3 rows over tp=4: torch.chunk leaves rank 3 empty

        def fsdp_units(self):
            return [self.proj]

    net = parallelize_module(Net(), pm["tp"], {"proj": ColwiseParallel()})
    try:
        apply_fsdp(net, pm)
    except ValueError as err:
        return str(err)
    return None


def test_empty_tp_piece_is_refused_on_every_rank():
    messages = run_distributed(_empty_tp_piece, world_size=4)
    assert all(
        m is not None and "'proj.weight' of shape (3, 8)" in m and "empty tensor-parallel piece" in m for m in messages
    )
