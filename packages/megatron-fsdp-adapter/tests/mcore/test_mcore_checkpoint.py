"""Megatron-Core FSDP checkpoints through the core format, bit-exact across dp2 x tp2 -> dp4 -> tp4:
parameters and AdamW states (fused linear_qkv in Megatron's per-group order and SwiGLU
linear_fc1 stored as components in item coordinates), checked against torch's
``dcp_to_torch_save`` of every checkpoint."""

from __future__ import annotations

import torch
import torch.distributed as dist
from mcore_helpers import build_sharded, gather_full, train
from shardbridge.testing import run_distributed
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save


def _reshard(root: str) -> dict:
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, load, save

    out: dict = {"params": {}, "losses": {}}
    try:
        model, opt = build_sharded({"dp_shard": 2, "tp": 2}, adam=True)
        train(model, opt, steps=2)
        out["params"]["a"] = gather_full(model)
        save(f"{root}/a", model=model, optimizer=opt, step=2)
        out["losses"]["a"] = train(model, opt, steps=1, start=2)
    finally:
        destroy_parallel_state()
    for src, dst, dims in (("a", "b", {"dp_shard": 4}), ("b", "c", {"dp_shard": 1, "tp": 4})):
        try:
            model, opt = build_sharded(dims, seed=1, adam=True, weights=False)
            state = load(f"{root}/{src}", model=model, optimizer=opt)
            out.setdefault("steps", []).append(state.step)
            out["params"][dst] = gather_full(model)
            save(f"{root}/{dst}", model=model, optimizer=opt, step=2)
            out["losses"][dst] = train(model, opt, steps=1, start=2)
        finally:
            destroy_parallel_state()
    dist.barrier()
    return out


def test_reshard_dp2xtp2_dp4_tp4_bit_exact(tmp_path):
    out = run_distributed(_reshard, str(tmp_path), world_size=4, timeout=400)[0]
    assert out["steps"] == [2, 2]
    params = out["params"]
    assert params["a"].keys() == params["b"].keys() == params["c"].keys()
    for name, src in params["a"].items():
        assert torch.equal(params["b"][name], src), name
        assert torch.equal(params["c"][name], src), name
    # Training goes on from the loaded state: the next step's loss agrees across layouts.
    assert abs(out["losses"]["b"][0] - out["losses"]["a"][0]) < 1e-5
    assert abs(out["losses"]["c"][0] - out["losses"]["a"][0]) < 1e-5
    # torch's own reader: every stored tensor (params, components, AdamW states) is identical.
    flat = {}
    for name in "abc":
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
        flat[name] = torch.load(tmp_path / f"{name}.pt", weights_only=True)
    for name in "bc":
        assert flat[name]["model"].keys() == flat["a"]["model"].keys()
        for key, value in flat["a"]["model"].items():
            assert torch.equal(flat[name]["model"][key], value), (name, key)
        optim_a = {k: v for k, v in flat["a"]["optim"].items() if isinstance(v, torch.Tensor)}
        bad = [k for k, v in optim_a.items() if not torch.equal(flat[name]["optim"][k], v)]
        assert not bad, (name, bad)
    model = flat["a"]["model"]
    # Components, not fused tensors, in the checkpoint; the oracle for their values is the
    # plain (tp=1) layout of the gathered weights.
    assert "decoder.layers.0.mlp.linear_fc1.weight" not in model
    gate, up = model["decoder.layers.0.mlp.gate_proj.weight"], model["decoder.layers.0.mlp.up_proj.weight"]
    assert torch.equal(torch.cat([gate, up]), params["a"]["decoder.layers.0.mlp.linear_fc1.weight"])
    q, k, v = (model[f"decoder.layers.1.self_attention.{n}_proj.weight"] for n in "qkv")
    qkv = params["a"]["decoder.layers.1.self_attention.linear_qkv.weight"]
    head = 8  # 4 query groups of head_dim 8, 2 query heads each
    per_group = [torch.cat([q[g * 2 * head : (g + 1) * 2 * head], k[g * head : (g + 1) * head],
                            v[g * head : (g + 1) * head]]) for g in range(4)]  # fmt: skip
    assert k.shape[0] == 4 * head and torch.equal(torch.cat(per_group), qkv)
    # Optimizer step counters are stored as the step the run took (ranks with an empty shard
    # of a parameter never step it; the provider agrees on the maximum before saving).
    steps = {k: float(v) for k, v in flat["a"]["optim"].items() if k.endswith(".step")}
    assert steps and set(steps.values()) == {2.0}, steps
