"""Context parallelism for transformers models through transformers' attention interface.

Public (via ``shardbridge_hf``): :func:`enable_cp`, :func:`cp_batch`, :data:`CP_ATTENTION`.

[Note: HF context parallel]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5 attention layers call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``
with ``(module, query, key, value, attention_mask, dropout=, scaling=, **kwargs)``, RoPE
already applied, and ``position_ids`` among the kwargs. :func:`enable_cp` registers the
core's all-gather-KV attention (``shardbridge.cp.cp_attention``, [Note: all-gather-KV attention]
in ``shardbridge._cp``) under the name ``"shardbridge_cp"`` and switches the model to it, so
every architecture that dispatches through the interface (Llama, Qwen2/3, Mistral, Gemma,
...) runs context-parallel; a model that does not is refused by name. With a custom name
transformers builds no attention mask (``masking_utils``: "custom attention without
equivalent mask creation"); the causal mask comes from the GLOBAL ``position_ids``.

The batch side is :func:`cp_batch`: each cp rank keeps its head-tail part of ``input_ids``,
of the global ``position_ids`` (so RoPE rotates as in one process) and of the labels,
shifted BEFORE the split (``shift_labels``: the next token of a chunk's last token lives on
another rank). ``num_items_in_batch`` makes the model's own loss the token-weighted mean
over ``dp_cp`` once FSDP2 averages gradients (see [Note: loss over dp_cp] in the core).

Sliding-window layers (Mistral, Qwen3's ``layer_types``) pass ``sliding_window``; the mask
applies it on global positions. Refused, each with its reason: ``attention_mask`` with
padding (pad at the END instead, labels -100: causal attention never lets real tokens see
it), soft-capped attention (the scores differ), attention sinks (``s_aux``: GPT-OSS's learned
per-head logits join every softmax), and non-causal attention. The KV cache is turned off
(``config.use_cache = False``): generation is not context-parallel here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from shardbridge import ParallelMesh
from shardbridge.adapters import checked_args
from shardbridge.cp import check_cp_seq_len, cp_attention, cp_split
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["CP_ATTENTION", "cp_batch", "enable_cp"]

#: The name of shardbridge's context-parallel attention in transformers' ``AttentionInterface``.
CP_ATTENTION = "shardbridge_cp"
_MESH_ATTR = "_shardbridge_cp_mesh"


def _cp_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``[b, h, s, d]`` in, ``([b, s, h, d], None)`` out."""
    name = type(module).__name__
    if not hasattr(module, _MESH_ATTR):
        raise ValueError(
            f"{name}: attn_implementation {CP_ATTENTION!r} is set but the model was not prepared for context "
            "parallelism; call shardbridge_hf.enable_cp(model, pm['cp']) (prepare() does it when cp > 1)"
        )
    if kwargs.get("softcap") is not None:
        raise NotImplementedError(f"{name}: attention logit soft-capping under context parallelism is not supported")
    if kwargs.get("s_aux") is not None:
        # GPT-OSS's learned per-head sink logits join every softmax; the all-gather-KV attention has
        # no term for them, and ignoring them trains a different model (gpt_oss at cp=2: loss off by 1.3e-2)
        raise NotImplementedError(
            f"{name}: attention sinks (s_aux, e.g. GPT-OSS) under context parallelism are not supported; use cp=1"
        )
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError(f"{name}: non-causal attention under context parallelism is not supported")
    if attention_mask is not None:
        raise ValueError(
            f"{name}: an attention mask reached the context-parallel attention; pass batches through "
            "shardbridge_hf.cp_batch (pad at the end with labels -100, no attention_mask)"
        )
    positions = kwargs.get("position_ids")
    if positions is None:
        raise ValueError(
            f"{name}: no position_ids under context parallelism; pass batches through shardbridge_hf.cp_batch, "
            "which adds the global positions of this rank's tokens"
        )
    out = cp_attention(
        query,
        key,
        value,
        positions,
        getattr(module, _MESH_ATTR),
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        dropout_p=dropout,
        sliding_window=kwargs.get("sliding_window"),  # the layer passes it when it is a sliding layer
    )
    return out.transpose(1, 2).contiguous(), None


@checked_args(model=nn.Module, cp_mesh=DeviceMesh)
def enable_cp(model: nn.Module, cp_mesh: DeviceMesh) -> nn.Module:
    """Make ``model``'s attention context-parallel over the 1-D ``cp_mesh``. See [Note: HF context parallel].

    Registers :data:`CP_ATTENTION` in transformers' ``AttentionInterface`` and sets the model's
    attention implementation to it. Parameters are untouched (replicated over cp).

    Raises:
        NotImplementedError: the model does not dispatch attention through the interface.

    Example:
        >>> enable_cp(model, pm["cp"])  # doctest: +SKIP
        >>> out = model(**cp_batch({"input_ids": ids, "labels": ids}, pm))  # doctest: +SKIP
    """
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTENTION, _cp_attention_forward)
    model.set_attn_implementation(CP_ATTENTION)
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != CP_ATTENTION:
        raise NotImplementedError(
            f"{type(model).__name__} does not dispatch attention through transformers' AttentionInterface "
            "(set_attn_implementation had no effect), so it cannot run context-parallel; use cp=1"
        )
    if getattr(config, "use_cache", False):
        config.use_cache = False  # a KV cache is generation state; training never reads it
    for module in model.modules():
        setattr(module, _MESH_ATTR, cp_mesh)
    return model


@checked_args(batch=Mapping, pm=ParallelMesh)
def cp_batch(batch: Mapping[str, Any], pm: ParallelMesh, *, ignore_index: int = -100) -> dict[str, Any]:
    """This cp rank's part of a causal-LM batch, ready for ``model(**batch)``.

    Every rank of a cp group must pass the same full-length batch (Accelerate's data loader
    gives cp ranks the same batch). With cp == 1 the batch is returned as a dict, unchanged.

    Args:
        batch: ``input_ids`` ``[b, s]`` (required), optional ``labels`` (unshifted, as for
            transformers' causal-LM loss) or ``shift_labels``, ``position_ids``, and an
            ``attention_mask`` of ones only.
        pm: the run's :class:`~shardbridge.ParallelMesh`.
        ignore_index: the label of tokens the loss leaves out.

    Returns:
        ``input_ids``, ``position_ids`` (global), and with labels ``labels``/``shift_labels``
        (shifted, split) and ``num_items_in_batch``; other keys passed through.

    Raises:
        ValueError: ``s`` not divisible by ``2 * cp`` (pad at the end with label -100), an
            ``attention_mask`` with zeros, or a missing ``input_ids``.

    Example:
        >>> out = model(**cp_batch({"input_ids": ids, "labels": ids}, accelerator.parallel_mesh))  # doctest: +SKIP
    """
    out = dict(batch)
    cp = pm.dims.cp
    if cp == 1:
        return out
    ids = out.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        raise ValueError("cp_batch: batch['input_ids'] must be a [batch, seq] tensor")
    seq = ids.shape[1]
    check_cp_seq_len(seq, cp, what="input_ids sequence length")
    mask = out.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError(
            "cp_batch: attention_mask has padding; under context parallelism pad at the END of each sequence and "
            "set those labels to -100 (causal attention keeps real tokens from seeing it), then drop attention_mask"
        )
    cp_mesh = pm["cp"]
    positions = out.get("position_ids")
    if positions is None:
        positions = torch.arange(seq, device=ids.device).expand(ids.shape[0], -1)
    out["input_ids"] = cp_split(ids, cp_mesh)
    out["position_ids"] = cp_split(positions, cp_mesh)
    shift = out.pop("shift_labels", None)
    labels = out.pop("labels", None)
    if shift is None and labels is not None:
        shift = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[:, 1:]
    if shift is not None:
        local = cp_split(shift, cp_mesh).contiguous()
        count = (local != ignore_index).sum().to(torch.float32)  # this rank's tokens only
        dp_cp = pm["dp_cp"]
        dist.all_reduce(count, group=dp_cp.get_group())
        out["labels"] = out["shift_labels"] = local
        # sum / (N / dp_cp): FSDP2's average over dp_cp then gives sum over dp_cp / N.
        out["num_items_in_batch"] = count / dp_cp.size()
    return out
