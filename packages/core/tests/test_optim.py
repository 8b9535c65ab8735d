"""shardbridge._optim: param groups remembered by FQN and rebound after parallelizing (tier 1, 3)."""

import pytest
import torch
import torch.distributed as dist
from shardbridge import param_group_fqns, rebind_param_groups
from shardbridge.testing import run_distributed
from torch import nn


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _groups(model):
    return [
        {"params": [model[0].weight, model[2].weight], "lr": 0.1, "weight_decay": 0.01},
        {"params": [model[0].bias, model[2].bias], "lr": 0.5, "weight_decay": 0.0},
    ]


def test_fqns_in_group_order():
    model = _model()
    opt = torch.optim.AdamW(_groups(model))
    assert param_group_fqns(model, opt) == [["0.weight", "2.weight"], ["0.bias", "2.bias"]]


def test_foreign_tensor_is_refused():
    model = _model()
    opt = torch.optim.SGD([model[0].weight, nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 0 holds a tensor of shape \(3,\) that is not a parameter of the "
                       r"Sequential; build the optimizer from model.parameters\(\) before prepare\(\)"):  # fmt: skip
        param_group_fqns(model, opt, when="prepare()")


def test_rebind_keeps_hyperparameters_and_clears_state():
    model = _model()
    opt = torch.optim.AdamW(_groups(model))
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    assert opt.state
    fqns = param_group_fqns(model, opt)
    for module in (model[0], model[2]):  # what parallelizing does: new Parameter objects
        module.weight = nn.Parameter(module.weight.detach().clone())
        module.bias = nn.Parameter(module.bias.detach().clone())
    rebind_param_groups(opt, fqns, dict(model.named_parameters()))
    assert [[id(p) for p in g["params"]] for g in opt.param_groups] == [
        [id(model[0].weight), id(model[2].weight)],
        [id(model[0].bias), id(model[2].bias)],
    ]
    assert [(g["lr"], g["weight_decay"]) for g in opt.param_groups] == [(0.1, 0.01), (0.5, 0.0)]
    assert not opt.state


def test_rebind_errors():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fqns = param_group_fqns(model, opt)
    with pytest.raises(ValueError, match=r"has 1 param groups but 2 were recorded"):
        rebind_param_groups(opt, fqns * 2, dict(model.named_parameters()))
    with pytest.raises(ValueError, match=r"parameters \['0.weight'\] of the optimizer are no longer in the model"):
        rebind_param_groups(opt, fqns, {k: v for k, v in model.named_parameters() if k != "0.weight"})


def _fsdp_step():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    opt = torch.optim.AdamW(_groups(model))
    fqns = param_group_fqns(model, opt)
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    rebind_param_groups(opt, fqns, dict(model.named_parameters()))
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def test_rebound_optimizer_steps_the_sharded_model_like_one_process():
    ref = _model()
    opt = torch.optim.AdamW(_groups(ref))
    ref(torch.ones(2, 4)).sum().backward()
    opt.step()
    for result in run_distributed(_fsdp_step, world_size=2):
        for name, p in ref.named_parameters():
            torch.testing.assert_close(result[name], p.detach(), rtol=1e-6, atol=1e-7)
