r"""Megatron-Core GPT <-> Hugging Face ``LlamaForCausalLM`` / ``MixtralForCausalLM``: names, layouts, export, import.

[Note: Megatron-Core GPT and Llama names]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Fused parameters are stored by shardbridge checkpoints as their components (``q_proj``,
``gate_proj``, ... see [Note: Megatron QKV order] in ``_layout.py``), so the map is one name
per component::

    Megatron-Core (component) name                              LlamaForCausalLM name
    embedding.word_embeddings.weight                            model.embed_tokens.weight
    decoder.layers.N.input_layernorm.weight              (local) model.layers.N.input_layernorm.weight
    decoder.layers.N.self_attention.linear_qkv.layer_norm_weight (TE spec, fused norm): the same
    decoder.layers.N.self_attention.{q,k,v}_proj.weight          model.layers.N.self_attn.{q,k,v}_proj.weight
      (components of linear_qkv.weight, per query group [q_g; k_g; v_g])
    decoder.layers.N.self_attention.linear_proj.weight          model.layers.N.self_attn.o_proj.weight
    decoder.layers.N.pre_mlp_layernorm.weight            (local) model.layers.N.post_attention_layernorm.weight
    decoder.layers.N.mlp.linear_fc1.layer_norm_weight   (TE spec): the same
    decoder.layers.N.mlp.{gate,up}_proj.weight                  model.layers.N.mlp.{gate,up}_proj.weight
      (components of linear_fc1.weight = [gate; up])
    decoder.layers.N.mlp.linear_fc2.weight                      model.layers.N.mlp.down_proj.weight
    decoder.final_layernorm.weight                              model.norm.weight
    output_layer.weight                                         lm_head.weight

The numerics agree with no further transform: Megatron-Core's RoPE (``rotary_interleaved``
False) rotates halves as Llama's ``rotate_half`` does, query head ``h`` uses KV group
``h // (heads / groups)`` in both, RMSNorm and SwiGLU (``silu(gate) * up``) are the same
functions, attention scales by ``1/sqrt(head_dim)`` (``apply_query_key_layer_scaling`` off).
Checked by the tests: logits of an exported dp2 x tp2 model equal ``from_pretrained``'s.

[Note: Megatron-Core MoE and Mixtral]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A GPT whose MLPs are Megatron-Core MoE layers (``num_moe_experts``) is a ``MixtralForCausalLM``
(transformers 5.x: experts fused as ``mlp.experts.gate_up_proj [E, 2I, D]``, ``down_proj
[E, D, I]``; hub folders and ``save_pretrained`` hold one tensor per expert,
``block_sparse_moe.experts.N.w1`` (gate) / ``w3`` (up) / ``w2`` (down)); the extra names::

    Megatron-Core (stored) name                          MixtralForCausalLM name
    decoder.layers.N.mlp.router.weight      [E, D]       model.layers.N.mlp.gate.weight
    decoder.layers.N.mlp.experts.linear_fc1.weight       model.layers.N.mlp.experts.gate_up_proj
      [E, 2I, D], [gate; up] per expert (global expert coordinates, [Note: local experts in
      global coordinates] in ``_experts.py``)
    decoder.layers.N.mlp.experts.linear_fc2.weight       model.layers.N.mlp.experts.down_proj
      [E, D, I]

Routing is the same function only for Megatron-Core's default router: TopKRouter with
``moe_router_score_function="softmax"`` and ``moe_router_pre_softmax=False`` takes the top-k
logits and softmaxes over those k, which equals Mixtral's softmax over all experts
renormalised over the top k (``exp(l_i) / sum_topk exp(l_j)`` both). Everything else
Megatron-Core can do changes the function and has no Mixtral twin, so
:meth:`LlamaArch.from_config` refuses it by field (:data:`_MOE_AS_MIXTRAL`): sigmoid scores
(DeepSeek-V3), softmax before top-k without renormalisation (Qwen2/3-MoE with
``norm_topk_prob=False``), score scaling, group-limited routing, expert bias, shared experts
(Qwen2-MoE's shared expert is not wired), dense layers between MoE layers
(``moe_layer_freq``), token dropping (``moe_expert_capacity_factor``), q/k layernorm.
``moe_aux_loss_coeff`` only adds a training loss (Mixtral's ``router_aux_loss_coef``) and is
carried over. Checked by the tests: logits of an exported dp4 x ep2 model equal
``MixtralForCausalLM.from_pretrained``'s.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["LlamaArch", "hf_config", "hf_name", "load_hf", "megatron_name", "write_hf_config"]

_LAYER = r"decoder\.layers\.(\d+)\."
_TO_HF: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(f"^{a}$"), b)
    for a, b in (
        (r"embedding\.word_embeddings\.weight", "model.embed_tokens.weight"),
        (_LAYER + r"input_layernorm\.weight", r"model.layers.\1.input_layernorm.weight"),
        (_LAYER + r"self_attention\.linear_qkv\.layer_norm_weight", r"model.layers.\1.input_layernorm.weight"),
        (_LAYER + r"self_attention\.([qkv])_proj\.(weight|bias)", r"model.layers.\1.self_attn.\2_proj.\3"),
        (_LAYER + r"self_attention\.linear_proj\.weight", r"model.layers.\1.self_attn.o_proj.weight"),
        (_LAYER + r"pre_mlp_layernorm\.weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (_LAYER + r"mlp\.linear_fc1\.layer_norm_weight", r"model.layers.\1.post_attention_layernorm.weight"),
        (_LAYER + r"mlp\.(gate|up)_proj\.weight", r"model.layers.\1.mlp.\2_proj.weight"),
        (_LAYER + r"mlp\.linear_fc2\.weight", r"model.layers.\1.mlp.down_proj.weight"),
        (_LAYER + r"mlp\.router\.weight", r"model.layers.\1.mlp.gate.weight"),
        (_LAYER + r"mlp\.experts\.linear_fc1\.weight", r"model.layers.\1.mlp.experts.gate_up_proj"),
        (_LAYER + r"mlp\.experts\.linear_fc2\.weight", r"model.layers.\1.mlp.experts.down_proj"),
        (r"decoder\.final_layernorm\.weight", "model.norm.weight"),
        (r"output_layer\.weight", "lm_head.weight"),
    )
)
_TO_MEGATRON: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(f"^{a}$"), b)
    for a, b in (
        (r"model\.embed_tokens\.weight", "embedding.word_embeddings.weight"),
        (r"model\.layers\.(\d+)\.input_layernorm\.weight", r"decoder.layers.\1.input_layernorm.weight"),
        (
            r"model\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)",
            r"decoder.layers.\1.self_attention.\2_proj.\3",
        ),
        (r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", r"decoder.layers.\1.self_attention.linear_proj.weight"),
        (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", r"decoder.layers.\1.pre_mlp_layernorm.weight"),
        (r"model\.layers\.(\d+)\.mlp\.(gate|up)_proj\.weight", r"decoder.layers.\1.mlp.\2_proj.weight"),
        (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", r"decoder.layers.\1.mlp.linear_fc2.weight"),
        (r"model\.layers\.(\d+)\.mlp\.gate\.weight", r"decoder.layers.\1.mlp.router.weight"),
        (r"model\.layers\.(\d+)\.mlp\.experts\.gate_up_proj", r"decoder.layers.\1.mlp.experts.linear_fc1.weight"),
        (r"model\.layers\.(\d+)\.mlp\.experts\.down_proj", r"decoder.layers.\1.mlp.experts.linear_fc2.weight"),
        (r"model\.norm\.weight", "decoder.final_layernorm.weight"),
        (r"lm_head\.weight", "output_layer.weight"),
    )
)


def hf_name(name: str) -> str | None:
    """The ``LlamaForCausalLM`` name of a Megatron-Core (component) name; None when it has none.

    Example:
        >>> hf_name("decoder.layers.3.mlp.linear_fc2.weight")
        'model.layers.3.mlp.down_proj.weight'
    """
    return _rename(_TO_HF, name)


def megatron_name(name: str) -> str | None:
    """The Megatron-Core (local layer spec, component) name of a ``LlamaForCausalLM`` name, or None.

    Example:
        >>> megatron_name("model.layers.0.self_attn.o_proj.weight")
        'decoder.layers.0.self_attention.linear_proj.weight'
    """
    return _rename(_TO_MEGATRON, name)


def _rename(table: tuple[tuple[re.Pattern[str], str], ...], name: str) -> str | None:
    for pattern, repl in table:
        if pattern.match(name):
            return pattern.sub(repl, name)
    return None


# TransformerConfig fields of a MoE GPT -> (what Mixtral computes, whether the value does it).
# See [Note: Megatron-Core MoE and Mixtral].
_MOE_AS_MIXTRAL: tuple[tuple[str, str, Callable[[Any], bool]], ...] = (
    ("moe_router_score_function", "'softmax'", lambda v: v == "softmax"),
    ("moe_router_pre_softmax", "False (softmax over the top-k logits = renormalised top-k)", lambda v: not v),
    ("moe_router_topk_scaling_factor", "None (no score scaling)", lambda v: v in (None, 1, 1.0)),
    ("moe_router_num_groups", "None (no group-limited routing)", lambda v: v is None),
    ("moe_router_enable_expert_bias", "False (no expert bias)", lambda v: not v),
    ("moe_shared_expert_intermediate_size", "None (no shared expert)", lambda v: v is None),
    ("moe_layer_freq", "1 (every layer MoE)", lambda v: v == 1 or (isinstance(v, list) and set(v) == {1})),
    ("moe_expert_capacity_factor", "None (dropless)", lambda v: v is None),
    ("qk_layernorm", "False (no q/k norms)", lambda v: not v),
)


@dataclass(frozen=True, kw_only=True)
class LlamaArch:
    """What a ``config.json`` needs beyond the tensor shapes (Llama, or Mixtral for a MoE GPT)."""

    num_attention_heads: int
    """Query heads (``TransformerConfig.num_attention_heads``)."""
    rope_theta: float = 10000.0
    """``TransformerConfig`` / GPTModel ``rotary_base``."""
    rms_norm_eps: float = 1e-5
    """``TransformerConfig.layernorm_epsilon``."""
    max_position_embeddings: int = 4096
    """GPTModel ``max_sequence_length``."""
    num_experts_per_tok: int | None = None
    """MoE: experts per token (``TransformerConfig.moe_router_topk``); None for a dense model."""
    router_aux_loss_coef: float = 0.0
    """MoE: ``TransformerConfig.moe_aux_loss_coeff`` (a training loss only)."""

    @classmethod
    def from_config(cls, config: Any, *, rope_theta: float = 10000.0, max_position_embeddings: int = 4096) -> LlamaArch:
        """From a Megatron-Core ``TransformerConfig``.

        Raises:
            ValueError: a config with no Llama (dense) or Mixtral (MoE) twin, naming the fields:
                see [Note: Megatron-Core MoE and Mixtral].
        """
        if config.normalization != "RMSNorm" or not config.gated_linear_unit or config.add_bias_linear:
            raise ValueError(
                f"TransformerConfig normalization={config.normalization!r}, gated_linear_unit="
                f"{config.gated_linear_unit}, add_bias_linear={config.add_bias_linear}: only the Llama form "
                "(RMSNorm, SwiGLU, no linear biases) maps to LlamaForCausalLM"
            )
        moe = {}
        if getattr(config, "num_moe_experts", None):
            wrong = [
                f"{field}={getattr(config, field, None)!r} (Mixtral: {want})"
                for field, want, ok in _MOE_AS_MIXTRAL
                if not ok(getattr(config, field, None))
            ]
            if wrong:
                raise ValueError(
                    f"TransformerConfig {'; '.join(wrong)}: Megatron-Core's MoE then computes a function "
                    "MixtralForCausalLM does not, so it does not convert; set those fields as given"
                )
            moe = {"num_experts_per_tok": config.moe_router_topk, "router_aux_loss_coef": config.moe_aux_loss_coeff}
        elif getattr(config, "qk_layernorm", False):
            raise ValueError("TransformerConfig qk_layernorm=True: LlamaForCausalLM has no q/k norms")
        return cls(
            num_attention_heads=config.num_attention_heads,
            rope_theta=rope_theta,
            rms_norm_eps=config.layernorm_epsilon,
            max_position_embeddings=max_position_embeddings,
            **moe,
        )


def write_hf_config(out_dir: str | os.PathLike[str], shapes: dict[str, tuple[int, ...]], arch: LlamaArch,
                    dtype: torch.dtype) -> Path:  # fmt: skip
    """Write :func:`hf_config` as ``out_dir/config.json`` (never through a link)."""
    from shardbridge.adapters import write_file

    path = Path(out_dir) / "config.json"
    write_file(path, (json.dumps(hf_config(shapes, arch, dtype), indent=2) + "\n").encode())
    return path


def hf_config(shapes: dict[str, tuple[int, ...]], arch: LlamaArch, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` (with experts, ``MixtralForCausalLM``) from HF-named shapes.

    Raises:
        ValueError: shapes that are not a Llama / Mixtral (missing tensors, heads not dividing
            the sizes), or experts without ``arch.num_experts_per_tok``.
    """
    need = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.mlp.gate_proj.weight")  # fmt: skip
    if "model.layers.0.mlp.experts.gate_up_proj" in shapes:  # a MoE GPT: Mixtral
        need = (*need[:3], "model.layers.0.mlp.experts.gate_up_proj")
    missing = [n for n in need if n not in shapes]
    if missing:
        raise ValueError(f"the checkpoint has no {missing}: it is not a Megatron-Core GPT (Llama form) model")
    vocab, hidden = shapes["model.embed_tokens.weight"]
    q_rows, k_rows = shapes[need[1]][0], shapes[need[2]][0]
    if q_rows % arch.num_attention_heads:
        raise ValueError(
            f"num_attention_heads={arch.num_attention_heads} does not divide the q_proj rows {q_rows}; pass the "
            "model's TransformerConfig.num_attention_heads"
        )
    head_dim = q_rows // arch.num_attention_heads
    layers = 1 + max(int(m.group(1)) for n in shapes if (m := re.match(r"model\.layers\.(\d+)\.", n)))
    moe = shapes.get("model.layers.0.mlp.experts.gate_up_proj")
    if moe is not None and arch.num_experts_per_tok is None:
        raise ValueError(
            "the checkpoint holds MoE experts (mlp.experts.gate_up_proj): pass the experts per token "
            "(--num-experts-per-tok, TransformerConfig.moe_router_topk)"
        )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shapes[need[3]][0] if moe is None else moe[1] // 2,
        "num_hidden_layers": layers,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": k_rows // head_dim,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if moe is not None:  # See [Note: Megatron-Core MoE and Mixtral]
        for key in ("mlp_bias", "attention_bias"):
            config.pop(key)
        config.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            num_local_experts=moe[0],
            num_experts_per_tok=arch.num_experts_per_tok,
            router_aux_loss_coef=arch.router_aux_loss_coef,
            output_router_logits=False,
            router_jitter_noise=0.0,
            sliding_window=None,
            attention_dropout=0.0,
        )
    return config


def load_hf(model: Any, folder: str | os.PathLike[str]) -> dict[str, int]:
    """Fill a wrapped Megatron-Core model from a ``from_pretrained`` folder, each rank reading its slices only.

    Call on every rank (no collectives). For each distributed parameter this rank holds a piece
    of, the box Megatron-FSDP records (item coordinates of the DTensor-global tensor) is mapped
    to the HF tensor(s): TP column pieces are row ranges, row-parallel pieces column ranges,
    fused ``linear_qkv`` / ``linear_fc1`` pieces split per component with the core's
    ``split_local`` (Megatron's per-group QKV order, [gate; up]), a local expert's piece the
    rows of its global expert in ``mlp.experts.gate_up_proj`` / ``down_proj`` (a folder with
    the fused expert names, as ``export_hf`` writes; hub folders with one tensor per expert go
    through ``ckpt convert --to megatron``); each range is read with
    ``safetensors.safe_open(...).get_slice`` (only those bytes). Then the main weights are
    installed into the compute weights. Values are cast to the parameter dtype only when the
    file's dtype differs (a bf16 folder into an fp32 model).

    Args:
        model: the ``FullyShardedDataParallel`` module ``shard_model`` returned.
        folder: a ``save_pretrained`` folder of a ``LlamaForCausalLM``.

    Returns:
        ``{"bytes_read": bytes this rank read, "checkpoint_bytes": bytes of all tensors}``.

    Raises:
        ValueError: a model parameter has no tensor in the folder, a shape differs, or the
            folder has tensors the model does not (names listed; nothing is written then).

    Example:
        >>> load_hf(model, "Llama-tiny")  # doctest: +SKIP
    """
    from safetensors import safe_open
    from shardbridge.fused import split_local
    from shardbridge.pretrained import read_index

    from shardbridge_megatron_fsdp._checkpoint import dist_params, install_weights
    from shardbridge_megatron_fsdp._compat import megatron_fsdp_module
    from shardbridge_megatron_fsdp._experts import expert_slots
    from shardbridge_megatron_fsdp.mcore._layout import fused_tp

    index = read_index(folder)
    params = dist_params(model)
    slots = expert_slots(megatron_fsdp_module(model)[0].module)
    plan: list[tuple[torch.Tensor, str, tuple[int, ...]]] = []  # (destination view, hf key, offsets)
    used: set[str] = set()
    for dp in params:
        shapes: list[tuple[str, tuple[int, ...]]] = []
        slot = slots.get(dp.fqn)
        if slot is not None:  # a local expert: its rows of the [E, ...] tensor (experts are not TP)
            pieces = [(slot.stored, dp.local.unsqueeze(0), (slot.index, *dp.offsets))]
            shapes.append((slot.stored, (slot.num_experts, *dp.shape)))
        elif dp.spec is None:
            pieces = [(dp.fqn, dp.local, dp.offsets)]
            shapes.append((dp.fqn, dp.shape))
        else:
            from shardbridge.adapters import component_fqn

            pieces = []
            for name in dp.spec.names:
                shapes.append((component_fqn(dp.fqn, name), tuple(dp.spec.component_shape(name, dp.shape))))
            if dp.local.numel():
                for piece in split_local(dp.local, dp.spec, fused_tp(dp.spec, dp.param), dp.offsets[dp.spec.dim]):
                    offsets = list(dp.offsets)
                    offsets[dp.spec.dim] = piece.component_offset
                    pieces.append((component_fqn(dp.fqn, piece.name), piece.view, tuple(offsets)))
        for name, shape in shapes:
            key = hf_name(name)
            if key is None or key not in index:
                hub = any(".block_sparse_moe.experts." in k for k in index)
                raise ValueError(
                    f"{folder}: no tensor for model parameter {name!r} (expected HF name {key!r}); the folder is not "
                    "a LlamaForCausalLM / MixtralForCausalLM of this architecture"
                    + (
                        " (it holds one tensor per expert, as hub folders and save_pretrained do: convert it with "
                        "`shardbridge ckpt convert FOLDER CKPT --to megatron`, then load CKPT)"
                        if hub
                        else ""
                    )
                )
            if tuple(index[key][1]) != tuple(shape):
                raise ValueError(
                    f"{folder}: {key!r} has shape {tuple(index[key][1])}, the model's {name!r} needs {tuple(shape)}; "
                    "build the model with the folder's config.json"
                )
            used.add(key)
        for name, view, offsets in pieces:
            if view.numel():
                plan.append((view, hf_name(name), offsets))
    unused = sorted(set(index) - used)
    if unused:
        raise ValueError(
            f"{folder}: {len(unused)} tensor(s) the model has no parameter for: {unused[:4]}; build the model with "
            "the folder's config.json (tied embeddings: share_embeddings_and_output_weights)"
        )
    read = 0
    for view, key, offsets in plan:
        file, _, dtype = index[key]
        with safe_open(str(file), framework="pt") as f:
            value = f.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))]
        read += value.numel() * value.element_size()
        with torch.no_grad():
            view.copy_(value.to(view.dtype) if value.dtype != view.dtype else value)
    install_weights(model)
    total = sum(int(torch.Size(shape).numel()) * dtype.itemsize for _, shape, dtype in index.values())
    return {"bytes_read": read, "checkpoint_bytes": total}
