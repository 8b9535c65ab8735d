"""The reference MoE in Hugging Face names: a checkpoint (any ep, any layout) -> a from_pretrained folder.

:class:`~shardbridge.models.MoELlama` computes what transformers' ``MixtralForCausalLM`` computes
when it has no shared expert and renormalises the top-k probabilities (Mixtral always does),
and what ``Qwen2MoeForCausalLM`` computes when it has a shared expert (Qwen2-MoE's sigmoid-gated
one; ``qkv_bias=False``). The attention and norms are the Llama's (``_hf.py``); the MLP maps::

    checkpoint FQN                                   Hugging Face name (model.layers.{i}.)
    feed_forward.router.weight                       mlp.gate.weight
    feed_forward.experts.gate_up_proj  [E, 2I, D]    mlp.experts.gate_up_proj
    feed_forward.experts.down_proj     [E, D, I]     mlp.experts.down_proj
    feed_forward.shared_expert.{gate,up}_proj.weight mlp.shared_expert.{gate,up}_proj.weight
    feed_forward.shared_expert.down.weight           mlp.shared_expert.down_proj.weight
    feed_forward.shared_expert_gate.weight           mlp.shared_expert_gate.weight

[Note: fused expert names]
~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers 5.x models hold the experts fused (``experts.gate_up_proj`` ``[E, 2I, D]``), while
hub folders and its own ``save_pretrained`` store one tensor per expert
(``block_sparse_moe.experts.N.w1.weight`` for Mixtral, ``mlp.experts.N.gate_proj.weight`` for the
Qwen2-MoE family) and ``conversion_mapping.py`` merges them while loading. A file holding the
fused names matches no converter and loads by name (checked with transformers 5.24:
``test_moe_hf.py`` compares logits). The export writes the fused names, one checkpoint entry
to one file entry, streamed; transformers 4.x, which has no fused experts, cannot read it.
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
from shardbridge.models._hf import hf_llama_config, hf_llama_name
from shardbridge.models._moe import MoEConfig

__all__ = ["export_hf_moe", "hf_moe_config", "hf_moe_name"]

_MLP_RULES = (
    (r"feed_forward\.router\.weight", "mlp.gate.weight"),
    (r"feed_forward\.experts\.(gate_up_proj|down_proj)", r"mlp.experts.\1"),
    (r"feed_forward\.shared_expert\.(gate|up)_proj\.weight", r"mlp.shared_expert.\1_proj.weight"),
    (r"feed_forward\.shared_expert\.down\.weight", "mlp.shared_expert.down_proj.weight"),
    (r"feed_forward\.shared_expert_gate\.weight", "mlp.shared_expert_gate.weight"),
)


def hf_moe_name(fqn: str) -> str:
    """The transformers (Mixtral / Qwen2-MoE) name of a reference-MoE checkpoint FQN.

    Raises:
        ValueError: an FQN the reference MoE does not have.

    Example:
        >>> hf_moe_name("layers.1.feed_forward.experts.gate_up_proj")
        'model.layers.1.mlp.experts.gate_up_proj'
        >>> hf_moe_name("layers.0.attention.q_proj.weight")
        'model.layers.0.self_attn.q_proj.weight'
    """
    match = re.fullmatch(r"layers\.(\d+)\.(feed_forward\..+)", fqn)
    if match:
        for pattern, repl in _MLP_RULES:
            if re.fullmatch(pattern, match.group(2)):
                return f"model.layers.{match.group(1)}." + re.sub(pattern, repl, match.group(2))
        raise ValueError(f"{fqn!r} is not a reference-MoE checkpoint name (MLP names: {[p for p, _ in _MLP_RULES]})")
    return hf_llama_name(fqn)


@checked_args(config=MoEConfig)
def hf_moe_config(config: MoEConfig, *, dtype: torch.dtype | str = "float32") -> dict[str, Any]:
    """The ``config.json`` of the transformers architecture equivalent to ``config``.

    Mixtral without a shared expert, Qwen2-MoE with one.

    Raises:
        ValueError: no shared expert and ``norm_topk_prob=False``: Mixtral always renormalises
            the top-k probabilities and the architectures that do not (OLMoE, Qwen3-MoE) add
            q/k norms the reference model does not have.

    Example:
        >>> hf_moe_config(MoEConfig.tiny())["architectures"]
        ['MixtralForCausalLM']
    """
    base = hf_llama_config(config, dtype=dtype)
    for key in ("architectures", "model_type", "mlp_bias", "attention_bias"):
        base.pop(key)
    moe = {"router_aux_loss_coef": config.router_aux_loss_coef, "output_router_logits": False}
    if config.shared_expert_intermediate_size:
        return {
            **base,
            **moe,
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "moe_intermediate_size": config.intermediate_size,
            "shared_expert_intermediate_size": config.shared_expert_intermediate_size,
            "num_experts": config.num_experts,
            "num_experts_per_tok": config.top_k,
            "norm_topk_prob": config.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "qkv_bias": False,
            "use_sliding_window": False,
        }
    if not config.norm_topk_prob:
        raise ValueError(
            "MoEConfig.norm_topk_prob=False without a shared expert has no transformers twin: Mixtral always "
            "renormalises the top-k probabilities; set norm_topk_prob=True (Mixtral) or "
            "shared_expert_intermediate_size > 0 (Qwen2-MoE)"
        )
    return {
        **base,
        **moe,
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.top_k,
        "router_jitter_noise": 0.0,
        "sliding_window": None,
        "attention_dropout": 0.0,
    }


@checked_args(config=MoEConfig)
def export_hf_moe(
    checkpoint_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    config: MoEConfig,
    *,
    dtype: torch.dtype | str | None = None,
    max_shard_size: int | str = "2GB",
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Export a reference-MoE checkpoint (saved at any ep and layout) as a HF model folder.

    Writes safetensors shards under the names of [Note: fused expert names], the index and
    ``config.json`` (:func:`hf_moe_config`); ``AutoModelForCausalLM.from_pretrained(out_dir)``
    (transformers >= 5) loads it. Arguments as :func:`~shardbridge.models.export_hf_llama`.

    Example:
        >>> export_hf_moe(checkpoint.latest("ckpts"), "hf_out", MoEConfig.tiny())  # doctest: +SKIP
    """
    hf_config = hf_moe_config(config, dtype=dtype or "float32")  # refuses before anything is written
    out = Path(out_dir)
    export_safetensors(
        checkpoint_path,
        out,
        name_map=hf_moe_name,
        dtype=dtype,
        max_shard_size=max_shard_size,
        progress=progress,
        overwrite=overwrite,
    )
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    return out
