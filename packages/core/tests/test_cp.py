"""Tiers 1 and 3: context parallelism (``shardbridge._cp``) against single-process oracles.

The oracle is the reference Llama run in one process on the same full-length global batch:
every cp layout must reproduce its losses and gradients (1e-5 relative, fp32), and a
checkpoint saved under cp must load bit-exact into other layouts and one process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from shardbridge import ParallelDims
from shardbridge._fused import fused_params
from shardbridge.cp import check_cp_seq_len, cp_attention, cp_cross_entropy, cp_positions, cp_split, cp_unsplit
from shardbridge.fused import split_fused
from shardbridge.models import Llama, LlamaConfig, parallelize_llama, synthetic_batch
from shardbridge.testing import run_distributed
from torch.distributed.tensor import DTensor

BATCH = 4  # global
SEQ = 16
LR = 1e-3
ADAM_EPS = 1e-6  # see test_models.py

# -- tier 1 -----------------------------------------------------------------------------------


def test_positions_are_head_tail_and_cover_the_sequence():
    assert cp_positions(16, 4, 0).tolist() == [0, 1, 14, 15]
    assert cp_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    for cp in (1, 2, 4):
        got = torch.cat([cp_positions(24, cp, r) for r in range(cp)])
        assert sorted(got.tolist()) == list(range(24))
        # equal causal work per rank: sum of (position + 1) is the same on every rank
        work = {int((cp_positions(24, cp, r) + 1).sum()) for r in range(cp)}
        assert len(work) == 1


def test_uneven_sequence_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"sequence length 14 is not divisible by 2 \* cp = 8.*pad the batch to 16"):
        check_cp_seq_len(14, 4)
    with pytest.raises(ValueError, match=r"cp rank\(2\) must be in \[0, cp\(2\)\)"):
        cp_positions(8, 2, 2)
    check_cp_seq_len(14, 1)


def test_attention_mask_from_positions_matches_causal_sdpa():
    # Oracle: causal SDPA on the sequence in order; the same tokens fed permuted (head-tail
    # order of 2 ranks concatenated) with their positions must give the permuted outputs.
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 12, 8), torch.randn(2, 2, 12, 8), torch.randn(2, 2, 12, 8)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    perm = torch.cat([cp_positions(12, 3, r) for r in range(3)])
    got = cp_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], perm, None, enable_gqa=True)
    torch.testing.assert_close(got, ref[:, :, perm])
    batched = cp_attention(q[:, :, perm], k[:, :, perm], v[:, :, perm], perm.expand(2, -1), None, enable_gqa=True)
    torch.testing.assert_close(batched, ref[:, :, perm])


# -- tier 3: split / attention on real gloo ranks -----------------------------------------------


def _split_and_attention(cp: int):
    pm = ParallelDims(dp_shard=-1, cp=cp).build_mesh("cpu")
    torch.manual_seed(0)  # same full tensors on every rank
    q, k, v = (torch.randn(2, h, 16, 8, dtype=torch.float64) for h in (4, 2, 2))
    tokens = torch.arange(32).view(2, 16)
    local = cp_split(tokens, pm["cp"])
    assert torch.equal(cp_unsplit(local, pm["cp"]), tokens)
    positions = cp_positions(16, cp, pm["cp"].get_local_rank())
    assert torch.equal(local[0], positions)

    ref_q, ref_k, ref_v = (t.clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(ref_q, ref_k, ref_v, is_causal=True, enable_gqa=True)
    grad = 1.0 + torch.arange(ref.numel(), dtype=ref.dtype).view_as(ref) % 3  # not uniform: K/V grads differ
    ref.backward(grad)

    for comm in ("all_gather", "ring"):
        lq, lk, lv = (cp_split(t, pm["cp"], dim=2).requires_grad_() for t in (q, k, v))
        out = cp_attention(lq, lk, lv, positions, pm["cp"], enable_gqa=True, comm=comm)
        out.backward(cp_split(grad, pm["cp"], dim=2))
        torch.testing.assert_close(cp_unsplit(out, pm["cp"], dim=2), ref, msg=comm)
        for mine, theirs in ((lq, ref_q), (lk, ref_k), (lv, ref_v)):  # K/V grads sent back to their owner
            torch.testing.assert_close(cp_unsplit(mine.grad, pm["cp"], dim=2), theirs.grad, msg=comm)

    # The general path (any positions, dense mask): a contiguous split with per-sample positions
    # and a sliding window, against SDPA with the same window.
    rank, size = pm["cp"].get_local_rank(), 16 // cp
    window = torch.arange(16)[:, None] - torch.arange(16)[None, :]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=(window >= 0) & (window < 5), enable_gqa=True)
    mine = [t[:, :, rank * size : (rank + 1) * size] for t in (q, k, v)]
    pos = torch.arange(rank * size, (rank + 1) * size).expand(2, -1)
    out = cp_attention(*mine, pos, pm["cp"], enable_gqa=True, sliding_window=5)
    torch.testing.assert_close(out, ref[:, :, rank * size : (rank + 1) * size])
    return True


@pytest.mark.parametrize("cp", [2, 4])
def test_split_unsplit_and_attention_gradients(cp):
    assert all(run_distributed(_split_and_attention, cp, world_size=4))


# -- tier 3: the reference Llama under cp vs one process ----------------------------------------


def _components(params, fused, tp):
    out = {}
    for name, value in params.items():
        if name in fused:
            for comp, part in split_fused(value, fused[name], tp).items():
                out[f"{name}:{comp}"] = part.clone()
        else:
            out[name] = value.clone()
    return out


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _batch(cfg, step, seq, pad_to, dp_rank=0, dp_size=1):
    tokens, labels = synthetic_batch(cfg, BATCH, seq, step=step, dp_rank=dp_rank, dp_size=dp_size)
    if pad_to > seq:  # padded at the end with labels -100: see [Note: load-balanced sequence split]
        tokens = F.pad(tokens, (0, pad_to - seq), value=0)
        labels = F.pad(labels, (0, pad_to - seq), value=-100)
    return tokens, labels


@functools.cache
def _reference(cfg: LlamaConfig, seq: int, steps: int):
    model = Llama(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    fused = fused_params(model)
    losses, grads = [], None
    for step in range(steps):
        tokens, labels = synthetic_batch(cfg, BATCH, seq, step=step)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        if step == 0:
            grads = _components({n: p.grad for n, p in model.named_parameters()}, fused, tp=1)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, _components({n: p.detach() for n, p in model.named_parameters()}, fused, tp=1)


def _train_cp(dims: dict, cfg: LlamaConfig, seq: int, pad_to: int, steps: int, save_to: str | None, comm="all_gather"):
    pm = ParallelDims(**dims).build_mesh("cpu")
    model = parallelize_llama(Llama(cfg, seed=0), pm, cp_comm=comm)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    fused = fused_params(model)
    losses, grads = [], None
    for step in range(steps):
        tokens, labels = _batch(cfg, step, seq, pad_to, pm["dp"].get_local_rank(), pm["dp"].size())
        logits = model(cp_split(tokens, pm["cp"]))
        loss = cp_cross_entropy(logits, cp_split(labels, pm["cp"]), pm)
        loss.backward()
        if step == 0:
            grads = _components({n: _full(p.grad) for n, p in model.named_parameters()}, fused, pm.dims.tp)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    final = _components({n: _full(p.detach()) for n, p in model.named_parameters()}, fused, pm.dims.tp)
    mesh_names = {n: p.device_mesh.mesh_dim_names for n, p in model.named_parameters() if isinstance(p, DTensor)}
    if save_to is not None:
        from shardbridge import checkpoint as ck

        ck.save(save_to, model=model, optimizer=opt, step=steps, parallel_dims=pm.dims)
    return losses, grads if dist.get_rank() == 0 else None, final if dist.get_rank() == 0 else None, mesh_names


CP_LAYOUTS = {
    "cp2_fsdp2": dict(dp_shard=2, cp=2),
    "cp2_tp2": dict(dp_shard=1, cp=2, tp=2),
    "cp4": dict(dp_shard=1, cp=4),
    "hsdp2_cp2": dict(dp_replicate=2, dp_shard=1, cp=2),
    "cp2_fsdp2_ring": dict(dp_shard=2, cp=2),
    "cp4_ring": dict(dp_shard=1, cp=4),
}


@pytest.mark.parametrize("layout", list(CP_LAYOUTS))
def test_llama_under_cp_matches_single_process(layout):
    dims = CP_LAYOUTS[layout]
    cfg = LlamaConfig.tiny()
    comm = "ring" if layout.endswith("ring") else "all_gather"
    results = run_distributed(_train_cp, dims, cfg, SEQ, SEQ, 2, None, comm, world_size=4)
    ref_losses, ref_grads, ref_final = _reference(cfg, SEQ, 2)
    for losses, *_ in results:  # every rank reports the global loss
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _, grads, final, mesh_names = results[0]
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        msg = lambda m, n=name: f"{n}: {m}"  # noqa: E731
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=msg)
        torch.testing.assert_close(final[name], ref_final[name], rtol=1e-5, atol=1e-5, msg=msg)  # Adam: see test_models
    # FSDP shards over the FLATTENED dp_shard_cp (a 2-D (dp_shard, cp) mesh would mean HSDP)
    expected = ("dp_replicate", "dp_shard_cp") if dims.get("dp_replicate", 1) > 1 else ("dp_shard_cp",)
    for name, names in mesh_names.items():
        assert names[: len(expected)] == expected and "cp" not in names, name


def test_padded_uneven_sequence_matches_unpadded_single_process():
    # 14 tokens do not divide 2 * cp = 8; padding to 16 with labels -100 is exact.
    cfg = LlamaConfig.tiny()
    results = run_distributed(_train_cp, dict(dp_shard=1, cp=4), cfg, 14, 16, 1, None, world_size=4)
    ref_losses, ref_grads, _ = _reference(cfg, 14, 1)
    torch.testing.assert_close(torch.tensor(results[0][0]), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for name in ref_grads:
        torch.testing.assert_close(results[0][1][name], ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def _uneven_refused():
    pm = ParallelDims(dp_shard=1, cp=4).build_mesh("cpu")
    with pytest.raises(ValueError, match=r"sequence length 12 is not divisible by 2 \* cp = 8"):
        cp_split(torch.zeros(2, 12, dtype=torch.long), pm["cp"])
    return True


def test_uneven_sequence_refused_on_ranks():
    assert all(run_distributed(_uneven_refused, world_size=4))


# -- checkpoints: parameters are replicated over cp, no new format --------------------------------


def _load_into(dims: dict | None, cfg: LlamaConfig, path: str):
    model, tp = Llama(cfg, seed=1), 1
    if dims is not None:
        pm = ParallelDims(**dims).build_mesh("cpu")
        model, tp = parallelize_llama(model, pm), pm.dims.tp
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    from shardbridge import checkpoint as ck

    state = ck.load(path, model=model, optimizer=opt)
    params = _components({n: _full(p.detach()) for n, p in model.named_parameters()}, fused_params(model), tp)
    return state.step, params if (dims is None or dist.get_rank() == 0) else None


def test_checkpoint_saved_under_cp_loads_bit_exact_elsewhere(tmp_path):
    cfg = LlamaConfig.tiny()
    path = str(tmp_path / "cp2")
    results = run_distributed(_train_cp, CP_LAYOUTS["cp2_fsdp2"], cfg, SEQ, SEQ, 1, path, world_size=4)
    trained = results[0][2]
    for dims in (dict(dp_shard=4), dict(dp_shard=1, cp=2, tp=2), dict(dp_shard=1, cp=4)):
        step, params = run_distributed(_load_into, dims, cfg, path, world_size=4)[0]
        assert step == 1 and set(params) == set(trained)
        for name, value in trained.items():
            assert torch.equal(params[name], value), (dims, name)
    step, params = _load_into(None, cfg, path)  # one process, cp=1
    for name, value in trained.items():
        assert torch.equal(params[name], value), name


def test_demo_refuses_a_seq_len_cp_cannot_split():
    import argparse

    from shardbridge.cli import _demo

    parser = argparse.ArgumentParser()
    _demo.add_arguments(parser)
    args = parser.parse_args(["--cp", "2", "--dp-shard", "2", "--tp", "1", "--seq-len", "30"])
    with pytest.raises(ValueError, match=r"--seq-len=30 is not divisible by 2 \* --cp = 4"):
        _demo._config_from_args(args)
    args = parser.parse_args(["--cp", "0"])
    with pytest.raises(ValueError, match=r"--cp=0 must be >= 1"):
        _demo._config_from_args(args)
