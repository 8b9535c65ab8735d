"""``parallelize``: FP8, TP, FSDP2 units and the weights they start from, for a transformers model.

The steps, in the order they must run::

    1. weights: where from     every parameter on meta on every rank: deferred, load_pretrained
                               fills them (see [Note: pretrained weights without materialising the
                               model]); else with sync_module_states rank 0's full tensors are kept
    2. fp8 convert             nn.Linear -> the backend's modules, BEFORE TP / FSDP
    3. tensor parallelism      model.tp_plan on pm["tp"]   see [Note: HF TP plan on the shardbridge mesh]
       context parallelism     attention over pm["cp"]    see [Note: HF context parallel] (_cp.py)
       expert parallelism      model.ep_plan on pm["ep"]  see [Note: HF EP plan on the shardbridge mesh]
    4. FSDP2 units (core)      embed | each decoder layer | [norm, lm_head] | root; with
                               activation_checkpointing, transformers' own per-layer checkpointing
                               first; the TP units' outputs are not views ([Note: TP outputs are not
                               views] in the core's _tp.py)
    5. weights installed       deferred: materialised, forward refused until load_pretrained;
                               rank 0's: broadcast, each rank keeps its piece (upstream bug 3)
    6. fp8 refresh             what derives from the sharded weights (torchao tensorwise: scales)

The decision of step 1 and its mechanics of step 5 live here together: which weights a
prepared model starts from is part of how it is sharded.

[Note: rank-0 weights after sharding (upstream bug 3)]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``cpu_ram_efficient_loading`` only rank 0 holds real weights. Accelerate 1.15
(``fsdp2_load_full_state_dict``) broadcasts ``param.to_local()`` of the already TP-sharded
parameter -- a TP shard, not the full tensor -- and hands it to ``distribute_tensor`` as if
it were full: size mismatch (accelerate #3729). Here rank 0 keeps references to its full,
unsharded tensors (taken before step 2), broadcasts each one, and every rank cuts its own
piece with ``distribute_tensor(full, mesh, placements, src_data_rank=None)`` (no further
communication). Ranks whose model was on ``meta`` are materialised first. The same path
also makes randomly initialised ranks agree (``sync_module_states``).

[Note: pretrained weights without materialising the model]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
::

    with torch.device("meta"):                     # or accelerate.init_empty_weights()
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model, opt = accelerator.prepare(model, AdamW(model.parameters()))
    accelerator.load_pretrained(path)              # each rank reads its slices

``prepare`` sees every parameter on ``meta`` on EVERY rank (one all-reduce agrees on it), so
there are no rank-0 weights to broadcast: it applies TP and FSDP2 on meta, materialises the
shards (real buffers are kept; non-persistent buffers on meta, RoPE's ``inv_freq``, are
recomputed by transformers' own ``_init_weights`` and checked), and blocks ``forward`` until :func:`load_pretrained` has filled the weights
(a forward on uninitialised memory would train silently on garbage). Each rank then reads
only its slices (``shardbridge.pretrained``), so no rank ever holds the full model. A model
built with real weights works too (``load_pretrained`` overwrites them).

Names: ``save_pretrained`` of transformers 5 writes the model's own parameter names for
dense models; the core's strict checks name any missing / unexpected key. Per-expert MoE
folders are read through transformers' own renaming rules: [Note: checkpoints transformers
converts while loading] in ``_checkpoint.py``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from shardbridge import ParallelMesh, apply_fsdp, fp8
from shardbridge.adapters import checked_args
from shardbridge.tp import unview_tp_output
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from shardbridge_hf._compat import enable_activation_checkpointing, init_module_buffers, no_split_modules
from shardbridge_hf._config import HFConfig
from shardbridge_hf._ep import apply_ep, check_ep_divides, resolve_ep_plan, without_experts
from shardbridge_hf._tp import apply_tp, check_tp_divides, resolve_tp_plan

__all__ = ["fsdp_units", "load_full_from_rank0", "parallelize", "release_guard"]

_GUARD_ATTR = "_shardbridge_pretrained_guard"


@checked_args(model=nn.Module, pm=ParallelMesh, config=HFConfig)
def parallelize(
    model: nn.Module, pm: ParallelMesh, config: HFConfig, *, device: torch.device | None = None
) -> nn.Module:
    """Apply FP8 (``config.fp8``'s backend), TP, activation checkpointing and FSDP2 to a transformers causal LM, in place.

    Call on every rank with the same arguments. Parameters may differ between ranks (or be
    on ``meta`` off rank 0) when ``config.sync_module_states``: rank 0's weights win.

    Args:
        model: e.g. ``AutoModelForCausalLM.from_config(cfg)``, in ``policy.main_params_dtype``.
        pm: the run's :class:`~shardbridge.ParallelMesh`.
        config: the validated :class:`~shardbridge_hf.HFConfig`.
        device: where parameters live (default: the mesh's device type).

    Returns:
        ``model``, an ``FSDPModule`` (or TP-only when no axis is data-parallel).

    Raises:
        ValueError: heads / intermediate size not divisible by tp, a TP plan matching no
            module, parameters in the wrong dtype for the policy, an EP plan that does not
            split every expert parameter (ep > 1).

    Example:
        >>> pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")  # doctest: +SKIP
        >>> model = parallelize(LlamaForCausalLM(cfg), pm, HFConfig())  # doctest: +SKIP
    """
    device = device or torch.device(pm.mesh.device_type)
    policy = config.policy()
    # 1. Every parameter on meta on every rank: the weights come from accelerator.load_pretrained
    # (shard-on-read), not from rank 0. See [Note: pretrained weights without materialising the model].
    deferred = _on_meta_everywhere(model)
    full = _rank0_full_tensors(model) if config.sync_module_states and not deferred else None

    plan: dict[str, Any] = {}
    experts: dict[str, tuple[str, ...]] = {}
    if pm.dims.ep > 1:  # transformers applies its EP plan only with ep_size > 1, and so do we
        experts = resolve_ep_plan(model, config.ep_plan)
        check_ep_divides(model, experts, pm.dims)
    if pm.dims.tp > 1:
        check_tp_divides(getattr(model, "config", None), pm.dims.tp, experts_split_by_ep=bool(experts))
        plan = without_experts(resolve_tp_plan(model, config.tp_plan), experts)
    fp8_styles = None
    recipe = config.fp8.to_recipe()
    if recipe is not None:
        # Before TP / FSDP. A backend with its own TP modules (te) shards them itself: the torch
        # TP pass skips what it reports done. See [Note: the FP8 backend protocol] in the core.
        done = fp8.convert(model, recipe, mesh=pm, tp_plan={k: v for k, v in plan.items() if isinstance(v, str)})
        plan = {k: v for k, v in plan.items() if k not in done.tp_done}
        fp8_styles = done.tp_styles

    if pm.dims.tp > 1:
        # Rank-0 weights are broadcast after sharding: no scatter here (it would hang with meta ranks).
        src = None if config.sync_module_states or deferred else 0
        apply_tp(model, pm["tp"], plan, float8_styles=fp8_styles, src_data_rank=src)
        # Their outputs leave FSDP2 units (embed; [norm, lm_head] and the root, which returns the
        # logits): tensors of their own, not to_local() views ([Note: TP outputs are not views] in the core).
        for module in {model.get_input_embeddings(), model.get_output_embeddings()} - {None}:
            unview_tp_output(module)
    if pm.dims.cp > 1:
        from shardbridge_hf._cp import enable_cp

        enable_cp(model, pm["cp"])  # FSDP2 below shards over the flattened dp_shard_cp
    if experts:
        # Shard(0) on ep + their own FSDP2 units over efsdp, before the dense units claim them.
        apply_ep(model, pm, experts, policy, dispatch=config.ep_dispatch)

    policy.check_model_dtype(
        model,
        fix=f"build it in that dtype (from_config(cfg, torch_dtype={policy.main_params_dtype})) or set "
        "fsdp_config.shardbridge.precision.main_params_dtype accordingly",
    )
    units = fsdp_units(model)
    if config.activation_checkpointing:
        # A flag on each decoder layer (no wrapper module: FQNs and units are unchanged); FSDP2
        # re-all-gathers a layer's parameters for its recompute in backward.
        enable_activation_checkpointing(model)
    apply_fsdp(
        model,
        pm,
        policy,
        units=units,
        reshard_after_forward=config.reshard_after_forward,
        cpu_offload=config.cpu_offload,
    )

    if deferred:
        _materialise_on(model, device)
        _guard_until_loaded(model)  # load_pretrained fills the weights (and refreshes FP8)
        return model
    if config.sync_module_states:
        load_full_from_rank0(model, full, device=device)
    fp8.refresh(model)  # what FP8 derives from the sharded weights (torchao tensorwise: the scales)
    return model


def fsdp_units(model: nn.Module) -> list[Any]:
    """The FSDP units of a transformers decoder-only LM, in forward order (root excluded).

    ``[embed_tokens, *layers, [norm, lm_head]]`` -- see [Note: FSDP units] in the core.
    A tied embedding joins the last unit (it shares its weight with ``lm_head``).

    Raises:
        ValueError: the model has no ``model.layers`` / embeddings (name its units yourself).
    """
    base = getattr(model, "model", None) or getattr(model, getattr(model, "base_model_prefix", ""), None)
    layers = getattr(base, "layers", None)
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    norm = getattr(base, "norm", None)
    if layers is None and base is not None:
        # No `model.layers` (HRM: `L_module.layers` + `H_module.layers`): the blocks transformers
        # itself never splits (Accelerate's TRANSFORMER_BASED_WRAP reads the same list), in module order.
        blocks = set(no_split_modules(model))
        found = [m for m in base.modules() if type(m).__name__ in blocks]
        layers = found or None
    if layers is None or embed is None:
        raise ValueError(
            f"{type(model).__name__} has no model.layers / input embeddings; shardbridge_hf wraps decoder-only "
            "LMs (Llama, Qwen2, Mistral, ...)"
        )
    tied = head is not None and getattr(head, "weight", None) is embed.weight
    last = [m for m in (embed if tied else None, norm, head) if m is not None]
    units: list[Any] = [] if tied else [embed]
    units.extend(layers)
    if last:
        units.append(last)
    return units


def _rank0_full_tensors(model: nn.Module) -> dict[str, torch.Tensor] | None:
    """Rank 0's unsharded parameters and buffers (references, no copy); None elsewhere."""
    if not dist.is_initialized() or dist.get_rank() != 0:
        return None
    out = {name: p.detach() for name, p in model.named_parameters(remove_duplicate=False)}
    out.update({name: b.detach() for name, b in model.named_buffers(remove_duplicate=False)})
    if any(t.is_meta for t in out.values()):
        raise ValueError(
            "rank 0's model is on the meta device; with cpu_ram_efficient_loading rank 0 must hold the real "
            "weights (load with from_pretrained on rank 0)"
        )
    return out


@torch.no_grad()
@checked_args(model=nn.Module, full=(dict, None))
def load_full_from_rank0(model: nn.Module, full: dict[str, torch.Tensor] | None, *, device: torch.device) -> None:
    """Give every rank its piece of rank 0's full tensors. See [Note: rank-0 weights after sharding (upstream bug 3)].

    Args:
        model: the sharded model (parameters may be on meta off rank 0).
        full: on rank 0, ``{fqn: full tensor}`` of every parameter and buffer; None elsewhere.
        device: device to materialise meta tensors on.
    """
    if any(t.is_meta for t in list(model.parameters()) + list(model.buffers())):
        model.to_empty(device=device)
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    for name in sorted(tensors):
        target = tensors[name]
        local = target.to_local() if isinstance(target, DTensor) else target
        shape = tuple(target.shape)  # the global shape, also for DTensors
        buf = torch.empty(shape, dtype=local.dtype, device=device)
        if full is not None:
            if name not in full or tuple(full[name].shape) != shape:
                raise AssertionError(f"{name}: rank 0 full tensor missing or of the wrong shape")
            buf.copy_(full[name])
        dist.broadcast(buf, src=0)
        if isinstance(target, DTensor):
            # Full -> this rank's piece, cut locally (every rank already holds the full tensor).
            piece = distribute_tensor(buf, target.device_mesh, target.placements, src_data_rank=None).to_local()
            local.copy_(piece)
        else:
            local.copy_(buf)


# -- step 1 / 5 of a model on meta everywhere: see [Note: pretrained weights without materialising the model]


def _on_meta_everywhere(model: nn.Module) -> bool:
    """True when every parameter is on ``meta`` on every rank (one all-reduce when distributed).

    Meta on some ranks only is the rank-0-weights case (``cpu_ram_efficient_loading``), not this one.
    When True, tied weights are re-tied (``model.tie_weights()``).
    """
    params = list(model.parameters())
    mine = torch.tensor([int(bool(params) and all(p.is_meta for p in params))], dtype=torch.int64)
    if dist.is_initialized():
        dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    everywhere = bool(mine.item())
    if everywhere and hasattr(model, "tie_weights"):
        # accelerate.init_empty_weights re-creates each registered parameter, so from_config's
        # tie (lm_head.weight IS embed_tokens.weight) is lost; transformers' own call restores it.
        model.tie_weights()
    return everywhere


def _shared_params(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """``(module, name)`` registrations of each parameter registered more than once (tied weights)."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((module, name))
    return [regs for regs in by_id.values() if len(regs) > 1]


@torch.no_grad()
def _materialise_on(model: nn.Module, device: torch.device) -> None:
    """Allocate every ``meta`` tensor on ``device`` (uninitialised), keeping the real ones' values.

    Non-persistent buffers on ``meta`` (RoPE ``inv_freq`` of a model built under
    ``torch.device("meta")``; no checkpoint holds them) are recomputed by transformers' own
    ``_init_weights`` of their module, and checked: they are filled with NaN first, so one it
    does not recompute is an error, never a silent garbage value.

    Raises:
        ValueError: a non-persistent buffer on ``meta`` that transformers does not recompute.
    """
    lost: list[tuple[str, nn.Module, str]] = []
    for prefix, module in model.named_modules():
        for name, b in module._buffers.items():
            if b is not None and b.is_meta and name in module._non_persistent_buffers_set:
                lost.append((f"{prefix}.{name}" if prefix else name, module, name))
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    real = {name: _local(t).clone() for name, t in tensors.items() if not _local(t).is_meta}
    shared = _shared_params(model)
    model.to_empty(device=device)
    for (owner, name), *aliases in shared:
        # to_empty gives every registration of a meta parameter its own new Parameter (a meta -> cpu
        # tensor cannot be swapped in place), which unties tied embeddings where nothing else holds
        # them together (no FSDP2: one process, tp only); point the aliases back at one Parameter.
        for alias_owner, alias_name in aliases:
            alias_owner._parameters[alias_name] = owner._parameters[name]
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    for name, value in real.items():
        _local(tensors[name]).copy_(value)
    for _, module, name in lost:
        buf = module._buffers[name]
        if buf.is_floating_point():
            buf.fill_(float("nan"))
    for module in {id(m): m for _, m, _ in lost}.values():
        init_module_buffers(model, module)
    for fqn, module, name in lost:
        buf = module._buffers[name]
        if not buf.is_floating_point() or bool(torch.isnan(buf).any()):
            raise ValueError(
                f"non-persistent buffer {fqn!r} was on the meta device and transformers does not recompute it "
                "(no checkpoint holds it); build the model under accelerate.init_empty_weights() (parameters on "
                "meta, buffers real) instead of torch.device('meta')"
            )


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: a view of the stored shard


def _guard_until_loaded(model: nn.Module) -> None:
    """Make ``model``'s forward raise until :func:`load_pretrained` fills its weights."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise RuntimeError(
            "the model was prepared on the meta device and its weights are uninitialised; call "
            "accelerator.load_pretrained(path) after prepare() and before the first forward"
        )

    setattr(model, _GUARD_ATTR, model.register_forward_pre_hook(refuse))


def release_guard(model: nn.Module) -> None:
    """Let ``model`` run forward again: its weights were loaded (``load_pretrained``). A no-op without a guard."""
    guard = getattr(model, _GUARD_ATTR, None)
    if guard is not None:
        guard.remove()
        delattr(model, _GUARD_ATTR)
