"""Fused SwiGLU / GDN splits of Megatron-FSDP state in global item coordinates (Megatron-LM #4423).

The upstream formula (``split_swiglu_linear_fc1``: slices from ``data.numel() // tp``) is
reproduced HERE ONLY, to show it fails for plain-tensor optimizer states where ours passes.
"""

from __future__ import annotations

import torch
from mfsdp_helpers import build, full_states, item_to_plain, train
from shardbridge import checkpoint
from shardbridge.fused import FusedSpec, split_local
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
    from shardbridge.fused import merge_fused

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


# --- GDN-style n-way fused in_proj through Megatron-FSDP (dp2 x tp2), end to end -------------
# Component rows of a GDN-like in_proj (q, k, v, z, beta, alpha; unequal sizes). tp=2: each TP
# piece is 28 item rows [q_j k_j v_j z_j b_j a_j], and dp_shard=2 splits each piece at row 14
# (inside v_j; the norm weight before in_proj shifts the bucket midpoint), so boxes straddle
# components (asserted below).
GDN_SIZES = {"in_proj_q": 8, "in_proj_k": 8, "in_proj_v": 16, "in_proj_z": 16, "in_proj_b": 4, "in_proj_a": 4}
GDN_DIM = 12


class _GDNBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from shardbridge.fused import register_fused

        total = sum(GDN_SIZES.values())
        self.norm = torch.nn.RMSNorm(GDN_DIM)
        self.in_proj = torch.nn.Linear(GDN_DIM, total, bias=False)
        register_fused(self.in_proj, "weight", FusedSpec.nway(GDN_SIZES))
        self.out_proj = torch.nn.Linear(total, GDN_DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.tanh(self.in_proj(self.norm(x))))


class _GDNNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList([_GDNBlock(), _GDNBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _build_gdn(dims: dict):
    from shardbridge import ParallelDims
    from shardbridge.fused import shard_fused
    from shardbridge_megatron_fsdp import shard_model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    pm = ParallelDims(**dims).build_mesh("cpu")
    model = _GDNNet()
    if pm.dims.tp > 1:
        for block in model.layers:
            # plain [q; k; v; z; b; a] -> Shard(0) in item coordinates (rank j: [q_j k_j ... a_j])
            spec = FusedSpec.nway(GDN_SIZES)
            block.in_proj.weight = torch.nn.Parameter(shard_fused(block.in_proj.weight.detach(), spec, pm["tp"]))
            parallelize_module(block.in_proj, pm["tp"], ColwiseParallel())  # local [q_j .. a_j] out
            # row-parallel Shard(1): the TP function differs from tp=1's (its input is in item
            # order), which this test does not need: it compares checkpointed values only
            parallelize_module(block.out_proj, pm["tp"], RowwiseParallel())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    model, opt = shard_model(model, opt, pm, strategy="optim_grads_params")
    return pm, model, opt


def _gdn_train(pm, model, opt, steps: int) -> None:
    gen = torch.Generator().manual_seed(pm["dp"].get_local_rank())
    for _ in range(steps):
        x = torch.randn(4, GDN_DIM, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _gdn_run(root: str) -> dict:
    """dp2 x tp2: train, save with DTensor states ("dt") and with plain local states ("plain"),
    load "plain" at tp=1 (dp4; "dt" holds the same values, checked on disk); return the sources (item coordinates), the tp=1 loads (plain
    layout), and this rank's plain local in_proj exp_avg with its box (for the upstream formula)."""
    from mfsdp_helpers import full_params
    from shardbridge_megatron_fsdp import load, save
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from torch.distributed.tensor import DTensor

    pm, model, opt = _build_gdn({"dp_shard": 2, "tp": 2})
    _gdn_train(pm, model, opt, steps=2)
    out = {"params": full_params(model), "exp_avg": full_states(model, opt, "exp_avg")}
    save(f"{root}/dt", model=model, optimizer=opt, step=2)
    out["local"] = []
    for dp in dist_params(model):
        state = opt.state.get(dp.param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            if isinstance(state.get(key), DTensor):
                state[key] = state[key]._local_tensor  # DTensor -> plain local shard (FusedAdam)
        if dp.spec is not None and "exp_avg" in state:
            out["local"].append((dp.fqn, dp.offsets[0], state["exp_avg"].clone()))
    save(f"{root}/plain", model=model, optimizer=opt, step=2)
    pm1, m1, o1 = _build_gdn({"dp_shard": 4})
    load(f"{root}/plain", model=m1, optimizer=o1)
    out["tp1"] = (full_params(m1), full_states(m1, o1, "exp_avg"))
    return out


def _gdn_components(items: torch.Tensor, tp: int) -> dict[str, torch.Tensor]:
    """Oracle, by hand (not the core's algebra): TP piece j holds [c_j for c in components]."""
    piece = items.shape[0] // tp
    out = {}
    start = 0
    for name, size in GDN_SIZES.items():
        rows = size // tp
        out[name] = torch.cat([items[j * piece + start : j * piece + start + rows] for j in range(tp)])
        start += rows
    return out


def _upstream_gdn_split(data: torch.Tensor, tp: int, row_in_piece: int) -> dict[str, torch.Tensor]:
    """Megatron-LM's split_gdn_fused formula, flattened: component slices of the TP-local piece
    from n = data.numel() // tp, intersected with the rank's FSDP slice (item coordinates)."""
    cols = data.shape[1]
    n = data.numel() // tp
    total = sum(GDN_SIZES.values())
    lo_slice = row_in_piece * cols
    fsdp = (lo_slice, lo_slice + data.numel())
    flat, out, start = data.flatten(), {}, 0
    for name, size in GDN_SIZES.items():
        lo, hi = n * start // total, n * (start + size) // total
        a, b = max(lo, fsdp[0]), min(hi, fsdp[1])
        out[name] = flat[a - fsdp[0] : b - fsdp[0]] if a < b else flat[:0]
        start += size
    return out


def test_gdn_nway_end_to_end(tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    results = run_distributed(_gdn_run, str(tmp_path), world_size=4, timeout=300)
    src = results[0]
    fqns = [f"layers.{i}.in_proj.weight" for i in range(2)]
    for name in ("dt", "plain"):
        dcp_to_torch_save(tmp_path / name, tmp_path / f"{name}.pt")
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        for fqn in fqns:
            prefix = fqn.rsplit(".", 2)[0]
            want_p = _gdn_components(src["params"][fqn], 2)
            want_m = _gdn_components(src["exp_avg"][fqn], 2)
            assert fqn not in saved["model"]
            for comp in GDN_SIZES:
                assert torch.equal(saved["model"][f"{prefix}.{comp}.weight"], want_p[comp]), (name, fqn, comp)
                got = saved["optim"][f"state.{prefix}.{comp}.weight.exp_avg"]
                assert torch.equal(got, want_m[comp]), (name, fqn, comp)
    # tp=2 -> tp=1 (plain [q; k; v; z; b; a] layout), params and states, bit-exact, every rank
    for rank_result in results:
        params1, avg1 = rank_result["tp1"]
        for fqn in fqns:
            plain_p = torch.cat(list(_gdn_components(src["params"][fqn], 2).values()))
            plain_m = torch.cat(list(_gdn_components(src["exp_avg"][fqn], 2).values()))
            assert torch.equal(params1[fqn], plain_p) and torch.equal(avg1[fqn], plain_m), fqn
    # The upstream formula on the same plain local states: wrong on at least one rank, while
    # the checkpoint above (split_local from the box) was right on all of them.
    wrong = 0
    piece = sum(GDN_SIZES.values()) // 2
    boundaries = {sum(list(GDN_SIZES.values())[:i]) // 2 for i in range(len(GDN_SIZES))}
    assert any(offset % piece not in boundaries for r in results for _, offset, _ in r["local"])
    for rank_result in results:
        for fqn, offset, local in rank_result["local"]:
            upstream = _upstream_gdn_split(local, 2, offset % piece)
            j = offset // piece
            truth = _gdn_components(src["exp_avg"][fqn], 2)
            rows = {c: s // 2 for c, s in GDN_SIZES.items()}
            # expected: the rows of each component this shard covers, in its tp piece j
            start, expected = 0, {}
            for comp, r in rows.items():
                lo, hi = max(start, offset % piece), min(start + r, offset % piece + local.shape[0])
                expected[comp] = truth[comp][j * r + lo - start : j * r + hi - start] if lo < hi else local[:0]
                start += r
            assert torch.equal(torch.cat(list(expected.values())), local)  # the box is right
            if any(not torch.equal(upstream[c], expected[c].flatten()) for c in GDN_SIZES):
                wrong += 1
    assert wrong > 0
