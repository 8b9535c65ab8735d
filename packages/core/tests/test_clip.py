"""Tier 3: clip_grad_norm_ over parameters on mixed meshes (FSDP2 x TP, HSDP x TP).

Oracle: torch.nn.utils.clip_grad_norm_ on the same model in one process on the global batch
(total norm, and every clipped gradient through full_tensor()).
"""

import pytest
import torch
import torch.nn.functional as F
from shardbridge import ParallelDims, clip_grad_norm_
from shardbridge._fused import fused_params
from shardbridge.fused import split_fused
from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch
from shardbridge.testing import run_distributed
from torch.distributed.tensor import DTensor

CFG = LlamaConfig.tiny(vocab_size=250)  # uneven over tp: padded shards must not count
BATCH, SEQ = 4, 16


def _components(model, grads: dict, tp: int) -> dict:
    """Fused parameters (qkv, gate_up) as their components: a TP-fused full tensor is laid out
    per TP piece, the single-process one is not."""
    fused, out = fused_params(model), {}
    for name, value in grads.items():
        parts = split_fused(value, fused[name], tp) if name in fused else {"": value}
        out.update({f"{name}:{comp}": part.clone() for comp, part in parts.items()})
    return out


def _reference(max_norm: float, norm_type: float):
    model = Llama(CFG, seed=0)
    tokens, labels = synthetic_batch(CFG, BATCH, SEQ, step=0)
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
    return norm, _components(model, {n: p.grad for n, p in model.named_parameters()}, tp=1)


def _clip_layout(dims: dict, max_norm: float, norm_type: float, use_torch: bool):
    pm = ParallelDims(**dims).build_mesh("cpu")
    model = parallelize_llama(Llama(CFG, seed=0), pm)
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm["dp"].size()
    tokens, labels = synthetic_batch(CFG, BATCH, SEQ, step=0, dp_rank=dp_rank, dp_size=dp_size)
    F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    meshes = {p.device_mesh.mesh_dim_names for p in model.parameters() if isinstance(p, DTensor)}
    if use_torch:
        try:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        except Exception as exc:  # noqa: BLE001 - the canary reports what torch raised
            return {"meshes": meshes, "torch_error": str(exc)[:300]}
        return {"meshes": meshes, "torch_error": None}
    norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return {"meshes": meshes, "norm": norm, "grads": _components(model, grads, pm.dims.tp)}


LAYOUTS = {
    "fsdp2_tp2": dict(dp_shard=2, tp=2),
    "hsdp2x1_tp2": dict(dp_replicate=2, dp_shard=1, tp=2),
    "fsdp4": dict(dp_shard=4),
}


@pytest.mark.parametrize("dims", list(LAYOUTS.values()), ids=list(LAYOUTS))
@pytest.mark.parametrize(("max_norm", "norm_type"), [(0.5, 2.0), (1e-3, float("inf")), (1e6, 2.0), (5.0, 1.0)])
def test_matches_single_process_clip(dims, max_norm, norm_type):
    ref_norm, ref_grads = _reference(max_norm, norm_type)
    for r in run_distributed(_clip_layout, dims, max_norm, norm_type, False, world_size=4):
        if dims.get("tp", 1) > 1:
            assert len(r["meshes"]) == 2, r["meshes"]  # the case torch's own clip refuses
        torch.testing.assert_close(r["norm"], ref_norm, rtol=1e-5, atol=0)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(r["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.bias = torch.nn.Parameter(torch.randn(1, 8, generator=g))  # 1 row over dp 4: 3 empty shards
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x + self.bias)


def _tiny_grads(x: torch.Tensor, norm_type: float, sharded: bool):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _Tiny()
    if sharded:
        fully_shard(model, mesh=ParallelDims(dp_shard=4).build_mesh("cpu")["dp_shard"])
        x = x.chunk(4)[torch.distributed.get_rank()]
    (model(x).pow(2).sum() / (1 if sharded else 4)).backward()  # FSDP averages over the 4 ranks
    norm = (clip_grad_norm_ if sharded else torch.nn.utils.clip_grad_norm_)(model.parameters(), 0.01, norm_type)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    local = {n: p.grad.to_local().numel() for n, p in model.named_parameters() if isinstance(p.grad, DTensor)}
    return norm, grads, local


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_empty_local_shards(norm_type):
    # FSDP2 gives ranks 1-3 an empty shard of the (1, 8) parameter; torch's foreach inf-norm
    # refuses empty tensors, and a rank that raised would leave the others in the all-reduce.
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ref_norm, ref_grads, _ = _tiny_grads(x, norm_type, sharded=False)
    results = run_distributed(_tiny_grads, x, norm_type, True, world_size=4)
    assert [r[2]["bias"] for r in results] == [8, 0, 0, 0]
    for norm, grads, _ in results:
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        for name, grad in ref_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def test_torch_clip_refuses_mixed_meshes():
    # Canary: the reason this function exists. If torch learns to clip across meshes, say so here.
    r = run_distributed(_clip_layout, LAYOUTS["fsdp2_tp2"], 1.0, 2.0, True, world_size=4)[0]
    assert r["torch_error"] is not None, "torch.nn.utils.clip_grad_norm_ now handles mixed meshes"
    assert "must have the same mesh" in r["torch_error"], r["torch_error"]


def test_plain_tensors_and_errors():
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 4.0)
    norm = clip_grad_norm_([a, b, torch.nn.Parameter(torch.ones(2))], 1.0)  # a grad-less param is skipped
    assert torch.equal(norm, torch.linalg.vector_norm(torch.tensor([3.0] * 3 + [4.0] * 4)))
    torch.testing.assert_close(
        torch.linalg.vector_norm(torch.cat([a.grad, b.grad])), torch.tensor(1.0), rtol=1e-5, atol=0
    )
    a.grad[0] = float("nan")
    with pytest.raises(RuntimeError, match="total norm of order 2.0 of the gradients is nan"):
        clip_grad_norm_([a, b], 1.0, error_if_nonfinite=True)
    with pytest.raises(ValueError, match="max_norm=-1 must be >= 0"):
        clip_grad_norm_([a], -1)


def test_signature_matches_torch():
    """Every parameter of torch's clip_grad_norm_, in torch's order and with torch's defaults."""
    import inspect

    ours = inspect.signature(clip_grad_norm_).parameters
    theirs = inspect.signature(torch.nn.utils.clip_grad_norm_).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        assert ours[name].default == param.default, name
        assert ours[name].kind == param.kind, name
    assert ours["group"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_foreach_modes_agree_with_torch(foreach, norm_type):
    torch.manual_seed(0)
    grads = [torch.randn(5), torch.randn(3, 4), torch.zeros(0)]

    def params():
        out = []
        for g in grads:
            p = torch.nn.Parameter(torch.zeros_like(g))
            p.grad = g.clone()
            out.append(p)
        return out

    ours, theirs = params(), params()
    # positional like torch: (parameters, max_norm, norm_type, error_if_nonfinite, foreach)
    norm = clip_grad_norm_(ours, 0.5, norm_type, False, foreach)
    ref = torch.nn.utils.clip_grad_norm_([p for p in theirs if p.numel()], 0.5, norm_type, False, foreach)
    torch.testing.assert_close(norm, ref, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)


def test_foreach_true_on_an_unsupported_device_is_refused():
    p = torch.nn.Parameter(torch.zeros(2, device="meta"))
    p.grad = torch.zeros(2, device="meta")
    with pytest.raises(RuntimeError, match=r"foreach=True was passed.*\['meta'\]"):
        clip_grad_norm_([p], 1.0, foreach=True)
