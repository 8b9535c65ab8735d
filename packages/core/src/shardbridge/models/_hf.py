"""The reference Llama in Hugging Face names: a checkpoint of any framework -> a from_pretrained folder.

The reference model computes what transformers' ``LlamaForCausalLM`` computes (RMSNorm, rotate-
half RoPE, GQA, SwiGLU with ``silu(gate) * up``), so an export under HF names with a matching
``config.json`` loads with ``AutoModelForCausalLM.from_pretrained`` and gives the same logits.
The fused ``qkv`` / ``gate_up`` parameters are already stored as their components by
``shardbridge.checkpoint`` (see [Note: component names] in ``checkpoint/_components.py``)::

    checkpoint FQN                          Hugging Face name
    tok_embeddings.weight                   model.embed_tokens.weight
    layers.{i}.attention.{q,k,v}_proj.weight model.layers.{i}.self_attn.{q,k,v}_proj.weight
    layers.{i}.attention.o_proj.weight      model.layers.{i}.self_attn.o_proj.weight
    layers.{i}.feed_forward.{gate,up}_proj  model.layers.{i}.mlp.{gate,up}_proj.weight
    layers.{i}.feed_forward.down.weight     model.layers.{i}.mlp.down_proj.weight
    layers.{i}.attention_norm.weight        model.layers.{i}.input_layernorm.weight
    layers.{i}.ffn_norm.weight              model.layers.{i}.post_attention_layernorm.weight
    norm.weight / output.weight             model.norm.weight / lm_head.weight

No transformers import: the config is written as JSON.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch

from shardbridge._checks import checked_args
from shardbridge.checkpoint import export_safetensors
from shardbridge.models._llama import LlamaConfig

__all__ = ["export_hf_llama", "hf_llama_config", "hf_llama_export_record", "hf_llama_name"]

_LAYER_RULES = (
    (r"attention\.([qkvo])_proj\.weight", r"self_attn.\1_proj.weight"),
    (r"feed_forward\.(gate|up)_proj\.weight", r"mlp.\1_proj.weight"),
    (r"feed_forward\.down\.weight", "mlp.down_proj.weight"),
    (r"attention_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
)
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_llama_name(fqn: str) -> str:
    """The transformers ``LlamaForCausalLM`` name of a reference-Llama checkpoint FQN.

    Raises:
        ValueError: an FQN the reference Llama does not have (e.g. a fused ``qkv`` name from a
            hand-made state dict: checkpoints store components).

    Example:
        >>> hf_llama_name("layers.3.feed_forward.gate_proj.weight")
        'model.layers.3.mlp.gate_proj.weight'
    """
    if fqn in _TOP:
        return _TOP[fqn]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", fqn)
    if match:
        for pattern, repl in _LAYER_RULES:
            if re.fullmatch(pattern, match.group(2)):
                return f"model.layers.{match.group(1)}." + re.sub(pattern, repl, match.group(2))
    raise ValueError(
        f"{fqn!r} is not a reference-Llama checkpoint name; expected e.g. 'layers.0.attention.q_proj.weight' "
        "(fused qkv / gate_up are stored as components by shardbridge.checkpoint)"
    )


@checked_args(config=LlamaConfig)
def hf_llama_config(config: LlamaConfig, *, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """The ``config.json`` of transformers' ``LlamaForCausalLM`` equivalent to ``config``."""
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "max_position_embeddings": config.max_seq_len,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rope_theta": config.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": config.tie_word_embeddings,
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
    }


@checked_args(config=LlamaConfig)
def hf_llama_export_record(config: LlamaConfig, *, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """What to record in a reference-Llama checkpoint so that ``shardbridge ckpt export`` writes a HF folder.

    Pass it as ``extra={"export": hf_llama_export_record(config)}`` to
    :func:`shardbridge.checkpoint.save`: ``shardbridge ckpt export CKPT OUT`` then writes the
    weights under transformers' names and ``config.json`` beside them, a folder
    ``AutoModelForCausalLM.from_pretrained(OUT)`` loads (the same folder as
    :func:`export_hf_llama`). See [Note: export recorded in a checkpoint] in ``shardbridge/cli/_main.py``.

    Args:
        config: the model's :class:`LlamaConfig`.
        dtype: the ``dtype`` written into ``config.json`` (the saved weights' dtype).

    Returns:
        ``{"name_map": {checkpoint FQN: HF name}, "files": {"config.json": {...}}}`` (plain JSON).

    Example:
        >>> record = hf_llama_export_record(LlamaConfig.tiny())
        >>> record["name_map"]["layers.0.attention.q_proj.weight"], sorted(record["files"])
        ('model.layers.0.self_attn.q_proj.weight', ['config.json'])
    """
    layer = (
        "attention.q_proj.weight",
        "attention.k_proj.weight",
        "attention.v_proj.weight",
        "attention.o_proj.weight",
        "feed_forward.gate_proj.weight",
        "feed_forward.up_proj.weight",
        "feed_forward.down.weight",
        "attention_norm.weight",
        "ffn_norm.weight",
    )
    fqns = [*_TOP, *(f"layers.{i}.{name}" for i in range(config.num_layers) for name in layer)]
    return {
        "name_map": {fqn: hf_llama_name(fqn) for fqn in fqns},
        "files": {"config.json": hf_llama_config(config, dtype=dtype)},
    }


@checked_args(config=LlamaConfig)
def export_hf_llama(
    checkpoint_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: LlamaConfig,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "2GB",
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Export a reference-Llama checkpoint (from any framework or layout) as a HF model folder.

    Writes safetensors shards under HF names, the index, and ``config.json``; the folder
    loads with ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)``.

    Args:
        checkpoint_path: a ``shardbridge.checkpoint`` directory of a reference Llama.
        out_dir: the model folder: new or empty (created), see ``overwrite``.
        config: the model's :class:`LlamaConfig`.
        dtype: cast floating tensors (e.g. "bfloat16"); None keeps the saved dtype (fp32).
        max_shard_size: bytes per safetensors file, or "2GB" / "500MB".
        progress: show a progress bar when stderr is a terminal.
        overwrite: allow a non-empty ``out_dir``; replaces the export's own files (shards,
            index, ``config.json``), keeps the others (``export_safetensors``).

    Returns:
        The folder.

    Example:
        >>> export_hf_llama(checkpoint.latest("ckpts"), "hf_out", LlamaConfig.tiny())  # doctest: +SKIP
    """
    out = Path(out_dir)
    export_safetensors(
        checkpoint_path,
        out,
        name_map=hf_llama_name,
        dtype=dtype,
        max_shard_size=max_shard_size,
        progress=progress,
        overwrite=overwrite,
    )
    (out / "config.json").write_text(json.dumps(hf_llama_config(config, dtype=dtype or "float32"), indent=2) + "\n")
    return out
