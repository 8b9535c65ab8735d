"""A Megatron-Core GPTModel (local spec, SwiGLU, GQA, untied output) under Megatron-Core's own
Megatron-FSDP at dp2 x tp2 on 4 gloo ranks vs a single-process run of the same model."""

from __future__ import annotations

import pytest
import torch
from mcore_helpers import FULL, STEPS, build_sharded, gather_full, reference, train
from shardbridge.testing import run_distributed


@pytest.fixture(scope="module")
def oracle():
    return run_distributed(reference, world_size=1, timeout=300)[0]


def _train(dims: dict, strategy: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state

    try:
        model, opt = build_sharded(dims, strategy=strategy)
        return train(model, opt, STEPS), gather_full(model)
    finally:
        destroy_parallel_state()


CASES = [pytest.param({"dp_shard": 2, "tp": 2}, "optim_grads_params", id="dp2xtp2-optim_grads_params")]
if FULL:  # full only
    CASES += [
        pytest.param({"dp_shard": 4}, "optim_grads", id="dp4-optim_grads"),
        pytest.param({"dp_shard": 1, "tp": 4}, "optim", id="tp4-optim"),
    ]


@pytest.mark.parametrize("dims,strategy", CASES)
def test_matches_single_process(oracle, dims, strategy):
    ref_losses, ref_params = oracle
    losses, params = run_distributed(_train, dims, strategy, world_size=4, timeout=300)[0]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert ref_losses[-1] < ref_losses[0]  # it trains
    assert set(params) == set(ref_params)
    for name, ref in ref_params.items():
        torch.testing.assert_close(params[name], ref, rtol=0, atol=1e-5, msg=name)
