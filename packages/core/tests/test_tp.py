"""Tests for shardbridge._tp (and the DTensor side of shardbridge._fused) on real gloo ranks.

Oracles: the original full tensor (``DTensor.full_tensor()`` must equal it) and single-process
autograd on the full tensors (gradients). Every distributed test runs on the 4-rank pool; tp=2
uses the ``tp`` axis of a 2 x 2 ``("dp", "tp")`` mesh.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardbridge.fused import FusedSpec, merge_fused, shard_fused, split_fused, split_local
from shardbridge.testing import run_distributed
from shardbridge.tp import TPMode, convert_module_params, local_view, to_dtensor_param, tp_placements
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

WORLD = 4


def _meshes(tp: int):
    """(dp mesh or None, tp mesh) over the 4 ranks: tp=4 -> 1-D; tp=2 -> 2 x 2 (dp, tp)."""
    if tp == WORLD:
        return None, init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    mesh = init_device_mesh("cpu", (WORLD // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def _full(shape, seed=0, dtype=torch.float64):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def _tp_shard(full: torch.Tensor, mode: str, tp: int, rank: int) -> torch.Tensor:
    """This rank's torch.chunk piece (empty if torch.chunk gives fewer chunks)."""
    (placement,) = tp_placements(mode)
    if not isinstance(placement, Shard):
        return full.clone()
    chunks = torch.chunk(full, tp, dim=placement.dim)
    if rank < len(chunks):
        return chunks[rank].clone()
    return full.narrow(placement.dim, 0, 0).clone()


# -- pure --------------------------------------------------------------------------------------


def test_modes_and_placements():
    assert tp_placements("column") == (Shard(0),)
    assert tp_placements(TPMode.ROW) == (Shard(1),)
    assert tp_placements("none") == tp_placements("replicated") == (Replicate(),)
    assert TPMode("Column") is TPMode.COLUMN
    with pytest.raises(ValueError, match=r"TP mode 'diagonal' is not one of \['column', 'row', 'none'\]"):
        tp_placements("diagonal")


def test_local_view_passes_plain_tensors():
    t = torch.ones(2, requires_grad=True)
    assert local_view(t) is t


# -- to_dtensor_param: round trip, uneven, inferred global shape ---------------------------------


def _roundtrip(mode, shape, tp, infer):
    _, tp_mesh = _meshes(tp)
    full = _full(shape)
    local = nn.Parameter(_tp_shard(full, mode, tp, tp_mesh.get_local_rank()))
    local._shardbridge_tag = "kept"
    param = to_dtensor_param(local, tp_mesh, mode, global_shape=None if infer else shape)
    assert isinstance(param, nn.Parameter) and isinstance(param, DTensor)
    assert param.placements == tp_placements(mode)
    assert param.shape == torch.Size(shape) and param.stride() == full.stride()
    assert param.requires_grad and param._shardbridge_tag == "kept"
    assert param.to_local().untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
    assert torch.equal(param.full_tensor(), full)
    frozen = to_dtensor_param(local.detach(), tp_mesh, mode, global_shape=shape)
    assert not frozen.requires_grad
    return True


ROUNDTRIP_CASES = [
    ("column", (8, 3), 2),  # even
    ("column", (9, 4), 2),  # uneven: [5, 4]
    ("column", (7, 3), 4),  # uneven: [2, 2, 2, 1]
    ("column", (9,), 2),  # column bias
    ("column", (3, 2), 4),  # [1, 1, 1, 0]: an empty TP-local shard
    ("row", (3, 9), 2),  # uneven Shard(1)
    ("row", (2, 7), 4),
    ("none", (5, 3), 2),
    ("replicated", (7,), 4),
]


@pytest.mark.parametrize("infer", [False, True], ids=["global_shape", "inferred"])
@pytest.mark.parametrize("mode,shape,tp", ROUNDTRIP_CASES)
def test_to_dtensor_param_roundtrip(mode, shape, tp, infer):
    assert run_distributed(_roundtrip, mode, shape, tp, infer, world_size=WORLD) == [True] * WORLD


def _bad_local_shape(case):
    _, tp_mesh = _meshes(2)
    rank = tp_mesh.get_local_rank()
    try:
        if case == "reversed":  # ranks hold [4, 4] and [5, 4]: sums to 9 but not torch.chunk's [5, 4]
            to_dtensor_param(torch.zeros(4 + rank, 4), tp_mesh, "column", global_shape=None)
        elif case == "wrong_global":
            to_dtensor_param(torch.zeros(4, 4), tp_mesh, "column", global_shape=(9, 4))
        elif case == "replicate":
            to_dtensor_param(torch.zeros(4, 4), tp_mesh, "none", global_shape=(4, 5))
        elif case == "row_1d":
            to_dtensor_param(torch.zeros(4), tp_mesh, "row")
        elif case == "mesh_2d":
            to_dtensor_param(torch.zeros(4), init_device_mesh("cpu", (2, 2)), "none")
        elif case == "shard_fused_2d":
            shard_fused(torch.zeros(4, 2), FusedSpec.swiglu(2), init_device_mesh("cpu", (2, 2)))
    except ValueError as e:
        return (rank, str(e))
    return (rank, None)


@pytest.mark.parametrize(
    "case,rank,match",
    [
        (
            "reversed",
            0,
            r"local parameter shape \(4, 4\) on tp rank 0 does not match global shape \(9, 4\) with "
            r"placement Shard\(dim=0\) over tp=2 \(expected \(5, 4\)\).*sizes \[5, 4\] for 9 over tp=2",
        ),
        ("reversed", 1, r"shape \(5, 4\) on tp rank 1 .* \(expected \(4, 4\)\)"),
        ("wrong_global", 0, r"shape \(4, 4\) on tp rank 0 .*global shape \(9, 4\).*pass the right global_shape"),
        ("replicate", 0, r"placement Replicate\(\).*local shape is its global shape"),
        ("row_1d", 0, r"'row' shards dim 1, but the parameter has shape \(4,\); use 'none'"),
        ("mesh_2d", 0, r"tp_mesh must be 1-D, got a 2-D mesh"),
        ("shard_fused_2d", 0, r"tp_mesh must be 1-D, got a 2-D mesh.*pass mesh\['tp'\]"),
    ],
    ids=["reversed-rank0", "reversed-rank1", "wrong_global", "replicate", "row_1d", "mesh_2d", "shard_fused_2d"],
)
def test_bad_local_shape_raises(case, rank, match):
    results = dict(run_distributed(_bad_local_shape, case, world_size=WORLD))
    assert results[rank] is not None, f"no ValueError on tp rank {rank}"
    assert re.search(match, results[rank]), results[rank]


# -- local_view: forward and gradient through a TP MLP ------------------------------------------


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's reduce_from_tensor_model_parallel_region: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _TPMLP(nn.Module):
    """A framework-style MLP that holds LOCAL shards and calls local_view in forward."""

    def __init__(self, w1, b1, w2, b2, tp_mesh):
        super().__init__()
        self.fc1_weight, self.fc1_bias = nn.Parameter(w1), nn.Parameter(b1)
        self.fc2_weight, self.fc2_bias = nn.Parameter(w2), nn.Parameter(b2)
        self.tp_group = tp_mesh.get_group()

    def forward(self, x):
        h = F.gelu(F.linear(x, local_view(self.fc1_weight), local_view(self.fc1_bias)))  # column
        y = _ReduceFromTP.apply(F.linear(h, local_view(self.fc2_weight)), self.tp_group)  # row
        return y + local_view(self.fc2_bias)


MLP_SHAPES = {"fc1_weight": (9, 4), "fc1_bias": (9,), "fc2_weight": (3, 9), "fc2_bias": (3,)}
MLP_MODES = {"fc1_weight": "column", "fc1_bias": "column", "fc2_weight": "row", "fc2_bias": "none"}


def _reference_grads(batches):
    """Single-process autograd on the full tensors; loss averaged over the dp batches."""
    full = {n: _full(s, seed=i + 1).requires_grad_() for i, (n, s) in enumerate(MLP_SHAPES.items())}
    loss = 0
    for x in batches:
        y = F.linear(F.gelu(F.linear(x, full["fc1_weight"], full["fc1_bias"])), full["fc2_weight"], full["fc2_bias"])
        loss = loss + (y**2).sum() / len(batches)
    loss.backward()
    return full, loss.detach(), {n: t.grad for n, t in full.items()}


def _tp_mlp(tp, fsdp, global_shapes):
    dp_mesh, tp_mesh = _meshes(tp)
    tp_rank = tp_mesh.get_local_rank()
    dp, dp_rank = (1, 0) if dp_mesh is None else (dp_mesh.size(), dp_mesh.get_local_rank())
    batches = [_full((5, 4), seed=100 + i) for i in range(dp if fsdp else 1)]
    full, ref_loss, ref_grads = _reference_grads(batches)
    locals_ = {n: _tp_shard(full[n].detach(), MLP_MODES[n], tp, tp_rank) for n in MLP_SHAPES}
    model = _TPMLP(*locals_.values(), tp_mesh)
    model.fc1_weight._shardbridge_marker = 1
    convert_module_params(model, tp_mesh, MLP_MODES, MLP_SHAPES if global_shapes else None)
    assert model.fc1_weight._shardbridge_marker == 1
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, mesh=dp_mesh)
    x = batches[dp_rank if fsdp else 0]
    view = local_view(model.fc1_weight) if not fsdp else None
    if view is not None:
        assert view.requires_grad and not isinstance(view, DTensor)
    loss = (model(x) ** 2).sum()
    loss.backward()
    out = {}
    for name, param in model.named_parameters():
        grad = param.grad
        assert isinstance(grad, DTensor), f"{name}.grad is {type(grad)}"
        assert grad.placements == param.placements, (name, grad.placements, param.placements)
        out[name] = grad.full_tensor()
    if fsdp:
        torch.testing.assert_close(model.fc1_weight.full_tensor(), full["fc1_weight"].detach(), rtol=0, atol=0)
    for name, grad in out.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-12, atol=1e-12, msg=name)
    if not fsdp:
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-12, atol=1e-12)
    return sorted(out)


@pytest.mark.parametrize("tp,fsdp", [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "dp2xtp2_fsdp"])
def test_local_view_forward_backward_matches_reference(tp, fsdp):
    results = run_distributed(_tp_mlp, tp, fsdp, True, world_size=WORLD)
    assert results == [sorted(MLP_SHAPES)] * WORLD


def test_convert_module_params_inferred_shapes():
    results = run_distributed(_tp_mlp, 4, False, False, world_size=WORLD)
    assert results == [sorted(MLP_SHAPES)] * WORLD


def _convert_errors():
    _, tp_mesh = _meshes(2)
    lin = nn.Linear(2, 2)
    msgs = []
    for modes, shapes in [({"nope": "column"}, None), ({"weight": "none"}, {"bias": (2,)})]:
        try:
            convert_module_params(lin, tp_mesh, modes, shapes)
        except ValueError as e:
            msgs.append(str(e))
    convert_module_params(lin, tp_mesh, {"weight": "none"})
    try:
        convert_module_params(lin, tp_mesh, {"weight": "none"})
    except ValueError as e:
        msgs.append(str(e))
    return msgs


def test_convert_module_params_errors():
    msgs = run_distributed(_convert_errors, world_size=WORLD)[0]
    assert len(msgs) == 3
    assert "has no parameter 'nope'; its parameters are ['weight', 'bias']" in msgs[0]
    assert "global_shapes names ['bias'] are not in modes ['weight']" in msgs[1]
    assert "already a DTensor" in msgs[2]


# -- shard_fused -> full_tensor -> split_fused ---------------------------------------------------


def _fused_roundtrip(tp):
    _, tp_mesh = _meshes(tp)
    tp_rank = tp_mesh.get_local_rank()
    specs = [
        FusedSpec.swiglu(8),
        FusedSpec.qkv(num_heads=8, num_kv_heads=4, head_dim=2),
        FusedSpec.nway({"q": 4, "k": 4, "v": 8, "z": 8, "beta": 4, "alpha": 4}),
    ]
    for seed, spec in enumerate(specs):
        comps = {n: _full((s, 3), seed=10 * seed + i) for i, (n, s) in enumerate(spec.components)}
        plain = torch.cat(list(comps.values()))
        dt = shard_fused(plain, spec, tp_mesh)
        assert dt.placements == (Shard(0),) and dt.shape == plain.shape and dt.stride() == plain.stride()
        gathered = dt.full_tensor()  # Shard(0) -> Replicate: item coordinates
        parts = split_fused(gathered, spec, tp)
        for n in spec.names:
            assert torch.equal(parts[n], comps[n]), (spec, n)
        assert torch.equal(merge_fused(comps, spec, tp), gathered)
        # split_local on the DTensor itself: views into this rank's local shard
        local_size = spec.total // tp
        pieces = split_local(dt, spec, tp, tp_rank * local_size)
        assert [p.name for p in pieces] == list(spec.names)
        for p in pieces:
            want = comps[p.name][p.component_offset : p.component_offset + p.view.shape[0]]
            assert torch.equal(p.view, want)
            assert p.view.untyped_storage().data_ptr() == dt.to_local().untyped_storage().data_ptr()
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_shard_fused_full_tensor_split_recovers_components(tp):
    assert run_distributed(_fused_roundtrip, tp, world_size=WORLD) == [True] * WORLD
