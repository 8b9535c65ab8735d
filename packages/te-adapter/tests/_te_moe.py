"""STRUCTURAL TIER: the core's reference MoE with its routed experts as TE ``GroupedLinear`` pairs.

Test support only. ``TEExperts`` has the shape of Megatron-Core's ``TEGroupedMLP``: per local
expert ``linear_fc1.weight{i}`` ``[2I, D]`` ([gate; up]) and ``linear_fc2.weight{i}`` ``[D, I]``,
SwiGLU between them, called by ``shardbridge.ep.run_experts`` with the tokens grouped by local
expert and their counts (TE's ``m_splits``). :func:`build` swaps it into ``MoELlama`` (ep rank
j gets the reference's experts ``j*E/ep ..``, so both models start from the same values) and
parallelizes as ``parallelize_moe`` does, with ``shardbridge_te.shard_grouped_experts`` in
place of ``shard_experts``. Forward and backward need
``_te_reference_kernels.module_execution()`` (the reference grouped GEMM).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from _te_structural import cuda_construction, import_te
from shardbridge import ParallelDims, apply_fsdp
from shardbridge.adapters import component_fqn
from shardbridge.cp import cp_cross_entropy, cp_split
from shardbridge.fused import fused_params, split_fused
from shardbridge.models import MoEConfig, MoELlama, apply_llama_tp, synthetic_batch
from torch import nn
from torch.distributed.tensor import DTensor

CONFIG = MoEConfig.tiny(num_experts=8, num_kv_heads=4)  # fc1 weight{i} [64, 64], fc2 [64, 32]; tp4 divides
BATCH, SEQ = 8, 16
_TO_REFERENCE = re.compile(r"experts\.linear_fc(1|2)\.weight$")


def to_reference(fqn: str) -> str:
    """Stacked TE name -> the reference MoE's: ``linear_fc1.weight`` -> ``gate_up_proj``, fc2 -> ``down_proj``."""
    return _TO_REFERENCE.sub(lambda m: "experts.gate_up_proj" if m[1] == "1" else "experts.down_proj", fqn)


class TEExperts(nn.Module):
    """``num_local`` SwiGLU experts as two TE GroupedLinears (Megatron-Core's TEGroupedMLP layout)."""

    def __init__(self, num_local: int, dim: int, intermediate: int) -> None:
        super().__init__()
        te = import_te()
        kw = dict(bias=False, params_dtype=torch.float32, device="cpu")
        with cuda_construction("cpu"):
            self.linear_fc1 = te.GroupedLinear(num_local, dim, 2 * intermediate, **kw)
            self.linear_fc2 = te.GroupedLinear(num_local, intermediate, dim, **kw)

    def forward(self, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate, up = self.linear_fc1(tokens, counts).chunk(2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up, counts)


def mesh(dims: dict | None):
    return None if dims is None else ParallelDims(**dims).build_mesh("cpu")


def build(pm, *, seed: int, dispatch: str = "auto", config: MoEConfig = CONFIG) -> MoELlama:
    """MoELlama(config, seed) with TE experts, parallelized for ``pm`` (None = one process)."""
    import shardbridge_te

    model = MoELlama(config, seed=seed)
    num = config.num_experts
    ep = 1 if pm is None else pm.dims.ep
    first = 0 if pm is None else pm["ep"].get_local_rank() * (num // ep)
    for layer in model.layers:
        ref = layer.feed_forward.experts
        experts = TEExperts(num // ep, config.dim, config.intermediate_size)
        with torch.no_grad():
            for i in range(num // ep):
                getattr(experts.linear_fc1, f"weight{i}").copy_(ref.gate_up_proj[first + i])
                getattr(experts.linear_fc2, f"weight{i}").copy_(ref.down_proj[first + i])
        layer.feed_forward.experts = experts
    if pm is not None and pm.dims.tp > 1:
        apply_llama_tp(model, pm["tp"])
    assert pm is None or pm.dims.cp == 1, "cp layouts are not built here"
    model.set_expert_parallel(pm, dispatch=dispatch)
    for experts in model.expert_modules():
        shardbridge_te.shard_grouped_experts(experts, pm, num_experts=num)
    if pm is not None:
        apply_fsdp(model, pm)
    return model


def batch(model: MoELlama, pm, step: int):
    cfg = model.config
    if pm is None:
        return synthetic_batch(cfg, BATCH, SEQ, step=step)
    tokens, labels = synthetic_batch(cfg, BATCH, SEQ, step=step, dp_rank=pm["dp"].get_local_rank(), dp_size=pm["dp"].size())
    return cp_split(tokens, pm["cp"]), cp_split(labels, pm["cp"])


def loss_of(model: MoELlama, pm, step: int) -> torch.Tensor:
    """Cross entropy (global token mean on every rank) + the aux loss, as core test_moe.py trains."""
    tokens, labels = batch(model, pm, step)
    logits = model(tokens)
    if pm is None:
        ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    else:
        ce = cp_cross_entropy(logits, labels, pm)
    return ce + model.config.router_aux_loss_coef * model.aux_loss


# --------------------------------------------------------------------------- the oracle


def _full(t: torch.Tensor) -> torch.Tensor:
    # clone(): full_tensor() of a DTensor on a 1-rank mesh dim can alias the live tensor
    return (t.full_tensor() if isinstance(t, DTensor) else t.detach()).clone()


def _expert_names(model: nn.Module) -> dict[str, tuple[str, int]]:
    """``{per-expert param fqn: (reference name, global expert index)}`` of the TE experts."""
    from shardbridge_te._experts import expert_state

    out = {}
    for fqn, module in model.named_modules():
        state = expert_state(module)
        if state is None:
            continue
        for group, names in state.groups.items():
            for i, name in enumerate(names):
                out[f"{fqn}.{name}"] = (to_reference(f"{fqn}.{group}"), state.first + i)
    return out


def global_state(model: nn.Module, opt: torch.optim.Optimizer | None, *, grads: bool = False) -> dict:
    """Every value as a full tensor named as in the checkpoint; experts as ``{global index: tensor}``.

    The oracle, independent of shardbridge.checkpoint: ``full_tensor()``, ``split_fused`` and the
    experts' own parameters by their ep coordinates. ``grads=True``: the parameters' gradients
    instead (``opt`` unused). A collective: call on every rank. Merge the ranks' results with
    :func:`merge` (each rank holds E/ep of the experts).
    """
    experts = _expert_names(model)
    fused = fused_params(model)
    dense: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[int, torch.Tensor]] = {}

    def add(key_of, fqn: str, value: torch.Tensor, param: torch.Tensor) -> None:
        full = _full(value)
        if fqn in experts:
            name, index = experts[fqn]
            key = key_of(name)
            if full.dim() == 0:  # a scalar state (step): one per expert tensor
                dense[key] = full
            else:
                per_expert.setdefault(key, {})[index] = full
            return
        spec = fused.get(fqn)
        if spec is not None and full.shape == param.shape:
            for comp, part in split_fused(full, spec, _tp_size(param)).items():
                dense[key_of(component_fqn(fqn, comp))] = part.clone()
        else:
            dense[key_of(fqn)] = full

    params = dict(model.named_parameters())
    for fqn, p in params.items():
        add(lambda n: f"model.{n}", fqn, p.grad if grads else p, p)
    if opt is not None and not grads:
        names = {id(p): fqn for fqn, p in params.items()}
        for p, state in opt.state.items():
            fqn = names[id(p)]
            for key, value in state.items():
                add(lambda n, key=key: f"optim.state.{n}.{key}", fqn, value, p)
    return {"dense": dense, "experts": per_expert}


def _tp_size(param: torch.Tensor) -> int:
    if not isinstance(param, DTensor) or "tp" not in (param.device_mesh.mesh_dim_names or ()):
        return 1
    return param.device_mesh["tp"].size()


def merge(results: list[dict]) -> dict[str, torch.Tensor]:
    """The ranks' :func:`global_state` results as one ``{key: full tensor}`` (experts stacked by index)."""
    out = dict(results[0]["dense"])
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    for r in results:
        for key, by_index in r["experts"].items():
            for index, value in by_index.items():
                have = pieces.setdefault(key, {}).get(index)
                assert have is None or torch.equal(have, value), f"{key}[{index}] differs across ranks"
                pieces[key][index] = value
    for key, by_index in pieces.items():
        assert sorted(by_index) == list(range(len(by_index))), (key, sorted(by_index))
        out[key] = torch.stack([by_index[i] for i in range(len(by_index))])
    return out


def reference_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """The core reference MoE's state in the same names (its experts are [E, ...] already)."""
    return merge([global_state(model, opt)])
