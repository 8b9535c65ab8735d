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
    strategy: str | None = None,
    weights: bool = True,
    **overrides,
):
    """init_parallel_state + a GPTModel with the full weights of ``full_state(seed)`` + shard_model.

    ``weights=False`` keeps Megatron-Core's own random init (a model a checkpoint is loaded into);
    ``strategy=None``: :func:`right_strategy`; ``overrides``: TransformerConfig fields (e.g.
    ``ffn_hidden_size``)."""
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import init_parallel_state, shard_model

    full = full_state(seed, **overrides) if weights else None
    resolved = init_parallel_state(ParallelDims(**dims), seed=seed)
    model = build_gpt(gpt_config(resolved.tp, **overrides))
    if full is not None:
        load_full(model, full)
    opt = make_optimizer(model, adam)
    model, opt = shard_model(model, opt, model.config, strategy=strategy or right_strategy(resolved))
    return model, opt


def right_strategy(dims) -> str:
    """A strategy megatron-core 0.16.1 reduces gradients right for at ``dims``' dense dp group:
    optim_grads_params at dp >= 2, optim at dp = 1 ([Note: Megatron-Core 0.16.1 gradient
    reduction] in ``mcore/_shard.py``)."""
    return "optim" if dims.dp_shard * dims.cp == 1 else "optim_grads_params"


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


# ----------------------------------------------------------------------------- MoE
# The same GPT with every MLP a Megatron-Core MoE layer (its local spec: TopKRouter, SequentialMLP
# experts, the alltoall token dispatcher), Mixtral's routing: softmax, top-2 renormalised.
EXPERTS, TOP_K, EXPERT_FFN = 4, 2, 32


def moe_config(tp: int = 1, ep: int = 1, **overrides):
    kwargs = dict(
        num_moe_experts=EXPERTS,
        moe_router_topk=TOP_K,
        moe_ffn_hidden_size=EXPERT_FFN,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=ep,
        sequence_parallel=tp > 1,
    )
    kwargs.update(overrides)
    return gpt_config(tp, **kwargs)


def build_moe(config, *, parallel_output: bool = True):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(num_experts=config.num_moe_experts, normalization="RMSNorm"),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        parallel_output=parallel_output,
    )


def stacked(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``...experts.local_experts.{e}.X`` of an ep=1 model -> ``...experts.X`` ``[E, ...]``; the rest as is."""
    import re

    out, experts = {}, {}
    for name, value in per_expert.items():
        m = re.fullmatch(r"(.*\.experts)\.local_experts\.(\d+)\.(.+)", name)
        if m is None:
            out[name] = value
        else:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = value
    for name, by_index in experts.items():
        out[name] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


def moe_full_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full weights of a tp=1, ep=1 MoE GPT built after seeding, experts under their global index."""
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, init_parallel_state

    init_parallel_state(ParallelDims(dp_shard=-1), seed=seed)
    try:
        torch.manual_seed(seed)
        model = build_moe(moe_config())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "layernorm" in name:
                    p.add_(0.1 * torch.randn_like(p))
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        destroy_parallel_state()


def load_full_moe(model, full: dict[str, torch.Tensor]) -> None:
    """Copy full weights (ep=1 names) into a MoE model built at any tp x ep: local expert i of a
    layer takes global expert ``local_expert_indices[i]``."""
    import re

    from megatron.core import parallel_state
    from shardbridge_megatron_fsdp.mcore._layout import register_gpt_fused, tp_dim, tp_local

    specs = register_gpt_fused(model, model.config)
    indices = {p: m.local_expert_indices for p, m in model.named_modules() if hasattr(m, "local_expert_indices")}
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, p in model.named_parameters():
            m = re.fullmatch(r"(.*)\.experts\.local_experts\.(\d+)\.(.+)", name)
            if m is not None:  # experts: not tensor-parallel (expert_tensor_parallel_size=1)
                glob = indices[m.group(1)][int(m.group(2))]
                p.copy_(full[f"{m.group(1)}.experts.local_experts.{glob}.{m.group(3)}"])
            else:
                p.copy_(tp_local(full[name], tp_dim(p), specs.get(name), tp_size, tp_rank))


def build_sharded_moe(dims: dict, *, seed: int = 0, adam: bool = False, strategy: str | None = None,
                      weights: bool = True, **overrides):  # fmt: skip
    """init_parallel_state (ep from ``dims``) + the MoE GPT with ``moe_full_state(seed)`` + shard_model
    (``strategy=None``: :func:`right_strategy` of the dense group)."""
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import init_parallel_state, shard_model

    full = moe_full_state(seed) if weights else None
    resolved = init_parallel_state(ParallelDims(**dims), seed=seed)
    model = build_moe(moe_config(resolved.tp, resolved.ep, **overrides))
    if full is not None:
        load_full_moe(model, full)
    opt = make_optimizer(model, adam)
    model, opt = shard_model(model, opt, model.config, strategy=strategy or right_strategy(resolved))
    return model, opt


def moe_reference(steps: int = STEPS, seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process run (tp=1, ep=1, no FSDP, full batch) of the MoE GPT: losses, stacked final weights."""
    from shardbridge import ParallelDims
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, init_parallel_state

    full = moe_full_state(seed)
    init_parallel_state(ParallelDims(dp_shard=-1), seed=seed)
    try:
        model = build_moe(moe_config())
        load_full_moe(model, full)
        opt = make_optimizer(model)
        losses = []
        for step in range(steps):
            tokens, labels = batch(step)
            loss = loss_of(model, tokens, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses, stacked({n: p.detach().clone() for n, p in model.named_parameters()})
    finally:
        destroy_parallel_state()


def gather_stacked(wrapped, values: dict | None = None) -> dict[str, torch.Tensor]:
    """As :func:`gather_full`, with each registered local expert placed at its global index of the
    stored ``[E, ...]`` tensor (the checkpoint's names and layout)."""
    from shardbridge_megatron_fsdp._checkpoint import dist_params
    from shardbridge_megatron_fsdp._compat import megatron_fsdp_module
    from shardbridge_megatron_fsdp._experts import expert_slots

    slots = expert_slots(megatron_fsdp_module(wrapped)[0].module)
    plain = gather_full(wrapped, values)
    out = {n: v for n, v in plain.items() if n not in slots}
    for dp in dist_params(wrapped):
        slot = slots.get(dp.fqn)
        if slot is None:
            continue
        local = dp.local.detach() if values is None else values[dp.fqn]
        if hasattr(local, "to_local"):
            local = local.to_local()
        pieces = [None] * dist.get_world_size()
        dist.all_gather_object(pieces, ((slot.index, *dp.offsets), local.detach().clone()))
        full = out.setdefault(slot.stored, torch.zeros((slot.num_experts, *dp.shape), dtype=local.dtype))
        for offsets, t in pieces:
            if t.numel():
                full[tuple(slice(o, o + s) for o, s in zip(offsets, (1, *t.shape)))] = t.unsqueeze(0)
    return out
