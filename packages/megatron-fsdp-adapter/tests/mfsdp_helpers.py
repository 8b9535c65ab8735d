"""Shared pieces of the megatron-fsdp adapter tests (not a test module).

Every distributed function here is module-level so the gloo worker pool can run it.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist
from shardbridge import ParallelDims, PrecisionPolicy
from shardbridge.models import Llama, LlamaConfig, synthetic_batch
from torch.distributed.tensor import DTensor

os.environ.setdefault("OMP_NUM_THREADS", "1")

CFG = LlamaConfig.tiny(num_kv_heads=4)  # tp=4 needs num_kv_heads % 4 == 0
BATCH, SEQ, STEPS, LR = 8, 16, 3, 1e-2


def make_optimizer(model: torch.nn.Module, adam: bool = False) -> torch.optim.Optimizer:
    """Two param groups (norms without weight decay), to check groups survive.

    SGD with momentum for numerics (linear in the gradients, so reduction-order noise stays
    ~1e-7); AdamW where optimizer states matter (checkpoints). Adam divides each update by the
    element's own gradient scale, so noise in near-zero gradients (embedding rows of tokens
    a batch barely has) becomes updates of up to ~1e-4 here: no tight oracle for params.
    """
    decay = [p for n, p in model.named_parameters() if not n.endswith("norm.weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("norm.weight")]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if adam:
        return torch.optim.AdamW(groups, lr=LR, foreach=False)
    return torch.optim.SGD(groups, lr=0.5, momentum=0.9, foreach=False)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def reference(steps: int = STEPS, adam: bool = False) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process fp32 oracle: losses and final parameters."""
    model = Llama(CFG, seed=0)
    opt = make_optimizer(model, adam)
    losses = []
    for step in range(steps):
        tokens, labels = synthetic_batch(CFG, BATCH, SEQ, step=step)
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_grads() -> dict[str, torch.Tensor]:
    """Single-process fp32 gradients of the step-0 batch, by FQN."""
    model = Llama(CFG, seed=0)
    tokens, labels = synthetic_batch(CFG, BATCH, SEQ, step=0)
    loss_fn(model(tokens), labels).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def local_grads(pm, model) -> dict[str, tuple[tuple[slice, ...], torch.Tensor]]:
    """fqn -> (global box, local gradient) of the gradients the optimizer will read, for
    the non-empty shards of this rank (tp=1 only: no fused-item reordering)."""
    from shardbridge_megatron_fsdp._checkpoint import dist_params

    assert pm.dims.tp == 1
    out = {}
    for dp in dist_params(model):
        grad = dp.param.grad
        if grad is None or not dp.local.numel():
            continue
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        out[dp.fqn] = (tuple(slice(o, o + s) for o, s in zip(dp.offsets, dp.local.shape)), local.detach().clone())
    return out


def build(dims: dict, strategy: str, outer=None, policy: PrecisionPolicy | None = None, adam: bool = False):
    """Llama (+ the full TP plan when tp > 1) sharded by shard_model; returns (pm, model, opt)."""
    from shardbridge_megatron_fsdp import apply_llama_tp, shard_model

    pm = ParallelDims(**dims).build_mesh("cpu")
    model = Llama(CFG, seed=0)
    apply_llama_tp(model, pm["tp"])
    opt = make_optimizer(model, adam)
    model, opt = shard_model(model, opt, pm, policy, strategy=strategy, outer_strategy=outer)
    return pm, model, opt


def train(pm, model, opt, steps: int = STEPS, start: int = 0) -> list[float]:
    """Steps on the dp-sharded global batch; returns the dp-mean loss per step."""
    losses = []
    for step in range(start, start + steps):
        tokens, labels = synthetic_batch(
            CFG, BATCH, SEQ, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size()
        )
        loss = loss_fn(model(tokens), labels)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = loss.detach().clone()
        dist.all_reduce(value, group=pm["dp"].get_group())
        losses.append(value.item() / pm["dp"].size())
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    """Global fp32 values of the Megatron-FSDP main weights, assembled from their true boxes
    (NOT full_tensor(), which is wrong for Megatron-FSDP's TP placements)."""
    from shardbridge_megatron_fsdp._checkpoint import dist_params

    out = {}
    for dp in dist_params(model):
        full = torch.zeros(dp.shape, dtype=dp.local.dtype)
        if dp.local.numel():
            box = tuple(slice(o, o + s) for o, s in zip(dp.offsets, dp.local.shape))
            full[box] = dp.local.detach()
        dist.all_reduce(full)  # boxes are disjoint within a replica; replicas hold equal values
        out[dp.fqn] = full / _replicas(dp.param)
    return out


def full_states(model, opt, key: str) -> dict[str, torch.Tensor]:
    """Global values of optimizer state ``key`` assembled from the parameters' boxes."""
    from shardbridge_megatron_fsdp._checkpoint import dist_params

    out = {}
    for dp in dist_params(model):
        full = torch.zeros(dp.shape, dtype=torch.float32)
        value = opt.state.get(dp.param, {}).get(key)
        if value is not None and dp.local.numel():
            local = value._local_tensor if isinstance(value, DTensor) else value
            box = tuple(slice(o, o + s) for o, s in zip(dp.offsets, dp.local.shape))
            full[box] = local.detach().float()
        dist.all_reduce(full)
        out[dp.fqn] = full / _replicas(dp.param)
    return out


def _replicas(param: DTensor) -> int:
    """How many ranks hold each element (world / number of distinct pieces)."""
    from torch.distributed.tensor import Replicate

    replicas = dist.get_world_size()
    for size, p in zip(param.device_mesh.shape, param.placements):
        if not isinstance(p, Replicate):
            replicas //= size
    return replicas


def item_to_plain(fqn: str, full: torch.Tensor, tp: int) -> torch.Tensor:
    """A fused parameter's global item-coordinate tensor at ``tp`` -> plain [gate; up] layout."""
    from shardbridge._fused import fused_params, merge_fused, split_fused

    spec = fused_params(Llama(CFG, seed=0)).get(fqn)
    if spec is None or tp == 1:
        return full
    return merge_fused(split_fused(full, spec, tp), spec, 1)


# (name, mesh dims, strategy, outer strategy)
CONFIGS = [
    ("no_shard", {"dp_shard": 4}, "no_shard", None),
    ("optim", {"dp_shard": 4}, "optim", None),
    ("optim_grads", {"dp_shard": 4}, "optim_grads", None),
    ("optim_grads_params", {"dp_shard": 4}, "optim_grads_params", None),
    ("hsdp_no_shard", {"dp_replicate": 2, "dp_shard": 2}, "optim_grads_params", "no_shard"),
    ("hsdp_optim", {"dp_replicate": 2, "dp_shard": 2}, "optim_grads_params", "optim"),
    ("fsdp2_tp2", {"dp_shard": 2, "tp": 2}, "optim_grads_params", None),
    ("optim_tp2", {"dp_shard": 2, "tp": 2}, "optim", None),
]

HSDP = {"dp_replicate": 2, "dp_shard": 2}

# The full TP plan (row-parallel o_proj/down, vocab-parallel embedding) under the strategies and
# HSDP modes CONFIGS does not cover with TP (CONFIGS has fsdp2_tp2 and optim_tp2), on 4 ranks.
TP_CONFIGS = [
    ("no_shard_tp2", {"dp_shard": 2, "tp": 2}, "no_shard", None),
    ("optim_grads_tp2", {"dp_shard": 2, "tp": 2}, "optim_grads", None),
    ("hsdp_optim_tp2", {"dp_replicate": 2, "dp_shard": 1, "tp": 2}, "optim_grads_params", "optim"),
]
# The rest of the strategy x layout sweep: nox -s megatron_tp_sweep (SHARDBRIDGE_MFSDP_TP_SWEEP=1).
TP_SWEEP = [
    *(
        (f"{s}_tp4", {"dp_shard": 1, "tp": 4}, s, None)
        for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    ),
    ("hsdp_no_shard_tp2", {"dp_replicate": 2, "dp_shard": 1, "tp": 2}, "optim_grads_params", "no_shard"),
    ("hsdp_optim_grads_tp2", {"dp_replicate": 2, "dp_shard": 1, "tp": 2}, "optim_grads", "no_shard"),
    # 8 ranks
    ("fsdp4_tp2", {"dp_shard": 4, "tp": 2}, "optim_grads_params", None),
    ("hsdp2x2_no_shard_tp2", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "optim_grads_params", "no_shard"),
    ("hsdp2x2_optim_tp2", {"dp_replicate": 2, "dp_shard": 2, "tp": 2}, "optim_grads_params", "optim"),
]
TP_SWEEP_ENV = "SHARDBRIDGE_MFSDP_TP_SWEEP"


def world_size(dims: dict) -> int:
    """Ranks a mesh of ``dims`` needs."""
    return math.prod(dims.values())


# fp32 everywhere; only the reduction order differs from the single-process oracle.
RTOL_LOSS, ATOL_PARAM = 1e-5, 1e-5


def backward(pm, model, microbatches: int = 1, no_sync: bool = False):
    """Forward/backward of this rank's part of the step-0 batch, in ``microbatches`` pieces
    (with ``no_sync``: all but the last under ``model.no_sync()``)."""
    from shardbridge.models import synthetic_batch

    dp = pm["dp"]
    tokens, labels = synthetic_batch(CFG, BATCH, SEQ, step=0, dp_rank=dp.get_local_rank(), dp_size=dp.size())
    n = tokens.shape[0] // microbatches
    for i in range(microbatches):
        ctx = model.no_sync() if no_sync and i < microbatches - 1 else contextlib.nullcontext()
        with ctx:
            loss = loss_fn(model(tokens[i * n : (i + 1) * n]), labels[i * n : (i + 1) * n]) / microbatches
            loss.backward()
    return model


def grad_scale(pm, model, ref: dict[str, torch.Tensor]) -> tuple[float, float, float]:
    """(min, max) of <g, ref> / <ref, ref> over the local boxes, and the max abs error."""
    grads = local_grads(pm, model)
    ratios, err = [], 0.0
    for fqn, (box, g) in grads.items():
        r = ref[fqn][box]
        ratios.append(float((g * r).sum() / (r * r).sum()))
        err = max(err, float((g - r).abs().max()))
    return min(ratios), max(ratios), err
