"""Tests for shardbridge._fused: fused parameters in global item coordinates (pure tier).

The oracle throughout is the components built directly (unique values per element) and the
TP-local pieces built from them with ``torch.chunk``, independently of ``FusedSpec.segments``.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from shardbridge.fused import (
    FUSED_SPECS_ATTR,
    FusedSpec,
    fused_params,
    merge_fused,
    register_fused,
    split_fused,
    split_local,
    tp_local_fused,
)
from torch import nn

# -- oracle ----------------------------------------------------------------------------------


def make_components(spec: FusedSpec, other: int) -> dict[str, torch.Tensor]:
    """Components with globally unique values (any mix-up changes a value)."""
    out, start = {}, 0
    for name, size in spec.components:
        shape = [other, other]
        shape[spec.dim] = size
        n = size * other
        out[name] = torch.arange(start, start + n, dtype=torch.float64).reshape(shape)
        start += n
    return out


def oracle_tp_local(components: dict[str, torch.Tensor], spec: FusedSpec, tp: int, rank: int) -> torch.Tensor:
    """[comp0_j; comp1_j; ...]: the TP shard of each component, concatenated."""
    return torch.cat([torch.chunk(components[n], tp, dim=spec.dim)[rank] for n in spec.names], dim=spec.dim)


def oracle_item_tensor(components: dict[str, torch.Tensor], spec: FusedSpec, tp: int) -> torch.Tensor:
    return torch.cat([oracle_tp_local(components, spec, tp, j) for j in range(tp)], dim=spec.dim)


def dp_chunks(local: torch.Tensor, dp: int, dim: int) -> list[torch.Tensor]:
    """torch.chunk of a TP-local piece over dp ranks, padded with EMPTY chunks to dp entries."""
    chunks = list(torch.chunk(local, dp, dim=dim))
    while len(chunks) < dp:
        chunks.append(local.narrow(dim, local.shape[dim], 0))
    return chunks


# -- strategies ------------------------------------------------------------------------------


@st.composite
def specs_and_tp(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    dim = draw(st.sampled_from([0, 1]))
    kind = draw(st.sampled_from(["swiglu", "qkv", "nway"]))
    if kind == "swiglu":
        spec = FusedSpec.swiglu(tp * draw(st.integers(1, 4)), dim=dim)
    elif kind == "qkv":
        num_kv_heads = tp * draw(st.integers(1, 2))
        num_heads = num_kv_heads * draw(st.integers(1, 3))
        spec = FusedSpec.qkv(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=draw(st.integers(1, 3)), dim=dim)
    else:
        n = draw(st.integers(1, 5))
        spec = FusedSpec.nway({f"c{i}": tp * draw(st.integers(1, 3)) for i in range(n)}, dim=dim)
    return spec, tp


# -- segments, split, merge ------------------------------------------------------------------


def test_segments_swiglu_tp2():
    segs = FusedSpec.swiglu(4).segments(2)
    assert [(s.name, s.item_start, s.item_stop, s.component_start) for s in segs] == [
        ("gate_proj", 0, 2, 0),
        ("up_proj", 2, 4, 0),
        ("gate_proj", 4, 6, 2),
        ("up_proj", 6, 8, 2),
    ]


def test_tp1_is_plain_concat():
    spec = FusedSpec.swiglu(3)
    comps = make_components(spec, 2)
    plain = torch.cat([comps["gate_proj"], comps["up_proj"]])
    parts = split_fused(plain, spec, 1)
    assert torch.equal(parts["gate_proj"], comps["gate_proj"]) and torch.equal(parts["up_proj"], comps["up_proj"])
    assert torch.equal(merge_fused(comps, spec, 1), plain)


@settings(max_examples=60, deadline=None)
@given(specs_and_tp(), st.integers(1, 3))
def test_split_merge_against_oracle(spec_tp, other):
    spec, tp = spec_tp
    comps = make_components(spec, other)
    items = oracle_item_tensor(comps, spec, tp)
    parts = split_fused(items, spec, tp)
    assert parts.keys() == comps.keys()
    for name in spec.names:
        assert torch.equal(parts[name], comps[name]), name
    assert torch.equal(merge_fused(parts, spec, tp), items)
    plain = torch.cat([comps[n] for n in spec.names], dim=spec.dim)
    for rank in range(tp):
        assert torch.equal(tp_local_fused(plain, spec, tp, rank), oracle_tp_local(comps, spec, tp, rank))


@settings(max_examples=80, deadline=None)
@given(specs_and_tp(), st.integers(1, 5), st.integers(1, 3))
def test_split_local_reassembles_every_component(spec_tp, dp, other):
    """Every dp chunk (uneven, empty) of every TP-local piece, split and put back, gives the components."""
    spec, tp = spec_tp
    comps = make_components(spec, other)
    rebuilt = {n: torch.full_like(c, float("nan")) for n, c in comps.items()}
    hits = {n: torch.zeros_like(c) for n, c in comps.items()}
    local_size = spec.total // tp
    for tp_rank in range(tp):
        offset = tp_rank * local_size
        for chunk in dp_chunks(oracle_tp_local(comps, spec, tp, tp_rank), dp, spec.dim):
            pieces = split_local(chunk, spec, tp, offset)
            if chunk.shape[spec.dim] == 0:
                assert pieces == []
            assert sum(p.view.shape[spec.dim] for p in pieces) == chunk.shape[spec.dim]
            for p in pieces:
                assert p.view.untyped_storage().data_ptr() == chunk.untyped_storage().data_ptr()  # a view
                n = p.view.shape[spec.dim]
                rebuilt[p.name].narrow(spec.dim, p.component_offset, n).copy_(p.view)
                hits[p.name].narrow(spec.dim, p.component_offset, n).add_(1)
            offset += chunk.shape[spec.dim]
    for name in spec.names:
        assert torch.equal(rebuilt[name], comps[name]), name
        assert torch.equal(hits[name], torch.ones_like(hits[name])), f"{name} not covered exactly once"


@settings(max_examples=40, deadline=None)
@given(specs_and_tp(), st.integers(1, 4))
def test_split_local_views_write_through(spec_tp, dp):
    """The load direction: writing component values into the views fills the local shard."""
    spec, tp = spec_tp
    comps = make_components(spec, 2)
    local_size = spec.total // tp
    for tp_rank in range(tp):
        expected = oracle_tp_local(comps, spec, tp, tp_rank)
        offset = tp_rank * local_size
        for want in dp_chunks(expected, dp, spec.dim):
            shard = torch.zeros_like(want)  # e.g. a freshly allocated exp_avg shard
            for p in split_local(shard, spec, tp, offset):
                p.view.copy_(comps[p.name].narrow(spec.dim, p.component_offset, p.view.shape[spec.dim]))
            assert torch.equal(shard, want)
            offset += want.shape[spec.dim]


def test_split_local_straddles_boundary_and_empty():
    spec = FusedSpec.swiglu(4)  # tp=2 items: [g0 g1 u0 u1 | g2 g3 u2 u3]
    local = torch.tensor([1.0, 20.0, 21.0])  # items [1, 4)
    pieces = split_local(local, spec, 2, 1)
    assert [(p.name, p.view.tolist(), p.component_offset) for p in pieces] == [
        ("gate_proj", [1.0], 1),
        ("up_proj", [20.0, 21.0], 0),
    ]
    assert split_local(torch.empty(0), spec, 2, 8) == []


# -- QKV grouped heads ----------------------------------------------------------------------


@pytest.mark.parametrize("num_heads,num_kv_heads,tp", [(8, 2, 2), (8, 4, 4), (12, 4, 2), (4, 4, 4), (6, 2, 1)])
def test_qkv_grouped_heads_explicit(num_heads, num_kv_heads, tp):
    """Rank j holds q heads of ITS kv groups, then its k heads, then its v heads (built per head)."""
    head_dim, hidden = 3, 2
    spec = FusedSpec.qkv(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)

    def head(kind: int, h: int) -> torch.Tensor:  # value encodes (kind, head, row, col)
        return torch.arange(head_dim * hidden, dtype=torch.float64).reshape(head_dim, hidden) + 1000 * kind + 100 * h

    q = torch.cat([head(0, h) for h in range(num_heads)])
    k = torch.cat([head(1, g) for g in range(num_kv_heads)])
    v = torch.cat([head(2, g) for g in range(num_kv_heads)])
    plain = torch.cat([q, k, v])
    group_size = num_heads // num_kv_heads
    groups_per_rank = num_kv_heads // tp
    locals_ = []
    for j in range(tp):
        groups = range(j * groups_per_rank, (j + 1) * groups_per_rank)
        q_heads = [head(0, g * group_size + i) for g in groups for i in range(group_size)]
        expected = torch.cat(q_heads + [head(1, g) for g in groups] + [head(2, g) for g in groups])
        assert torch.equal(tp_local_fused(plain, spec, tp, j), expected)
        locals_.append(expected)
    parts = split_fused(torch.cat(locals_), spec, tp)
    assert torch.equal(parts["q_proj"], q) and torch.equal(parts["k_proj"], k) and torch.equal(parts["v_proj"], v)


# -- [Note: item coordinates]: the upstream formula --------------------------------------------


def _intersection(a: slice, b: slice) -> slice:
    start, stop = max(a.start, b.start), min(a.stop, b.stop)
    return slice(0, 0) if start >= stop else slice(start, stop)


def _shift(s: slice, offset: int) -> slice:
    return slice(s.start + offset, s.stop + offset)


def upstream_split_swiglu(data: torch.Tensor, fsdp_slice: slice, tp: int, numel: int | None = None):
    """Megatron-LM ``split_swiglu_linear_fc1`` (core_r0.19): slices from ``data.numel() // tp``.

    ``fsdp_slice`` is the rank's flat range within its TP-local piece. ``numel`` overrides
    ``data.numel()`` (the #4423 fix passes the DTensor parameter's global numel).
    """
    data_size = (data.numel() if numel is None else numel) // tp
    w_slice, v_slice = slice(0, data_size // 2), slice(data_size // 2, data_size)
    flat = data.reshape(-1)
    w = flat[_shift(_intersection(fsdp_slice, w_slice), -fsdp_slice.start)]
    v = flat[_shift(_intersection(fsdp_slice, v_slice), -fsdp_slice.start)]
    return w, v


def test_upstream_formula_wrong_on_plain_local_shard_ours_right():
    dp, tp, hidden = 2, 2, 3
    spec = FusedSpec.swiglu(4)
    comps = make_components(spec, hidden)  # independent oracle
    gate, up = comps["gate_proj"], comps["up_proj"]
    global_numel = spec.total * hidden
    upstream_wrong = upstream_fixed_ok = 0
    for j in range(tp):
        tp_local = torch.cat([gate.chunk(tp)[j], up.chunk(tp)[j]])
        gate_j = gate.chunk(tp)[j].reshape(-1)
        row, flat = 0, 0
        for shard in tp_local.chunk(dp):  # plain-tensor optimizer state shard (e.g. exp_avg)
            fsdp_slice = slice(flat, flat + shard.numel())
            # which flat items of [gate_j; up_j] this shard truly holds
            want_w = tp_local.reshape(-1)[_intersection(fsdp_slice, slice(0, gate_j.numel()))]
            want_v = tp_local.reshape(-1)[_intersection(fsdp_slice, slice(gate_j.numel(), tp_local.numel()))]
            w, v = upstream_split_swiglu(shard, fsdp_slice, tp)
            upstream_wrong += not (torch.equal(w, want_w) and torch.equal(v, want_v))
            w, v = upstream_split_swiglu(shard, fsdp_slice, tp, numel=global_numel)
            upstream_fixed_ok += torch.equal(w, want_w) and torch.equal(v, want_v)
            # ours, in item coordinates along dim 0, checked against the components directly
            for p in split_local(shard, spec, tp, j * (spec.total // tp) + row):
                n = p.view.shape[0]
                assert torch.equal(p.view, comps[p.name][p.component_offset : p.component_offset + n])
            row += shard.shape[0]
            flat += shard.numel()
    assert upstream_wrong == dp * tp  # every shard gets wrong gate/up values
    assert upstream_fixed_ok == dp * tp  # with the global numel (the #4423 fix) it is right


def test_upstream_formula_concrete_values():
    """(dp0, tp0) holds [g0 g1]: upstream gives 'up' half of g0; (dp1, tp0) loses u0 u1."""
    spec = FusedSpec.swiglu(4)
    comps = make_components(spec, 2)
    tp_local0 = torch.cat([comps["gate_proj"][:2], comps["up_proj"][:2]])
    shard0, shard1 = tp_local0.chunk(2)
    _, v = upstream_split_swiglu(shard0, slice(0, 4), tp=2)
    assert torch.equal(v, comps["gate_proj"][0, 1:])  # gate values filed under up
    w, v = upstream_split_swiglu(shard1, slice(4, 8), tp=2)
    assert w.numel() == 0 and v.numel() == 0  # up rows lost
    (piece,) = split_local(shard1, spec, 2, 2)
    assert piece.name == "up_proj" and torch.equal(piece.view, comps["up_proj"][:2])


# -- registry ----------------------------------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 8)
        self.qkv = nn.Linear(3, 16, bias=False)


def test_register_and_find_fused_params():
    model = nn.Sequential(_Block(), _Block())
    swiglu, qkv = FusedSpec.swiglu(4), FusedSpec.qkv(num_heads=2, num_kv_heads=1, head_dim=4)
    for block in model:
        register_fused(block.fc1, "weight", swiglu)
        register_fused(block.fc1, "bias", swiglu)
        register_fused(block.qkv, "weight", qkv)
    found = fused_params(model)
    assert found == {
        "0.fc1.weight": swiglu,
        "0.fc1.bias": swiglu,
        "0.qkv.weight": qkv,
        "1.fc1.weight": swiglu,
        "1.fc1.bias": swiglu,
        "1.qkv.weight": qkv,
    }
    assert set(found) <= {n for n, _ in model.named_parameters()}
    assert getattr(model[0].fc1, FUSED_SPECS_ATTR) == {"weight": swiglu, "bias": swiglu}
    model[0].fc1.weight = nn.Parameter(torch.zeros(4, 3))  # e.g. a TP-local piece at tp=2
    assert fused_params(model)["0.fc1.weight"] == swiglu


def test_register_fused_rejects_bad_param():
    lin = nn.Linear(3, 7)
    with pytest.raises(ValueError, match="no parameter 'w'"):
        register_fused(lin, "w", FusedSpec.swiglu(4))
    with pytest.raises(ValueError, match=r"shape \(7, 3\).*sum to 8"):
        register_fused(lin, "weight", FusedSpec.swiglu(4))


# -- errors ------------------------------------------------------------------------------------


def test_bad_specs_raise():
    with pytest.raises(ValueError, match=r"'up_proj' has size 5 along dim 0, not divisible by tp_size=2"):
        FusedSpec.nway({"gate_proj": 4, "up_proj": 5}).segments(2)
    with pytest.raises(ValueError, match=r"'gate_proj' has size 3 .* tp_size=2"):
        FusedSpec.swiglu(3).segments(2)
    with pytest.raises(ValueError, match=r"num_heads=6 is not a multiple of num_kv_heads=4"):
        FusedSpec.qkv(num_heads=6, num_kv_heads=4, head_dim=8)
    with pytest.raises(ValueError, match=r"num_kv_heads=3 is not divisible by tp_size=2"):
        FusedSpec.qkv(num_heads=6, num_kv_heads=3, head_dim=8).segments(2)
    with pytest.raises(NotImplementedError, match=r"tp_size=4 > num_kv_heads=2.*divides num_kv_heads=2"):
        FusedSpec.qkv(num_heads=8, num_kv_heads=2, head_dim=8).segments(4)
    with pytest.raises(ValueError, match=r"names \['a', 'a'\] are not unique"):
        FusedSpec(components=(("a", 2), ("a", 2)))
    with pytest.raises(ValueError, match=r"\['x'\] size=0 must be a positive int"):
        FusedSpec.nway({"x": 0})
    with pytest.raises(ValueError, match="components is empty"):
        FusedSpec.nway({})
    with pytest.raises(ValueError, match=r"size=10 is not a multiple of head_dim=4"):
        FusedSpec(components=(("q", 10), ("k", 4), ("v", 4)), head_dim=4)
    with pytest.raises(ValueError, match=r"tp_size=0 must be an int >= 1"):
        FusedSpec.swiglu(4).segments(0)


def test_bad_tensors_raise():
    spec = FusedSpec.swiglu(4)
    with pytest.raises(ValueError, match=r"size 7 along dim 0, but the FusedSpec components .* sum to 8"):
        split_fused(torch.zeros(7, 2), spec, 2)
    with pytest.raises(ValueError, match=r"got components \['gate_proj'\]"):
        merge_fused({"gate_proj": torch.zeros(4)}, spec, 2)
    with pytest.raises(ValueError, match=r"'up_proj' has shape \(3,\); FusedSpec expects size 4"):
        merge_fused({"gate_proj": torch.zeros(4), "up_proj": torch.zeros(3)}, spec, 2)
    with pytest.raises(ValueError, match=r"items \[6, 9\) along dim 0, outside the fused size 8"):
        split_local(torch.zeros(3), spec, 2, 6)
    with pytest.raises(ValueError, match=r"tp_rank=2 must be in \[0, tp_size=2\)"):
        tp_local_fused(torch.zeros(8), spec, 2, 2)


def test_spec_helpers():
    spec = FusedSpec.nway({"q": 4, "k": 4, "v": 8, "beta": 2})
    assert spec.names == ("q", "k", "v", "beta") and spec.sizes == (4, 4, 8, 2) and spec.total == 18
    assert spec.local_size(2) == 9
    assert spec.component_shape("v", (18, 5)) == torch.Size([8, 5])
    assert FusedSpec.swiglu(4, names=("w", "v")).names == ("w", "v")
    assert hash(spec) == hash(FusedSpec.nway({"q": 4, "k": 4, "v": 8, "beta": 2}))
