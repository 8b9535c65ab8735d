"""Expert tensors in checkpoints: saved in item coordinates, bit-exact across ep sizes and layouts.

The reference MoE trains two steps in one layout and saves; the next layout loads it (different
seed and learning rate: every value must come from the checkpoint), is compared bit-exact
(``torch.equal``) with the first run's full state (parameters, AdamW ``exp_avg`` /
``exp_avg_sq`` / ``step``; oracle ``full_tensor()``), and saves again for the next one. The
chain ends where it started. A second oracle is torch's own ``dcp_to_torch_save`` of the ep=4
checkpoint: every expert tensor is the full ``[E, ...]`` tensor, dim 0 = global expert index.

``pytest .../test_experts.py`` runs the CI chain ep=4 -> ep=2 -> ep=1 -> tp=4 (TP-only) -> one
process -> ep=4 (issue 26's item 4);
``SHARDBRIDGE_MOE_MATRIX=all`` adds the long chain over TP-only, dp x tp x ep, HSDP x ep,
cp x ep, dim-1 expert sharding and 8 ranks.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from ckpt_helpers import assert_equal_states, full_state
from shardbridge import ParallelDims, checkpoint
from shardbridge.cp import cp_cross_entropy, cp_split
from shardbridge.models import MoEConfig, MoELlama, parallelize_moe, synthetic_batch
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

CONFIG = MoEConfig.tiny(num_experts=8, num_kv_heads=4, shared_expert_intermediate_size=32)  # tp=4 divides
DIM1 = MoEConfig.tiny(num_experts=6)  # 3 local experts over efsdp 2: FSDP shards dim 1

# (name, ParallelDims or None = one process, world size)
CI_CHAIN = [
    ("ep4", dict(dp_shard=4, ep=4), 4),
    ("ep2", dict(dp_shard=4, ep=2), 4),
    ("ep1", dict(dp_shard=4, ep=1), 4),
    ("tp4_ep1", dict(dp_shard=1, tp=4, ep=1), 4),  # TP-only: no dp axis, experts FSDP over the tp ranks
    ("one_process", None, 1),
    ("ep4_again", dict(dp_shard=4, ep=4), 4),
]
LONG_CHAIN = [
    ("ep4", dict(dp_shard=4, ep=4), 4),
    ("tp4_ep1", dict(dp_shard=1, tp=4, ep=1), 4),
    ("dp2_tp2_ep4", dict(dp_shard=2, tp=2, ep=4), 4),
    ("hsdp2x2_ep2", dict(dp_replicate=2, dp_shard=2, ep=2), 4),
    ("cp2_dp2_ep2", dict(dp_shard=2, cp=2, ep=2), 4),
    ("tp4_ep2", dict(dp_shard=1, tp=4, ep=2), 4),
    ("dp4_tp2_ep8", dict(dp_shard=4, tp=2, ep=8), 8),
    ("hsdp2x2_tp2_ep4", dict(dp_replicate=2, dp_shard=2, tp=2, ep=4), 8),
    ("fsdp8_ep2", dict(dp_shard=8, ep=2), 8),
    ("one_process", None, 1),
    ("ep4_again", dict(dp_shard=4, ep=4), 4),
]
DIM1_CHAIN = [
    ("ep2_dim1", dict(dp_shard=4, ep=2), 4),
    ("ep1", dict(dp_shard=4, ep=1), 4),
    ("ep2_tp2", dict(dp_shard=2, tp=2, ep=2), 4),
    ("one_process", None, 1),
]
CHAINS = {"ci": (CONFIG, CI_CHAIN)}
if os.environ.get("SHARDBRIDGE_MOE_MATRIX") == "all":
    CHAINS["long"] = (CONFIG, LONG_CHAIN)
    CHAINS["dim1"] = (DIM1, DIM1_CHAIN)


def _build(dims: dict | None, config: MoEConfig, *, seed: int, lr: float):
    model = MoELlama(config, seed=seed)
    pm = None
    if dims is not None:
        pm = ParallelDims(**dims).build_mesh("cpu")
        parallelize_moe(model, pm)
    return model, torch.optim.AdamW(model.parameters(), lr=lr), pm


def _train_step(model, opt, pm, step: int) -> None:
    cfg = model.config
    if pm is None:
        tokens, labels = synthetic_batch(cfg, 8, 16, step=step)
        ce = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
    else:
        tokens, labels = synthetic_batch(cfg, 8, 16, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
        ce = cp_cross_entropy(model(cp_split(tokens, pm["cp"])), cp_split(labels, pm["cp"]), pm)
    (ce + cfg.router_aux_loss_coef * model.aux_loss).backward()
    opt.step()
    opt.zero_grad()


def _first(dims: dict | None, config: MoEConfig, path: str):
    model, opt, pm = _build(dims, config, seed=0, lr=1e-2)
    for step in range(2):
        _train_step(model, opt, pm, step)
    checkpoint.save(path, model=model, optimizer=opt, step=2, parallel_dims=None if pm is None else pm.dims)
    state = full_state(model, opt)
    return (state, _placements(model)) if pm is None or dist.get_rank() == 0 else None


def _placements(model) -> dict[str, str]:
    return {n: repr(p.placements) for n, p in model.named_parameters() if ".experts." in n and hasattr(p, "placements")}


def _next(dims: dict | None, config: MoEConfig, source: str, target: str):
    model, opt, pm = _build(dims, config, seed=7, lr=0.5)
    _train_step(model, opt, pm, 5)  # optimizer state to overwrite
    train_state = checkpoint.load(source, model=model, optimizer=opt, rng=False)
    state = full_state(model, opt)
    checkpoint.save(target, model=model, optimizer=opt, step=train_state.step)
    if pm is not None and dist.get_rank() != 0:
        return None
    return state, opt.param_groups[0]["lr"], _placements(model)


def _run(fn, *args, dims, world):
    return fn(*args) if dims is None else run_distributed(fn, *args, world_size=world)[0]


def _chain(chain, config, tmp_path):
    name, dims, world = chain[0]
    source = str(tmp_path / name)
    want, placements = _run(_first, dims, config, source, dims=dims, world=world)
    seen = {name: placements}
    for name, dims, world in chain[1:]:
        target = str(tmp_path / name)
        got, lr, placements = _run(_next, dims, config, source, target, dims=dims, world=world)
        assert_equal_states(got, want)
        assert lr == 1e-2
        seen[name] = placements
        source = target
    return want, seen


@pytest.mark.parametrize("chain", list(CHAINS))
def test_experts_round_trip_bit_exact_across_ep_sizes(chain, tmp_path):
    config, layouts = CHAINS[chain]
    want, seen = _chain(layouts, config, tmp_path)
    assert "model.layers.0.feed_forward.experts.gate_up_proj" in want
    assert "optim.state.layers.1.feed_forward.experts.down_proj.exp_avg_sq" in want
    # the layouts really differ: the expert dim split 4 and 2 ways by ep (FSDP on top), or not at all
    gate_up = "layers.0.feed_forward.experts.gate_up_proj"
    for name, placements in seen.items():
        if name == "one_process":
            assert placements == {}
        elif name == "ep2_dim1":
            assert placements[gate_up] == "(Shard(dim=1), Shard(dim=0))"
        elif name in ("ep4", "ep2", "ep4_again"):
            assert placements[gate_up].endswith("Shard(dim=0))")

    # torch's own reader: dim 0 of every expert tensor is the global expert index
    out = tmp_path / "oracle.pt"
    dcp_to_torch_save(tmp_path / layouts[0][0], out)
    sd = torch.load(out, weights_only=True)
    for fqn in ("layers.0.feed_forward.experts.gate_up_proj", "layers.1.feed_forward.experts.down_proj"):
        assert tuple(sd["model"][fqn].shape)[0] == config.num_experts
        assert torch.equal(sd["model"][fqn], want[f"model.{fqn}"])
        assert torch.equal(sd["optim"][f"state.{fqn}.exp_avg"], want[f"optim.state.{fqn}.exp_avg"])
