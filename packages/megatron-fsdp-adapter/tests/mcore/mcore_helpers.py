"""Shared pieces of the Megatron-Core tests (not a test module).

A small Megatron-Core GPTModel: local (non-TE) layer spec, RMSNorm, SwiGLU, grouped-query
attention (4 heads, 2 query groups), RoPE, untied output layer, fp32. Every distributed
function is module-level so the gloo worker pool can run it.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine|TE|Torch Norm|apex).*")

# Every case: nox -s megatron_core (SHARDBRIDGE_MCORE_FULL=1); CI runs a slice (the cases below
# marked "full only" are extra layouts of what the slice already checks).
FULL = os.environ.get("SHARDBRIDGE_MCORE_FULL") == "1"

VOCAB, SEQ, BATCH, STEPS, LR = 128, 16, 8, 3, 0.1
HIDDEN, HEADS, GROUPS, FFN, LAYERS = 64, 8, 4, 96, 2  # GQA: 2 query heads per group


def gpt_config(tp: int = 1, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        ffn_hidden_size=FFN,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        layernorm_epsilon=1e-5,
        add_bias_linear=False,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    kwargs.update(overrides)
    return TransformerConfig(**kwargs)


def build_gpt(config, *, parallel_output: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        parallel_output=parallel_output,
    )


def full_state(seed: int = 0, **overrides) -> dict[str, torch.Tensor]:
    """Full (tp=1) weights: a tp=1 GPTModel built on this rank after seeding (same on every rank)."""
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, init_parallel_state

    init_parallel_state(ParallelDims(dp_shard=-1, tp=1), seed=seed)
    try:
        torch.manual_seed(seed)
        model = build_gpt(gpt_config(1, **overrides))
        # RMSNorm weights start at 1: perturb them so a wrong norm mapping shows.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_parallel_state()


def load_full(model, full: dict[str, torch.Tensor]) -> None:
    """Copy the TP-local slices of full weights into a freshly built Megatron-Core model."""
    from megatron.core import parallel_state
    from shardbridge_megatron_fsdp.mcore._layout import register_gpt_fused, tp_dim, tp_local

    specs = register_gpt_fused(model, model.config)
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(tp_local(full[name], tp_dim(p), specs.get(name), tp_size, tp_rank))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step % 2)  # two batches, alternating: the loss falls
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def positions(n: int) -> torch.Tensor:
    return torch.arange(SEQ).unsqueeze(0).expand(n, SEQ).contiguous()


def loss_of(model, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean per-token loss (Megatron-Core's vocab-parallel cross entropy when TP > 1)."""
    per_token = model(tokens, positions(tokens.shape[0]), None, labels=labels)
    return per_token.float().mean()


def make_optimizer(model, adam: bool = False) -> torch.optim.Optimizer:
    """SGD + momentum (numerics) or AdamW (checkpoints); norms in a group without weight decay."""
    decay = [p for n, p in model.named_parameters() if "layernorm" not in n]
    no_decay = [p for n, p in model.named_parameters() if "layernorm" in n]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    if adam:
        return torch.optim.AdamW(groups, lr=1e-2, foreach=False)
    return torch.optim.SGD(groups, lr=LR, momentum=0.9, foreach=False)


def build_sharded(
    dims: dict,
    *,
    seed: int = 0,
    adam: bool = False,
    strategy: str = "optim_grads_params",
    weights: bool = True,
    **overrides,
):
    """init_parallel_state + a GPTModel with the full weights of ``full_state(seed)`` + shard_model.

    ``weights=False`` keeps Megatron-Core's own random init (a model a checkpoint is loaded into);
    ``overrides``: TransformerConfig fields (e.g. ``ffn_hidden_size``)."""
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import init_parallel_state, shard_model

    full = full_state(seed, **overrides) if weights else None
    resolved = init_parallel_state(ParallelDims(**dims), seed=seed)
    model = build_gpt(gpt_config(resolved.tp, **overrides))
    if full is not None:
        load_full(model, full)
    opt = make_optimizer(model, adam)
    model, opt = shard_model(model, opt, model.config, strategy=strategy)
    return model, opt


def train(model, opt, steps: int, start: int = 0) -> list[float]:
    """Data-parallel steps over the global batch; returns the global mean loss per step."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    losses = []
    for step in range(start, start + steps):
        tokens, labels = batch(step)
        n = tokens.shape[0] // dp
        loss = loss_of(model, tokens[rank * n : (rank + 1) * n], labels[rank * n : (rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def reference(steps: int = STEPS, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process run (tp=1, no FSDP, full batch) of the same model: losses and final weights.

    Runs on a 1-rank pool (Megatron-Core's parallel_state needs a process group).
    """
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, init_parallel_state

    full = full_state(seed)
    init_parallel_state(ParallelDims(dp_shard=-1, tp=1), seed=seed)
    try:
        model = build_gpt(gpt_config(1))
        load_full(model, full)
        opt = make_optimizer(model)
        losses = []
        for step in range(steps):
            tokens, labels = batch(step)
            loss = loss_of(model, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_parallel_state()


def gather_full(wrapped, values: dict | None = None) -> dict[str, torch.Tensor]:
    """Full tp=1-layout tensors of a wrapped model's parameters (or of ``values``: fqn -> a tensor
    laid out like the parameter's shard, e.g. an optimizer state), all-gathered.

    Uses the chunk boxes Megatron-FSDP records (never ``full_tensor()``); fused parameters go
    from item coordinates to the plain ``[gate; up]`` / per-group QKV layout through the core's
    ``split_local`` + ``merge_fused``.
    """
    from shardbridge._fused import merge_fused, split_local
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from shardbridge_megatron_fsdp.mcore._layout import fused_tp

    out = {}
    for dp in dist_params(wrapped):
        local = dp.local.detach() if values is None else values[dp.fqn]
        if hasattr(local, "to_local"):
            local = local.to_local()
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, (dp.offsets, local.detach().clone()))
        full = torch.zeros(dp.shape, dtype=local.dtype)
        for offsets, t in pieces:
            if t.numel():
                full[tuple(slice(o, o + s) for o, s in zip(offsets, t.shape))] = t
        if dp.spec is not None:
            comps = {}
            for piece in split_local(full, dp.spec, fused_tp(dp.spec, dp.param), 0):
                comps.setdefault(piece.name, []).append((piece.component_offset, piece.view))
            parts = {n: torch.cat([v for _, v in sorted(c, key=lambda x: x[0])], dp.spec.dim) for n, c in comps.items()}
            full = merge_fused(parts, dp.spec, 1)
        out[dp.fqn] = full
    return out


def optimizer_states(wrapped, opt, key: str) -> dict:
    """fqn -> this rank's optimizer state ``key`` of each distributed parameter."""
    from shardbridge_megatron_fsdp._checkpoint import dist_params

    return {dp.fqn: opt.state[dp.param][key] for dp in dist_params(wrapped)}
