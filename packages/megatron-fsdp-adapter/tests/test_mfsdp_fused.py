"""Fused SwiGLU / GDN splits of Megatron-FSDP state in global item coordinates (Megatron-LM #4423).

The upstream formula (``split_swiglu_linear_fc1``: slices from ``data.numel() // tp``) is
reproduced HERE ONLY, to show it fails for plain-tensor optimizer states where ours passes.
"""

from __future__ import annotations

import torch
from mfsdp_helpers import build, full_states, item_to_plain, train
from shardbridge import FusedSpec, checkpoint, split_local
from shardbridge.testing import run_distributed


def _upstream_swiglu_split(data: torch.Tensor, tp: int, fsdp_slice: slice) -> dict[str, torch.Tensor]:
    """Megatron-LM's split, flattened: w = [0, n/2), v = [n/2, n) with n = data.numel() // tp,
    intersected with the rank's FSDP slice (item coordinates within the TP-local piece)."""
    n = data.numel() // tp
    flat = data.flatten()
    out = {}
    for name, (lo, hi) in (("gate_proj", (0, n // 2)), ("up_proj", (n // 2, n))):
        a, b = max(lo, fsdp_slice.start), min(hi, fsdp_slice.stop)
        out[name] = flat[a - fsdp_slice.start : b - fsdp_slice.start] if a < b else flat[:0]
    return out


def test_upstream_formula_fails_on_plain_local_state_ours_passes():
    # fc1 [gate(4); up(4)] x 3 columns, tp=2, dp=2: TP-local piece of tp rank 0 = [g0 g1 u0 u1].
    spec = FusedSpec.swiglu(4)
    full = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)  # plain [gate; up]
    gate, up = full[:4], full[4:]
    piece = torch.cat([gate[:2], up[:2]])  # tp rank 0's [g0 g1 u0 u1]
    # FSDP rank 1 of that piece holds rows [2, 4) = u0 u1: a plain local optimizer state.
    local = piece[2:4].clone()
    fsdp_slice = slice(2 * 3, 4 * 3)  # its flat range in the TP-local piece
    # DTensor case: data.numel() is the GLOBAL numel -> upstream is right.
    right = _upstream_swiglu_split(torch.empty(8, 3), 2, fsdp_slice)
    assert right["gate_proj"].numel() == 0 and right["up_proj"].numel() == 6
    # Plain local state: data.numel() = 6 -> n = 3: the up rows are lost.
    wrong = _upstream_swiglu_split(local, 2, fsdp_slice)
    assert wrong["up_proj"].numel() == 0  # the bug: u0, u1 are dropped
    # Ours: item coordinates from the spec; the local state starts at item row 2.
    pieces = split_local(local, spec, 2, 2)
    assert [(p.name, p.component_offset) for p in pieces] == [("up_proj", 0)]
    assert torch.equal(pieces[0].view, up[:2])


def test_gdn_nway_plain_local_state():
    # GDN-style in_proj q(4) k(4) v(8) beta(2), tp=2: item rows [q_j k_j v_j beta_j] per tp rank.
    spec = FusedSpec.nway({"q": 4, "k": 4, "v": 8, "beta": 2})
    comps = {n: torch.randn(s, 5) for n, s in spec.components}
    from shardbridge import merge_fused

    items = merge_fused(comps, spec, 2)
    local = items[7:12].clone()  # a plain shard straddling v_0, beta_0 and q_1
    got = {p.name: (p.component_offset, p.view) for p in split_local(local, spec, 2, 7)}
    assert torch.equal(got["v"][1], comps["v"][3:4])
    assert torch.equal(got["beta"][1], comps["beta"][0:1])
    assert torch.equal(got["q"][1], comps["q"][2:4])


def _plain_states(root: str):
    """Megatron-FSDP dp2 x tp2 with optimizer states converted to PLAIN local tensors (as
    FusedAdam keeps them); save; every rank returns the full exp_avg it had."""
    from shardbridge_megatron_fsdp import save
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from torch.distributed.tensor import DTensor

    pm, model, opt = build({"dp_shard": 2, "tp": 2}, "optim_grads_params", adam=True)
    train(pm, model, opt, steps=2)
    src = {k: item_to_plain(k, v, 2) for k, v in full_states(model, opt, "exp_avg").items()}
    for dp in dist_params(model):
        state = opt.state.get(dp.param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(state.get(key), DTensor):
                state[key] = state[key]._local_tensor  # DTensor -> plain local shard
    save(f"{root}/plain", model=model, optimizer=opt, step=2)
    return src


def test_plain_tensor_states_split_in_item_coordinates(tmp_path):
    src = run_distributed(_plain_states, str(tmp_path), world_size=4, timeout=300)[0]
    # Oracle: torch's own single-process reader of the DCP files.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(tmp_path / "plain", tmp_path / "plain.pt")
    saved = torch.load(tmp_path / "plain.pt", weights_only=True)
    optim = saved["optim"]
    fused = src["layers.0.feed_forward.gate_up.weight"]
    inter = fused.shape[0] // 2
    assert torch.equal(optim["state.layers.0.feed_forward.gate_proj.weight.exp_avg"], fused[:inter])
    assert torch.equal(optim["state.layers.0.feed_forward.up_proj.weight.exp_avg"], fused[inter:])
    qkv = src["layers.1.attention.qkv.weight"]
    q = optim["state.layers.1.attention.q_proj.weight.exp_avg"]
    assert torch.equal(q, qkv[: q.shape[0]])
    assert checkpoint.inspect(tmp_path / "plain") is not None
