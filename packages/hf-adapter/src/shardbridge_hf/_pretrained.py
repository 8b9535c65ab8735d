"""Pretrained weights for a prepared transformers model: shard-on-read through the core loader.

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
dense models; the core's strict checks name any missing / unexpected key. Checkpoints in a
layout transformers converts while loading (per-expert MoE weights merged into a fused
``experts.gate_up_proj``: Mixtral, Qwen2/3-MoE, ...) are refused with that error and a hint;
see docs/hf.md "Pretrained weights".
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from shardbridge.pretrained import PretrainedReport
from shardbridge.pretrained import load_pretrained as core_load_pretrained
from torch import nn

from shardbridge_hf._compat import init_module_buffers

__all__ = ["guard_until_loaded", "load_pretrained", "materialise_on", "on_meta_everywhere", "tied_groups"]

_GUARD_ATTR = "_shardbridge_pretrained_guard"


def on_meta_everywhere(model: nn.Module) -> bool:
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


@torch.no_grad()
def materialise_on(model: nn.Module, device: torch.device) -> None:
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


def _shared_params(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """``(module, name)`` registrations of each parameter registered more than once (tied weights)."""
    by_id: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                by_id.setdefault(id(p), []).append((module, name))
    return [regs for regs in by_id.values() if len(regs) > 1]


def tied_groups(model: nn.Module, fqn_groups: list[list[str]]) -> list[list[str]]:
    """Optimizer groups by FQN with tied aliases merged into one entry (the model's own name).

    An optimizer built under ``accelerate.init_empty_weights`` holds ``lm_head.weight`` and
    ``embed_tokens.weight`` as two tensors; after re-tying (see :func:`on_meta_everywhere`)
    they are one parameter, which must appear once (twice would step it twice).
    """
    every = dict(model.named_parameters(remove_duplicate=False))
    canonical = {id(p): fqn for fqn, p in model.named_parameters()}
    seen: set[int] = set()
    out = []
    for group in fqn_groups:
        kept = []
        for fqn in group:
            p = every.get(fqn)
            if p is None:
                kept.append(fqn)  # rebind_param_groups names it
            elif id(p) not in seen:
                seen.add(id(p))
                kept.append(canonical[id(p)])
        out.append(kept)
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t  # under no_grad: a view of the stored shard


def guard_until_loaded(model: nn.Module) -> None:
    """Make ``model``'s forward raise until :func:`load_pretrained` fills its weights."""

    def refuse(module: nn.Module, args: Any) -> None:
        raise RuntimeError(
            "the model was prepared on the meta device and its weights are uninitialised; call "
            "accelerator.load_pretrained(path) after prepare() and before the first forward"
        )

    setattr(model, _GUARD_ATTR, model.register_forward_pre_hook(refuse))


def load_pretrained(model: nn.Module, path: str | os.PathLike[str], *, cast_dtype: bool = False) -> PretrainedReport:
    """Fill a prepared transformers model from a ``from_pretrained`` folder, each rank its slices.

    Args:
        model: the model ``ShardbridgeAccelerator.prepare`` returned.
        path: a ``save_pretrained`` folder (safetensors, sharded or not).
        cast_dtype: cast floating-point checkpoint values to the model's dtype.

    Raises:
        ValueError: see :func:`shardbridge.pretrained.load_pretrained`; a missing key of a
            checkpoint that transformers would convert while loading (per-expert MoE weights)
            gets a hint.
    """
    # transformers' own lists are regexes matched with re.search.
    missing = [f".*(?:{p}).*" for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    unexpected = [f".*(?:{p}).*" for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    try:
        report = core_load_pretrained(
            model, path, cast_dtype=cast_dtype, ignore_missing=missing, ignore_unexpected=unexpected
        )
    except ValueError as exc:
        text = str(exc)
        if ".experts." in text and "not in the checkpoint" in text:
            raise ValueError(
                f"{text} | this checkpoint stores MoE experts one by one ('experts.0.gate_proj.weight'), which "
                "transformers merges into fused 'experts.gate_up_proj' while loading; shard-on-read of such "
                "checkpoints is not supported yet: load with from_pretrained on every rank (prepare broadcasts "
                "rank 0's weights), or re-save it with a fused-experts layout"
            ) from exc
        raise
    guard = getattr(model, _GUARD_ATTR, None)
    if guard is not None:
        guard.remove()
        delattr(model, _GUARD_ATTR)
    return report
