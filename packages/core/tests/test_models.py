"""Tiers 1 and 3: the reference Llama, its TP plan, and parallelize_llama against a single-process oracle.

The oracle is the same model trained in one process on the global batch. Every layout must
reproduce its losses and final parameters (fused ones compared as components).
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardbridge import ParallelDims, fsdp_unit_params
from shardbridge._fused import fused_params
from shardbridge.fused import split_fused
from shardbridge.models import Llama, LlamaConfig, ParamTP, parallelize_llama, synthetic_batch
from shardbridge.testing import run_distributed
from torch.distributed.tensor import DTensor, Replicate, Shard

STEPS = 3
BATCH = 4  # global
SEQ = 16
LR = 1e-3
# Adam's first step is lr * g / (|g| + eps): for g ~ 1e-9 (there are some) float noise in g
# moves the param by ~lr * noise / eps. eps=1e-6 keeps that below the 1e-5 tolerance;
# gradients are compared directly as well (AdamW alone is blind to a wrong gradient scale).
ADAM_EPS = 1e-6


# -- tier 1: config, model, batches ---------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"dim": 66}, r"dim\(66\) is not divisible by num_heads\(4\)"),
        ({"num_kv_heads": 3}, r"num_heads\(4\) is not divisible by num_kv_heads\(3\)"),
        ({"vocab_size": 0}, r"vocab_size=0 must be a positive int"),
        ({"dim": 36, "num_heads": 4}, r"head_dim .* = 9 is odd"),
        ({"norm_eps": 0.0}, r"norm_eps=0.0 must be > 0"),
    ],
)
def test_config_validation(overrides, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig.tiny(**overrides)


def test_presets():
    assert LlamaConfig.tiny().head_dim == 16
    small = LlamaConfig.small()
    with torch.device("meta"):
        model = Llama(small)
    assert 40e6 < sum(p.numel() for p in model.parameters()) < 100e6


def test_init_is_deterministic_and_meta_construction_matches():
    cfg = LlamaConfig.tiny()
    a, b = Llama(cfg, seed=3), Llama(cfg, seed=3)
    with torch.device("meta"):
        c = Llama(cfg)
    c.to_empty(device="cpu")
    c.init_weights(seed=3)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb) and torch.equal(pa, pc), name
    assert torch.equal(a.rope_cos, c.rope_cos)
    assert not torch.equal(Llama(cfg, seed=4).output.weight, a.output.weight)


def test_forward_shape_and_causality():
    model = Llama(LlamaConfig.tiny())
    tokens, _ = synthetic_batch(model.config, 2, 12)
    logits = model(tokens)
    assert logits.shape == (2, 12, 256)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 256
    assert torch.equal(model(changed)[:, :-1], logits[:, :-1])  # later tokens do not leak back


def test_gqa_matches_repeated_kv_heads():
    # Oracle: the same attention with k/v heads repeated explicitly (no enable_gqa).
    cfg = LlamaConfig.tiny()
    model = Llama(cfg)
    attn = model.layers[0].attention
    x = torch.randn(2, 8, cfg.dim)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    q, k, v = attn.qkv(x).split([cfg.num_heads * 16, cfg.num_kv_heads * 16, cfg.num_kv_heads * 16], dim=-1)
    q, k, v = (t.view(2, 8, -1, 16).transpose(1, 2) for t in (q, k, v))
    from shardbridge.models._llama import _apply_rope

    q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
    rep = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 8, -1)
    torch.testing.assert_close(attn(x, cos, sin), attn.o_proj(ref))


def test_synthetic_batch_slices_the_global_batch():
    cfg = LlamaConfig.tiny()
    full, labels = synthetic_batch(cfg, 4, 8, seed=1, step=2)
    parts = [synthetic_batch(cfg, 4, 8, seed=1, step=2, dp_rank=r, dp_size=2)[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), full)
    assert torch.equal(full[:, 1:], labels[:, :-1])
    assert not torch.equal(synthetic_batch(cfg, 4, 8, seed=1, step=3)[0], full)
    with pytest.raises(ValueError, match=r"batch_size\(5\) is not divisible by dp_size\(2\)"):
        synthetic_batch(cfg, 5, 8, dp_rank=0, dp_size=2)


def test_tp_plan_and_fused_registration():
    model = Llama(LlamaConfig.tiny())
    plan = model.tp_plan()
    assert set(plan) == {n for n, _ in model.named_parameters()}
    assert plan["layers.0.attention.qkv.weight"].fused.names == ("q_proj", "k_proj", "v_proj")
    assert plan["layers.1.feed_forward.gate_up.weight"].fused.sizes == (128, 128)
    assert plan["tok_embeddings.weight"] == ParamTP(mode="column")
    assert plan["layers.0.attention.o_proj.weight"].placement == Shard(1)
    assert plan["norm.weight"].placement == Replicate()
    assert set(fused_params(model)) == {n for n, p in plan.items() if p.fused is not None}


def test_fsdp_units_cover_every_parameter():
    for tie in (False, True):
        model = Llama(LlamaConfig.tiny(tie_word_embeddings=tie))
        units = [[u] if isinstance(u, torch.nn.Module) else u for u in model.fsdp_units()]
        claimed = {id(p) for unit in units for module in unit for p in module.parameters()}
        assert claimed == {id(p) for p in model.parameters()}


# -- tier 3: parallelize_llama vs the single-process oracle ----------------------------------


@functools.cache
def _reference(cfg: LlamaConfig):
    """Losses, first-step gradients and final params of the single-process model (global batch)."""
    model = Llama(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    fused = fused_params(model)
    losses, grads = [], None
    for step in range(STEPS):
        tokens, labels = synthetic_batch(cfg, BATCH, SEQ, step=step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        if step == 0:
            grads = _components({n: p.grad for n, p in model.named_parameters()}, fused, tp=1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, _components({n: p.detach() for n, p in model.named_parameters()}, fused, tp=1)


def _full(t):
    """The global tensor of a DTensor; a plain (replicated) tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _components(params, fused, tp):
    out = {}
    for name, value in params.items():
        if name in fused:
            for comp, part in split_fused(value, fused[name], tp).items():
                out[f"{name}:{comp}"] = part.clone()
        else:
            out[name] = value.clone()
    return out


def _train_layout(dims: dict, cfg: LlamaConfig):
    pm = ParallelDims(**dims).build_mesh("cpu")
    model = parallelize_llama(Llama(cfg, seed=0), pm)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    fused = fused_params(model)
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm["dp"].size()
    losses, grads = [], None
    for step in range(STEPS):
        tokens, labels = synthetic_batch(cfg, BATCH, SEQ, step=step, dp_rank=dp_rank, dp_size=dp_size)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        if step == 0:  # AdamW is blind to a wrong gradient scale; check the gradients themselves
            grads = _components({n: _full(p.grad) for n, p in model.named_parameters()}, fused, pm.dims.tp)
        opt.step()
        opt.zero_grad()
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss, group=pm["dp"].get_group())  # equal slices: mean of means
        losses.append(global_loss.item() / dp_size)
    placements = {
        n: (p.placements, p.device_mesh.mesh_dim_names) if isinstance(p, DTensor) else ((), ())
        for n, p in model.named_parameters()
    }
    final = _components({n: _full(p.detach()) for n, p in model.named_parameters()}, fused, pm.dims.tp)
    if dist.get_rank() != 0:
        return losses
    return losses, grads, final, placements, fsdp_unit_params(model)


LAYOUTS = {
    "fsdp4": (dict(dp_shard=4), {}),
    "fsdp2_tp2": (dict(dp_shard=2, tp=2), {}),
    "hsdp2x1_tp2": (dict(dp_replicate=2, dp_shard=1, tp=2), {}),
    "hsdp2x2": (dict(dp_replicate=2, dp_shard=2), {}),
    "tp4": (dict(dp_shard=1, tp=4), {"num_kv_heads": 4}),
    "fsdp2_tp2_vocab250": (dict(dp_shard=2, tp=2), {"vocab_size": 250}),
    "tp4_vocab250": (dict(dp_shard=1, tp=4), {"vocab_size": 250, "num_kv_heads": 4}),
    "fsdp4_vocab250": (dict(dp_shard=4), {"vocab_size": 250}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_matches_single_process_reference(layout):
    dims, overrides = LAYOUTS[layout]
    cfg = LlamaConfig.tiny(**overrides)
    results = run_distributed(_train_layout, dims, cfg, world_size=4)
    ref_losses, ref_grads, ref_final = _reference(cfg)
    losses, grads, final, placements, units = results[0]
    for rank_losses in [losses, *results[1:]]:
        torch.testing.assert_close(torch.tensor(rank_losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert set(grads) == set(final) == set(ref_final)
    for name in ref_final:
        msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-7, msg=msg)
        torch.testing.assert_close(final[name], ref_final[name], rtol=1e-5, atol=1e-5, msg=msg)
    data_parallel = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1) > 1
    # embeddings, blocks, [norm, output], root -- or no FSDP at all without data parallelism
    assert len(units) == (cfg.num_layers + 3 if data_parallel else 0)
    for name, plan in Llama(cfg).tp_plan().items():  # the plan as data matches what was built
        param_placements, mesh_dims = placements[name]
        if dims.get("tp", 1) > 1 and plan.placement != Replicate():
            assert mesh_dims[-1] == "tp" and param_placements[-1] == plan.placement, name
        elif not data_parallel:
            assert param_placements == (), name  # a replicated plain tensor
        else:
            assert "tp" not in mesh_dims, name


def _tied_and_bf16(dims: dict):
    from shardbridge import PrecisionPolicy

    pm = ParallelDims(**dims).build_mesh("cpu")
    cfg = LlamaConfig.tiny(tie_word_embeddings=True)
    model = parallelize_llama(Llama(cfg, seed=0), pm, PrecisionPolicy.bf16())
    assert model.output.weight is model.tok_embeddings.weight
    tokens, labels = synthetic_batch(cfg, BATCH, SEQ, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
    logits = model(tokens)
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    grad = model.tok_embeddings.weight.grad
    return logits.dtype, grad.dtype, isinstance(grad, DTensor), fsdp_unit_params(model)


def test_tied_embeddings_bf16_policy_under_tp():
    out = run_distributed(_tied_and_bf16, dict(dp_shard=2, tp=2), world_size=4)
    logits_dtype, grad_dtype, is_dtensor, units = out[0]
    assert logits_dtype == torch.bfloat16 and grad_dtype == torch.float32 and is_dtensor
    assert units["tok_embeddings+norm+output"] == ("tok_embeddings.weight", "norm.weight")


def _tp_must_divide():
    pm = ParallelDims(dp_shard=1, tp=4).build_mesh("cpu")
    with pytest.raises(ValueError, match=r"num_kv_heads\(2\) is not divisible by tp\(4\)"):
        parallelize_llama(Llama(LlamaConfig.tiny(num_kv_heads=2, num_heads=6, dim=96)), pm)
    with pytest.raises(ValueError, match=r"intermediate_size\(130\) is not divisible by tp\(4\)"):
        parallelize_llama(Llama(LlamaConfig.tiny(num_kv_heads=4, intermediate_size=130)), pm)


def test_tp_degree_must_divide_heads_and_intermediate():
    run_distributed(_tp_must_divide, world_size=4)


def test_init_weights_refuses_dtensors():
    out = run_distributed(_init_after_parallelize, world_size=2)
    assert all(out)


def _init_after_parallelize():
    pm = ParallelDims(dp_shard=2).build_mesh("cpu")
    model = parallelize_llama(Llama(LlamaConfig.tiny()), pm)
    with pytest.raises(ValueError, match="call init_weights before parallelize_llama"):
        model.init_weights(0)
    return True


# -- [Note: TP outputs are not views] (issue 38, C) ---------------------------------------------


def _train_step_warnings(kind: str) -> dict:
    """One train step of a reference model at dp_shard=2 x tp=2, twice: logits scaled out of place, then in place."""
    import warnings

    from shardbridge.models import MoEConfig, MoELlama, parallelize_moe

    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    cfg, build, parallelize = (
        (LlamaConfig.tiny(), Llama, parallelize_llama) if kind == "llama" else (MoEConfig.tiny(), MoELlama, parallelize_moe)
    )
    tokens, labels = synthetic_batch(cfg, BATCH, SEQ, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
    grads, error = {}, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for in_place in (False, True):
            model = parallelize(build(cfg, seed=0), pm)
            logits = model(tokens)
            try:
                logits = logits.mul_(2.0) if in_place else logits * 2.0
                F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
            except RuntimeError as exc:  # before the fix: autograd refused the in-place op on a view
                error = str(exc)[:200]
                continue
            grads[in_place] = {n: _full(p.grad) for n, p in model.named_parameters()}
    views = [str(w.message)[:80] for w in caught if "returned a view tensor" in str(w.message)]
    same = len(grads) == 2 and all(torch.equal(grads[False][n], grads[True][n]) for n in grads[False])
    return {"views": views, "error": error, "same_grads": same}


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_reference_train_step_warns_nothing_and_allows_in_place_logits(kind):
    """README's train_core.py printed FSDP2's "returned a view tensor" warning 3 times per rank; the
    reference models' TP outputs are tensors of their own now, so an in-place op on the logits is
    legal and gives the out-of-place gradients bit for bit."""
    for rank, out in enumerate(run_distributed(_train_step_warnings, kind, world_size=4)):
        assert out["views"] == [], (rank, out["views"])
        assert out["error"] is None and out["same_grads"], (rank, out)


# -- API misuse: one-line TypeError naming the parameter (issue 38, B) --------------------------


def _misuse() -> list[str]:
    from shardbridge import PrecisionPolicy, apply_fsdp

    pm = ParallelDims(dp_shard=2).build_mesh("cpu")
    model = Llama(LlamaConfig.tiny())
    calls = [
        lambda: parallelize_llama(pm, model),  # swapped
        lambda: parallelize_llama(model, pm, PrecisionPolicy.bf16),  # a preset not called
        lambda: parallelize_llama(model, ParallelDims(dp_shard=2)),  # dims, not the built mesh
        lambda: apply_fsdp(model, pm["dp_shard"]),  # a 1-D DeviceMesh
        lambda: synthetic_batch(LlamaConfig.tiny, 4, 16),  # a preset not called
    ]
    out = []
    for call in calls:
        try:
            call()
        except TypeError as exc:
            out.append(str(exc))
        else:
            out.append("accepted")
    return out


def test_api_misuse_is_one_type_error_naming_the_parameter():
    messages = run_distributed(_misuse, world_size=2)[0]
    expected = [
        r"^parallelize_llama\(model=\.\.\.\): expected a Llama, got a ParallelMesh; were `model` and `mesh` swapped\?$",
        r"^parallelize_llama\(policy=\.\.\.\): expected a PrecisionPolicy or None, got the method PrecisionPolicy\.bf16; "
        r"pass PrecisionPolicy\.bf16\(\) \(call it\)$",
        r"^parallelize_llama\(mesh=\.\.\.\): expected a ParallelMesh, got a ParallelDims; call \.build_mesh\(device_type\)",
        r"^apply_fsdp\(mesh=\.\.\.\): expected a ParallelMesh, got a DeviceMesh; pass the ParallelMesh",
        r"^synthetic_batch\(config=\.\.\.\): expected a LlamaConfig, got the method LlamaConfig\.tiny; pass LlamaConfig\.tiny\(\) \(call it\)$",
    ]
    import re

    for message, pattern in zip(messages, expected, strict=True):
        assert re.search(pattern, message) and "\n" not in message, (message, pattern)
