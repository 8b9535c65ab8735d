r"""Megatron-Core GPT <-> Hugging Face ``LlamaForCausalLM``: names, layouts, export and shard-on-read import.

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
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = ["LlamaArch", "hf_name", "load_hf", "megatron_name", "write_hf_config"]

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


@dataclass(frozen=True, kw_only=True)
class LlamaArch:
    """What a ``config.json`` needs beyond the tensor shapes."""

    num_attention_heads: int
    """Query heads (``TransformerConfig.num_attention_heads``)."""
    rope_theta: float = 10000.0
    """``TransformerConfig`` / GPTModel ``rotary_base``."""
    rms_norm_eps: float = 1e-5
    """``TransformerConfig.layernorm_epsilon``."""
    max_position_embeddings: int = 4096
    """GPTModel ``max_sequence_length``."""

    @classmethod
    def from_config(cls, config: Any, *, rope_theta: float = 10000.0, max_position_embeddings: int = 4096) -> LlamaArch:
        """From a Megatron-Core ``TransformerConfig``."""
        if config.normalization != "RMSNorm" or not config.gated_linear_unit or config.add_bias_linear:
            raise ValueError(
                f"TransformerConfig normalization={config.normalization!r}, gated_linear_unit="
                f"{config.gated_linear_unit}, add_bias_linear={config.add_bias_linear}: only the Llama form "
                "(RMSNorm, SwiGLU, no linear biases) maps to LlamaForCausalLM"
            )
        return cls(
            num_attention_heads=config.num_attention_heads,
            rope_theta=rope_theta,
            rms_norm_eps=config.layernorm_epsilon,
            max_position_embeddings=max_position_embeddings,
        )


def write_hf_config(out_dir: str | os.PathLike[str], shapes: dict[str, tuple[int, ...]], arch: LlamaArch,
                    dtype: torch.dtype) -> Path:  # fmt: skip
    """Write a ``LlamaForCausalLM`` ``config.json`` from HF-named tensor shapes and ``arch``.

    Raises:
        ValueError: shapes that are not a Llama (missing tensors, heads not dividing the sizes).
    """
    need = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.mlp.gate_proj.weight")  # fmt: skip
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
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": shapes[need[3]][0],
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
    from shardbridge.checkpoint import write_file

    path = Path(out_dir) / "config.json"
    write_file(path, (json.dumps(config, indent=2) + "\n").encode())  # never through a link
    return path


def load_hf(model: Any, folder: str | os.PathLike[str]) -> dict[str, int]:
    """Fill a wrapped Megatron-Core model from a ``from_pretrained`` folder, each rank reading its slices only.

    Call on every rank (no collectives). For each distributed parameter this rank holds a piece
    of, the box Megatron-FSDP records (item coordinates of the DTensor-global tensor) is mapped
    to the HF tensor(s): TP column pieces are row ranges, row-parallel pieces column ranges,
    fused ``linear_qkv`` / ``linear_fc1`` pieces split per component with the core's
    ``split_local`` (Megatron's per-group QKV order, [gate; up]); each range is read with
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
    from shardbridge import split_local
    from shardbridge.pretrained import read_index

    from shardbridge_megatron_fsdp._checkpoint import dist_params, install_weights
    from shardbridge_megatron_fsdp.mcore._layout import fused_tp

    index = read_index(folder)
    params = dist_params(model)
    plan: list[tuple[torch.Tensor, str, tuple[int, ...]]] = []  # (destination view, hf key, offsets)
    used: set[str] = set()
    for dp in params:
        shapes: list[tuple[str, tuple[int, ...]]] = []
        if dp.spec is None:
            pieces = [(dp.fqn, dp.local, dp.offsets)]
            shapes.append((dp.fqn, dp.shape))
        else:
            from shardbridge.checkpoint import component_fqn

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
                raise ValueError(
                    f"{folder}: no tensor for model parameter {name!r} (expected HF name {key!r}); the folder is not "
                    "a LlamaForCausalLM of this architecture"
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
