"""Tiers 1 and 3: the reference MoE, expert parallelism and its training numerics.

The oracle is the same model trained in one process on the global batch (fp32): every layout
must reproduce its losses (cross entropy + the load-balancing loss), every parameter's
gradient at step 1 (full tensors, ``full_tensor()``; fused ones compared as components) and
the parameters after the last AdamW step.

``pytest packages/core/tests/test_moe.py`` runs the CI slice of the layout matrix;
``SHARDBRIDGE_MOE_MATRIX=all`` (``nox -s moe``) runs all of it, 8-rank layouts included.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardbridge import ParallelDims
from shardbridge._fused import fused_params
from shardbridge.cp import cp_cross_entropy, cp_split
from shardbridge.ep import choose_dispatch, expert_shard_dim, load_balancing_loss, router_statistics, run_experts
from shardbridge.fused import split_fused
from shardbridge.models import MoEConfig, MoELlama, parallelize_moe, synthetic_batch
from shardbridge.testing import run_distributed
from torch.distributed.tensor import DTensor, Shard

STEPS = 3
BATCH = 8  # global (8 data-parallel ranks at most)
SEQ = 16
LR = 1e-3
ADAM_EPS = 1e-6  # see test_models.py: keeps Adam's first step from amplifying float noise
GRAD_RTOL = 1e-5  # per parameter: ||g - g_ref|| <= GRAD_RTOL * ||g_ref||
LOSS_RTOL = 1e-5

# name -> (ParallelDims, config overrides, dispatch, world size)
MATRIX = {
    "fsdp4_ep4": (dict(dp_shard=4, ep=4), {}, "all_to_all", 4),
    "fsdp2_tp2_ep2": (dict(dp_shard=2, tp=2, ep=2), {}, "all_to_all", 4),
    "fsdp2_tp2_ep4_gather": (dict(dp_shard=2, tp=2, ep=4), {}, "all_gather", 4),
    "fsdp4_ep1": (dict(dp_shard=4, ep=1), {}, "auto", 4),
    "fsdp4_ep2_gather": (dict(dp_shard=4, ep=2), {}, "all_gather", 4),
    "fsdp2_tp2_ep4": (dict(dp_shard=2, tp=2, ep=4), {}, "all_to_all", 4),
    "hsdp2x2_ep2": (dict(dp_replicate=2, dp_shard=2, ep=2), {}, "all_to_all", 4),
    "hsdp2x1_tp2_ep2": (dict(dp_replicate=2, dp_shard=1, tp=2, ep=2), {}, "all_to_all", 4),
    "cp2_dp2_ep2": (dict(dp_shard=2, cp=2, ep=2), {}, "all_to_all", 4),
    "cp2_dp2_ep4_gather": (dict(dp_shard=2, cp=2, ep=4), {}, "all_gather", 4),
    "cp2_tp2_ep4": (dict(dp_shard=1, cp=2, tp=2, ep=4), {}, "all_to_all", 4),
    "tp4_ep2": (dict(dp_shard=1, tp=4, ep=2), {"num_kv_heads": 4}, "all_to_all", 4),
    "tp4_ep1": (dict(dp_shard=1, tp=4, ep=1), {"num_kv_heads": 4}, "auto", 4),
    "shared_6experts_fsdp4_ep2": (  # 3 local experts over efsdp 2: FSDP shards dim 1
        dict(dp_shard=4, ep=2),
        {"num_experts": 6, "shared_expert_intermediate_size": 48},
        "all_to_all",
        4,
    ),
    "shared_fsdp2_tp2_ep2": (dict(dp_shard=2, tp=2, ep=2), {"shared_expert_intermediate_size": 48}, "all_to_all", 4),
    "top1_unnormed_fsdp4_ep4": (dict(dp_shard=4, ep=4), {"top_k": 1, "norm_topk_prob": False}, "all_to_all", 4),
    "fsdp4_tp2_ep8": (dict(dp_shard=4, tp=2, ep=8), {"num_experts": 16}, "all_to_all", 8),
    "hsdp2x2_tp2_ep4": (dict(dp_replicate=2, dp_shard=2, tp=2, ep=4), {}, "all_to_all", 8),
    "fsdp8_ep2_dim1": (dict(dp_shard=8, ep=2), {"num_experts": 4}, "all_to_all", 8),  # 2 local over efsdp 4
    "cp2_dp2_tp2_ep4": (dict(dp_shard=2, cp=2, tp=2, ep=4), {}, "all_to_all", 8),
}
# CI: one layout per composition issue 26 names (dp_shard x ep, dp_shard x tp x ep, HSDP x ep, cp x ep;
# the last with the all-gather dispatch), ~2 s each on a warm pool
CI = ["fsdp4_ep4", "fsdp2_tp2_ep2", "hsdp2x2_ep2", "cp2_dp2_ep4_gather"]
SELECTED = list(MATRIX) if os.environ.get("SHARDBRIDGE_MOE_MATRIX") == "all" else CI


# -- tier 1 --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"top_k": 9}, r"top_k\(9\) > num_experts\(8\)"),
        ({"num_experts": 0}, r"num_experts=0 must be a positive int"),
        ({"shared_expert_intermediate_size": -1}, r"shared_expert_intermediate_size=-1 must be an int >= 0"),
        ({"router_aux_loss_coef": -0.1}, r"router_aux_loss_coef=-0.1 must be >= 0"),
        ({"dim": 66}, r"dim\(66\) is not divisible by num_heads\(4\)"),  # the Llama rules still hold
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig.tiny(**overrides)


def test_dispatch_choice_and_names():
    assert choose_dispatch("auto", top_k=2, ep=1) == "all_to_all"
    assert choose_dispatch("auto", top_k=2, ep=2) == "all_gather"  # k >= ep: no more bytes, one round
    assert choose_dispatch("auto", top_k=2, ep=4) == "all_to_all"
    assert choose_dispatch("all_gather", top_k=1, ep=8) == "all_gather"
    with pytest.raises(ValueError, match=r"dispatch='a2a' is not one of \['auto', 'all_to_all', 'all_gather'\]"):
        choose_dispatch("a2a", top_k=2, ep=2)
    with pytest.raises(ValueError, match="dispatch='ring'"):
        MoELlama(MoEConfig.tiny()).set_expert_parallel(None, dispatch="ring")


def test_local_experts_match_a_loop_over_tokens():
    """Oracle: each token's top-k experts applied one by one (the definition)."""
    cfg = MoEConfig.tiny(shared_expert_intermediate_size=16)
    ff = MoELlama(cfg).layers[0].feed_forward
    x = torch.randn(7, cfg.dim)
    probs = F.softmax(ff.router(x), dim=-1)
    w, ids = torch.topk(probs, cfg.top_k)
    w = w / w.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(7):
        for slot in range(cfg.top_k):
            e = int(ids[t, slot])
            gate, up = (x[t] @ ff.experts.gate_up_proj[e].T).chunk(2)
            want[t] += w[t, slot] * (F.silu(gate) * up) @ ff.experts.down_proj[e].T
    want += torch.sigmoid(ff.shared_expert_gate(x)) * ff.shared_expert(x)
    torch.testing.assert_close(ff(x.unsqueeze(0)).squeeze(0), want, rtol=1e-5, atol=1e-6)


def test_router_statistics_and_loss_by_hand():
    counts, sums, n = router_statistics(torch.tensor([[0.5, 0.25, 0.25]] * 2), torch.tensor([[0], [2]]), 3)
    assert counts.tolist() == [1, 0, 1] and n == 2
    loss, global_counts = load_balancing_loss(counts, sums, n)
    assert loss.item() == pytest.approx(3 * (0.5 * 0.5 + 0.5 * 0.25)) and torch.equal(global_counts, counts)


def test_expert_shard_dim():
    assert expert_shard_dim((8, 64, 32), ep=2, efsdp=2) == 0  # 4 local experts over 2: one box per rank
    assert expert_shard_dim((6, 64, 32), ep=2, efsdp=2) == 1  # 3 over 2: rows instead
    assert expert_shard_dim((6, 63, 31), ep=2, efsdp=2) == 0  # nothing divides: dim 0, uneven (DCP reads it right)


# -- tier 3: layouts vs one process --------------------------------------------------------------


def _components(named: dict[str, torch.Tensor], fused, tp: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in named.items():
        if name in fused:
            for comp, part in split_fused(value, fused[name], tp).items():
                out[f"{name}:{comp}"] = part.clone()
        else:
            out[name] = value.clone()
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(dims: dict | None, overrides: dict, dispatch: str):
    """Losses, step-1 gradients and final parameters; one process when dims is None."""
    cfg = MoEConfig.tiny(**overrides)
    model = MoELlama(cfg, seed=0)
    pm = None
    if dims is not None:
        pm = ParallelDims(**dims).build_mesh("cpu")
        parallelize_moe(model, pm, dispatch=dispatch)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    fused = fused_params(model)
    tp = 1 if pm is None else pm.dims.tp
    losses, grads = [], None
    for step in range(STEPS):
        if pm is None:
            tokens, labels = synthetic_batch(cfg, BATCH, SEQ, step=step)
            ce = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        else:
            tokens, labels = synthetic_batch(
                cfg, BATCH, SEQ, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size()
            )
            tokens, labels = cp_split(tokens, pm["cp"]), cp_split(labels, pm["cp"])
            ce = cp_cross_entropy(model(tokens), labels, pm)  # the global token mean on every rank
        loss = ce + cfg.router_aux_loss_coef * model.aux_loss
        loss.backward()
        if step == 0:
            grads = _components({n: _full(p.grad) for n, p in model.named_parameters()}, fused, tp)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = _components({n: _full(p.detach()) for n, p in model.named_parameters()}, fused, tp)
    experts = {
        n: (tuple(p.placements), p.device_mesh.mesh_dim_names)
        for n, p in model.named_parameters()
        if ".experts." in n and isinstance(p, DTensor)
    }
    counts = model.tokens_per_expert.clone()
    if dims is not None and dist.get_rank() != 0:
        return losses, counts
    return losses, counts, grads, final, experts


@functools.cache
def _reference(overrides_items: tuple):
    return _train(None, dict(overrides_items), "auto")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("layout", SELECTED)
def test_training_matches_one_process(layout):
    dims, overrides, dispatch, world = MATRIX[layout]
    results = run_distributed(_train, dims, overrides, dispatch, world_size=world)
    ref_losses, ref_counts, ref_grads, ref_final, _ = _reference(tuple(sorted(overrides.items())))
    losses, counts, grads, final, experts = results[0]
    for rank_losses, rank_counts in [(losses, counts)] + [r[:2] for r in results[1:]]:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
        assert torch.equal(rank_counts, ref_counts)  # router statistics are global on every rank
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert _rel(grads[name], ref_grads[name]) <= GRAD_RTOL, (name, _rel(grads[name], ref_grads[name]))
        torch.testing.assert_close(final[name], ref_final[name], rtol=1e-5, atol=1e-5, msg=name)
    cfg = MoEConfig.tiny(**overrides)
    for name, (placements, mesh_dims) in experts.items():
        assert mesh_dims[-1] == "ep" and placements[-1] == Shard(0), (name, placements)
    assert len(experts) == 2 * cfg.num_layers


def _bad_ep():
    pm = ParallelDims(dp_shard=4, ep=4).build_mesh("cpu")
    with pytest.raises(ValueError, match=r"MoEConfig.num_experts\(6\) is not divisible by ep\(4\)"):
        parallelize_moe(MoELlama(MoEConfig.tiny(num_experts=6)), pm)
    pm = ParallelDims(dp_shard=2, tp=2, ep=2).build_mesh("cpu")
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size\(31\) is not divisible by tp\(2\)"):
        parallelize_moe(MoELlama(MoEConfig.tiny(shared_expert_intermediate_size=31)), pm)
    x = torch.zeros(4, 8)
    with pytest.raises(ValueError, match=r"expert_ids hold 0..9, outside \[0, num_experts=8\)"):
        run_experts(x, torch.tensor([[0], [9], [1], [2]]), torch.ones(4, 1), lambda t, c: t, num_experts=8, mesh=pm)
    return True


def test_bad_expert_layouts_are_refused_by_name():
    assert all(run_distributed(_bad_ep, world_size=4))


def _dispatch_under_a_foreign_default_device(mode: str):
    """Every dispatch with torch's default device set to "meta": a tensor the dispatch makes without
    naming the tokens' device lands on meta, which no collective or index on the CPU tokens accepts.
    On a GPU that same tensor would sit on the CPU while the tokens are on CUDA (NCCL refuses it)."""
    import torch.distributed as dist

    pm = ParallelDims(dp_shard=2, tp=2, ep=2).build_mesh("cpu")
    g = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(6, 4, generator=g, requires_grad=True)
    ids = torch.randint(0, 4, (6, 2), generator=g)
    weights = torch.rand(6, 2, generator=g, requires_grad=True)
    scale = torch.arange(1.0, 3.0)  # a factor per local expert
    probs = torch.full((6, 4), 0.25, requires_grad=True)

    def experts(t, counts):
        return t * torch.repeat_interleave(scale, torch.tensor(counts, device=t.device)).unsqueeze(-1)

    def run():
        out = run_experts(x, ids, weights, experts, num_experts=4, mesh=pm, dispatch=mode)
        grads = torch.autograd.grad(out.sum(), (x, weights))
        counts, sums, n = router_statistics(probs, ids, 4)
        loss, _ = load_balancing_loss(counts, sums, n, mesh=pm)
        return out.detach(), *grads, loss.detach()

    want = run()
    torch.set_default_device("meta")
    try:
        got = run()
    finally:
        torch.set_default_device(None)
    return all(w.device == g_.device and torch.equal(w, g_) for w, g_ in zip(want, got))


@pytest.mark.parametrize("mode", ["all_to_all", "all_gather"])
def test_dispatch_makes_every_tensor_on_the_tokens_device(mode):
    # Issue: tensors created without a device broke the dispatch on CUDA/NCCL (sizes and indices on the CPU).
    assert all(run_distributed(_dispatch_under_a_foreign_default_device, mode, world_size=4))
