"""Context parallelism under Megatron-FSDP: sharding over the flattened dp_shard_cp, on 4 gloo ranks.

Oracle: the single-process fp32 reference Llama on the full-length global batch
(``mfsdp_helpers.reference``). Each cp rank feeds its head-tail part of the sequence
(``shardbridge.cp.cp_split``), the reference Llama's attention spans cp (``cp_attention``) and
the loss is the token mean over dp_cp (``shardbridge.cp.cp_cross_entropy``).
"""

from __future__ import annotations

import pytest
import torch
from mfsdp_helpers import ATOL_PARAM, BATCH, CFG, RTOL_LOSS, SEQ, STEPS, full_params, make_optimizer
from shardbridge import ParallelDims
from shardbridge.cp import cp_cross_entropy, cp_split
from shardbridge.models import Llama, synthetic_batch
from shardbridge.testing import run_distributed

LAYOUTS = {
    "cp2_dp_shard2": (dict(dp_shard=2, cp=2), "optim_grads_params", None),
    "cp4_optim_grads": (dict(dp_shard=1, cp=4), "optim_grads", None),
    "hsdp2_cp2": (dict(dp_replicate=2, dp_shard=1, cp=2), "optim_grads_params", "no_shard"),
}


def _train_cp(name: str):
    from shardbridge_megatron_fsdp import shard_model

    dims, strategy, outer = LAYOUTS[name]
    pm = ParallelDims(**dims).build_mesh("cpu")
    model = Llama(CFG, seed=0)
    opt = make_optimizer(model)
    model, opt = shard_model(model, opt, pm, strategy=strategy, outer_strategy=outer)
    losses = []
    for step in range(STEPS):
        tokens, labels = synthetic_batch(
            CFG, BATCH, SEQ, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size()
        )
        loss = cp_cross_entropy(model(cp_split(tokens, pm["cp"])), cp_split(labels, pm["cp"]), pm)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())  # the global token mean on every rank
    return losses, full_params(model)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cp_matches_fp32_reference(oracle, name):
    ref_losses, ref_params = oracle
    for losses, params in run_distributed(_train_cp, name, world_size=4, timeout=300):
        assert losses == pytest.approx(ref_losses, rel=RTOL_LOSS)
        assert set(params) == set(ref_params)
        for fqn, value in params.items():
            torch.testing.assert_close(value, ref_params[fqn], rtol=0, atol=ATOL_PARAM, msg=f"{name}: {fqn}")


def _refuses_model_without_cp_attention():
    from shardbridge_megatron_fsdp import shard_model

    pm = ParallelDims(dp_shard=2, cp=2).build_mesh("cpu")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(NotImplementedError, match=r"cp=2: Sequential has no set_context_parallel"):
        shard_model(model, None, pm)
    return True


def test_cp_refuses_a_model_whose_attention_cannot_span_cp():
    assert all(run_distributed(_refuses_model_without_cp_attention, world_size=4))
