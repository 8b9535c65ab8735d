"""``shardbridge ckpt convert``: Megatron-Core checkpoints <-> Hugging Face folders, in one process.

Directions (no process group, no megatron-core import)::

    --to hf        SRC = a shardbridge checkpoint of a Megatron-Core GPT model (mcore ``save``,
                         any layout)      -> streaming export (core ``export_safetensors``, the
                                             [Note: Megatron-Core GPT and Llama names] map)
                   SRC = a Megatron-LM fsdp_dtensor checkpoint (``.metadata``, no
                         shardbridge.json) -> ``read_fsdp_dtensor(optimizer=False)``, split,
                                             one ``model.safetensors`` (whole model in memory)
                   + config.json (LlamaForCausalLM) from the shapes and the flags
    --to megatron  SRC = a from_pretrained folder -> a shardbridge checkpoint under Megatron-Core
                         names (fused linear_qkv / linear_fc1 stored as their components) that
                         mcore ``load`` reads into any dp x tp layout (each rank reads its chunks)

For a live sharded model, ``load_hf`` reads a from_pretrained folder directly (shard-on-read).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import torch
from shardbridge.adapters import Verb, check_destination, write_file
from torch import nn

from shardbridge_megatron_fsdp._compat import MCORE_INSTALL_HINT
from shardbridge_megatron_fsdp.mcore._hf import LlamaArch, hf_config, hf_name, megatron_name, write_hf_config

__all__ = ["cli_verb", "export_hf", "fsdp_dtensor_to_hf", "hf_to_checkpoint", "main"]

_SINGLE_FILE = "model.safetensors"


def export_hf(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    arch: LlamaArch,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Export a shardbridge checkpoint of a Megatron-Core GPT model to a ``from_pretrained`` folder.

    Raises:
        ValueError: a model tensor with no Llama name (the model is not Llama-shaped).

    Example:
        >>> export_hf("ckpt/step_00000010", "hf_out", LlamaArch(num_attention_heads=32))  # doctest: +SKIP
    """
    from shardbridge import checkpoint as core

    check_destination(out_dir, ["config.json"], overwrite=overwrite)  # [Note: writer destinations]
    info = core.inspect(checkpoint)
    shapes, unmapped = {}, []
    for t in info.tensors:
        if not t.name.startswith("model."):
            continue
        name = t.name[len("model.") :]
        if (key := hf_name(name)) is None:
            unmapped.append(name)
        else:
            shapes[key] = tuple(t.shape)
    if unmapped:
        raise ValueError(
            f"{checkpoint}: {len(unmapped)} tensor(s) have no LlamaForCausalLM / MixtralForCausalLM name: "
            f"{unmapped[:4]}; only Megatron-Core GPT models in the Llama form (RMSNorm, SwiGLU, RoPE, no biases), "
            "dense or with SequentialMLP MoE layers, convert"
        )
    first = next(t for t in info.tensors if t.name.startswith("model."))
    dtype_out = dtype or getattr(torch, first.dtype)
    hf_config(shapes, arch, dtype_out)  # refuses (e.g. experts without num_experts_per_tok) before anything is written
    core.export_safetensors(checkpoint, out_dir, name_map=hf_name, dtype=dtype, progress=False, overwrite=overwrite)
    write_hf_config(out_dir, shapes, arch, dtype_out)
    return Path(out_dir)


def fsdp_dtensor_to_hf(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    arch: LlamaArch,
    *,
    head_dim: int | None = None,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert a Megatron-LM ``fsdp_dtensor`` checkpoint's model weights to a ``from_pretrained`` folder.

    ``head_dim`` defaults to hidden_size // num_attention_heads (Megatron's ``kv_channels``).
    ``overwrite``: replace ``model.safetensors`` / ``config.json`` in ``out_dir`` (never through
    a link); False refuses them by name.
    """
    from safetensors.torch import save_file
    from shardbridge.fused import split_fused

    from shardbridge_megatron_fsdp.mcore._fsdp_dtensor import read_fsdp_dtensor
    from shardbridge_megatron_fsdp.mcore._layout import MegatronQKVSpec

    check_destination(out_dir, [_SINGLE_FILE, "config.json"], overwrite=overwrite)
    ckpt = read_fsdp_dtensor(checkpoint, optimizer=False)
    hidden = ckpt.model["embedding.word_embeddings.weight"].shape[1]
    head_dim = head_dim or hidden // arch.num_attention_heads
    tensors: dict[str, torch.Tensor] = {}
    for name, value in ckpt.model.items():
        if name.endswith("self_attention.linear_qkv.weight"):
            groups, rest = divmod(value.shape[0] // head_dim - arch.num_attention_heads, 2)
            if rest or groups < 1:
                raise ValueError(
                    f"{name} has {value.shape[0]} rows, not (num_attention_heads + 2 * groups) * head_dim for "
                    f"num_attention_heads={arch.num_attention_heads}, head_dim={head_dim}; pass the model's values"
                )
            spec = MegatronQKVSpec.megatron(
                num_heads=arch.num_attention_heads, num_query_groups=groups, head_dim=head_dim
            )
            parts = split_fused(value, spec, 1)
            base = name.rsplit(".linear_qkv.", 1)[0]
            pieces = {f"{base}.{n}.weight": parts[n] for n in spec.names}
        elif name.endswith("mlp.linear_fc1.weight"):
            gate, up = value.chunk(2)
            base = name.rsplit(".linear_fc1.", 1)[0]
            pieces = {f"{base}.gate_proj.weight": gate, f"{base}.up_proj.weight": up}
        else:
            pieces = {name: value}
        for piece_name, piece in pieces.items():
            key = hf_name(piece_name)
            if key is None:
                raise ValueError(f"{checkpoint}: {piece_name!r} has no LlamaForCausalLM name")
            tensors[key] = (piece.to(dtype) if dtype is not None else piece).contiguous()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    check_destination(out, [_SINGLE_FILE, "config.json"], overwrite=overwrite)  # again: after the long read
    tmp = out / f"{_SINGLE_FILE}.tmp"
    tmp.unlink(missing_ok=True)  # never written through: [Note: writer destinations]
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / _SINGLE_FILE)
    write_hf_config(out, {k: tuple(v.shape) for k, v in tensors.items()}, arch, next(iter(tensors.values())).dtype)
    return out


def hf_to_checkpoint(
    folder: str | os.PathLike[str],
    out: str | os.PathLike[str],
    arch: LlamaArch,
    *,
    hf_config: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a ``from_pretrained`` folder as a shardbridge checkpoint under Megatron-Core names.

    The result loads with ``shardbridge_megatron_fsdp.mcore.load`` into a Megatron-Core model
    at any dp x tp layout. One process, the whole model in memory. ``hf_config`` (the folder's
    ``config.json``) is kept in the checkpoint's ``extra["hf_config"]``, so ``--to hf`` writes
    the same config back (eps, RoPE scaling, ... survive the round trip).
    """
    from safetensors import safe_open
    from shardbridge import checkpoint as core
    from shardbridge.fused import FusedSpec, register_fused
    from shardbridge.pretrained import read_index

    from shardbridge_megatron_fsdp.mcore._layout import QKV_NAMES, SWIGLU_NAMES, MegatronQKVSpec

    check_destination(out, [], overwrite=overwrite)  # DST a link: refused ([Note: writer destinations])
    index = read_index(folder)
    if hf_config is not None:
        _check_against_config(Path(folder), index, hf_config)
    flat: dict[str, torch.Tensor] = {}
    per_expert: dict[tuple[int, str, int], torch.Tensor] = {}  # (layer, w1 | w2 | w3, expert) -> tensor
    for key, (file, _, _) in index.items():
        hub = _HUB_EXPERT.fullmatch(key) or _HUB_ROUTER.fullmatch(key)
        name = megatron_name(key) if hub is None else None
        if hub is None and name is None:
            raise ValueError(
                f"{folder}: {key!r} has no Megatron-Core name; only LlamaForCausalLM and MixtralForCausalLM folders "
                "convert"
            )
        with safe_open(str(file), framework="pt") as f:
            value = f.get_tensor(key)
        if hub is None:
            flat[name] = value
        elif hub.re is _HUB_ROUTER:
            flat[f"decoder.layers.{hub.group(1)}.mlp.router.weight"] = value
        else:
            per_expert[(int(hub.group(1)), hub.group(3), int(hub.group(2)))] = value
    flat.update(_stack_hub_experts(per_expert))
    root = nn.Module()
    head_dim = flat["decoder.layers.0.self_attention.q_proj.weight"].shape[0] // arch.num_attention_heads
    for name in [n for n in flat if n.endswith("self_attention.q_proj.weight")]:
        base = name.rsplit(".q_proj.", 1)[0]
        q, k, v = (flat.pop(f"{base}.{p}.weight") for p in QKV_NAMES)
        groups = k.shape[0] // head_dim
        spec = MegatronQKVSpec.megatron(num_heads=arch.num_attention_heads, num_query_groups=groups, head_dim=head_dim)
        from shardbridge.fused import merge_fused

        flat[f"{base}.linear_qkv.weight"] = merge_fused({"q_proj": q, "k_proj": k, "v_proj": v}, spec, 1)
        _set(root, f"{base}.linear_qkv.weight", flat.pop(f"{base}.linear_qkv.weight"), spec, register_fused)
    for name in [n for n in flat if n.endswith("mlp.gate_proj.weight")]:
        base = name.rsplit(".gate_proj.", 1)[0]
        gate, up = (flat.pop(f"{base}.{p}.weight") for p in SWIGLU_NAMES)
        spec = FusedSpec.swiglu(gate.shape[0], names=SWIGLU_NAMES)
        _set(root, f"{base}.linear_fc1.weight", torch.cat([gate, up]), spec, register_fused)
    for name, value in flat.items():
        _set(root, name, value, None, register_fused)
    extra = {"hf_config": hf_config} if hf_config is not None else None
    return core.save(out, model=root, extra=extra, overwrite=overwrite)


# Mixtral hub / save_pretrained names: one tensor per expert (w1 = gate, w3 = up, w2 = down).
# See [Note: Megatron-Core MoE and Mixtral] in _hf.py.
_HUB_EXPERT = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight")
_HUB_ROUTER = re.compile(r"model\.layers\.(\d+)\.block_sparse_moe\.gate\.weight")


def _stack_hub_experts(per_expert: dict[tuple[int, str, int], torch.Tensor]) -> dict[str, torch.Tensor]:
    """One-tensor-per-expert Mixtral weights -> the stored ``[E, ...]`` expert tensors under Megatron-Core names."""
    out: dict[str, torch.Tensor] = {}
    for layer in sorted({k[0] for k in per_expert}):
        experts = sorted({k[2] for k in per_expert if k[0] == layer})
        if experts != list(range(len(experts))) or any(
            (layer, w, e) not in per_expert for e in experts for w in ("w1", "w2", "w3")
        ):
            raise ValueError(
                f"layer {layer}: the folder's experts {experts} are not 0..E-1 each with w1, w2 and w3; the folder is "
                "incomplete"
            )
        fc1 = [torch.cat([per_expert[(layer, "w1", e)], per_expert[(layer, "w3", e)]]) for e in experts]  # [gate; up]
        out[f"decoder.layers.{layer}.mlp.experts.linear_fc1.weight"] = torch.stack(fc1)
        out[f"decoder.layers.{layer}.mlp.experts.linear_fc2.weight"] = torch.stack(
            [per_expert[(layer, "w2", e)] for e in experts]
        )
    return out


# [Note: config against tensors]
# ``--to megatron`` refuses what ``load_pretrained`` / ``from_pretrained`` would not load as the
# same model, before anything is written: a key the config's architecture needs and the folder
# lacks (``lm_head.weight`` unless ``tie_word_embeddings``, a layer of ``num_hidden_layers``), a
# key it does not know (a layer beyond it), a shape other than the config's, a non-floating
# tensor (an int32 embedding would be cast to fp32 without a word), or a dtype other than the
# config's ``dtype`` (``torch_dtype`` in transformers 4.x files).
_LAYER_SHAPES = {  # per-layer key suffix -> shape from (hidden, heads * head_dim, kv_heads * head_dim, ffn)
    "input_layernorm.weight": lambda h, q, kv, f: (h,),
    "self_attn.q_proj.weight": lambda h, q, kv, f: (q, h),
    "self_attn.k_proj.weight": lambda h, q, kv, f: (kv, h),
    "self_attn.v_proj.weight": lambda h, q, kv, f: (kv, h),
    "self_attn.o_proj.weight": lambda h, q, kv, f: (h, q),
    "post_attention_layernorm.weight": lambda h, q, kv, f: (h,),
    "mlp.gate_proj.weight": lambda h, q, kv, f: (f, h),
    "mlp.up_proj.weight": lambda h, q, kv, f: (f, h),
    "mlp.down_proj.weight": lambda h, q, kv, f: (h, f),
}


def _expected_shapes(config: dict, where: Path, *, hub_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """HF key -> shape for ``config``; a Mixtral's experts fused, or (``hub_experts``) one tensor each."""
    try:
        hidden, vocab, ffn = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
        layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
        experts = config["num_local_experts"] if config.get("model_type") == "mixtral" else None
    except KeyError as e:
        raise ValueError(
            f"{where / 'config.json'} has no {e.args[0]!r}; pass a LlamaForCausalLM or MixtralForCausalLM config"
        ) from None
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads") or heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        for suffix, shape in _LAYER_SHAPES.items():
            if experts is not None and suffix.startswith("mlp."):
                continue
            shapes[f"model.layers.{i}.{suffix}"] = shape(hidden, heads * head_dim, kv * head_dim, ffn)
        if experts is not None and hub_experts:
            shapes[f"model.layers.{i}.block_sparse_moe.gate.weight"] = (experts, hidden)
            for e in range(experts):
                for w, shape in (("w1", (ffn, hidden)), ("w3", (ffn, hidden)), ("w2", (hidden, ffn))):
                    shapes[f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight"] = shape
        elif experts is not None:
            shapes[f"model.layers.{i}.mlp.gate.weight"] = (experts, hidden)
            shapes[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (experts, 2 * ffn, hidden)
            shapes[f"model.layers.{i}.mlp.experts.down_proj"] = (experts, hidden, ffn)
        if config.get("attention_bias", False):
            for proj, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
                shapes[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = (rows,)
    return shapes


def _check_against_config(folder: Path, index: dict, config: dict) -> None:
    """See [Note: config against tensors]: ValueError naming the key, the file and the fix."""
    expected = _expected_shapes(config, folder, hub_experts=any(_HUB_EXPERT.fullmatch(k) for k in index))
    tied = config.get("tie_word_embeddings", False)
    missing = sorted(set(expected) - set(index))
    if missing:
        why = " (config.json tie_word_embeddings is false: the output layer is its own tensor)" if (
            missing[0] == "lm_head.weight") else ""  # fmt: skip
        raise ValueError(
            f"{folder}: config.json's architecture needs {missing[0]!r}{why}, which the folder lacks"
            f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}; the folder is incomplete or its "
            "config.json is not its own; nothing was written"
        )
    unknown = sorted(k for k in set(index) - set(expected) if not (tied and k == "lm_head.weight"))
    if unknown:
        raise ValueError(
            f"{folder}: {unknown[0]!r} in {index[unknown[0]][0].name} is not part of config.json's architecture "
            f"(num_hidden_layers={config['num_hidden_layers']}); fix config.json; nothing was written"
        )
    declared = config.get("dtype", config.get("torch_dtype"))
    for key, (file, shape, dtype) in sorted(index.items()):
        if key in expected and tuple(shape) != expected[key]:
            raise ValueError(
                f"{folder}: {key!r} in {file.name} has shape {tuple(shape)}, config.json says {expected[key]}; "
                "fix config.json or the weights; nothing was written"
            )
        if not dtype.is_floating_point:
            raise ValueError(
                f"{folder}: {key!r} in {file.name} is {str(dtype).removeprefix('torch.')}, not a floating dtype; "
                "Llama / Mixtral weights are floating point (convert the file); nothing was written"
            )
        if isinstance(getattr(torch, str(declared), None), torch.dtype) and declared != str(dtype).removeprefix("torch."):
            raise ValueError(
                f"{folder}: {key!r} in {file.name} is {str(dtype).removeprefix('torch.')}, config.json says "
                f"dtype {declared!r}; fix config.json or cast the weights; nothing was written"
            )


def _set(root: nn.Module, fqn: str, value: torch.Tensor, spec, register_fused) -> None:
    *path, leaf = fqn.split(".")
    module = root
    for part in path:
        if not hasattr(module, part):
            module.add_module(part, nn.Module())
        module = getattr(module, part)
    module.register_parameter(leaf, nn.Parameter(value, requires_grad=False))
    if spec is not None:
        register_fused(module, leaf, spec)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shardbridge ckpt convert",
        description="Convert Megatron-Core GPT checkpoints (shardbridge or Megatron-LM fsdp_dtensor) to a Hugging Face "
        "from_pretrained folder, or a from_pretrained folder to a shardbridge checkpoint under Megatron-Core names.",
    )
    p.add_argument("src", help="checkpoint directory or URI (--to hf) or from_pretrained folder (--to megatron)")
    p.add_argument("dst", help="output folder (new or empty) or checkpoint directory or URI (--to megatron)")
    p.add_argument("--to", choices=("hf", "megatron"), required=True, help="target format")
    p.add_argument("--num-attention-heads", type=int, default=None,
                   help="TransformerConfig.num_attention_heads: required unless the source carries its config "
                   "(a from_pretrained folder, or a checkpoint written by --to megatron); if given there, it must agree")  # fmt: skip
    p.add_argument("--num-experts-per-tok", type=int, default=None,
                   help="MoE checkpoints (-> MixtralForCausalLM): TransformerConfig.moe_router_topk; required unless "
                   "the source carries its config. Valid only for Megatron-Core's default softmax top-k routing "
                   "(docs/megatron-fsdp.md, Megatron-Core MoE)")  # fmt: skip
    p.add_argument("--head-dim", type=int, default=None, help="kv_channels (fsdp_dtensor source; default hidden/heads)")
    p.add_argument("--rope-theta", type=float, default=None, help="rotary_base (default 10000, or the source's config)")
    p.add_argument("--rms-norm-eps", type=float, default=None, help="layernorm_epsilon (default 1e-5, or the source's config)")  # fmt: skip
    p.add_argument("--max-position-embeddings", type=int, default=None,
                   help="max_sequence_length (default 4096, or the source's config)")  # fmt: skip
    p.add_argument("--dtype", default=None, help="cast floating tensors (--to hf), e.g. bfloat16")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the files convert writes in an existing DST (never through a link)")  # fmt: skip
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``shardbridge ckpt convert`` on ``argv`` (the arguments after ``convert``)."""
    args = _parser().parse_args(list(argv))
    remote = "://" in args.src  # a shardbridge checkpoint's URI (s3://, file://): read through the core
    if "://" in args.dst and args.to == "hf":
        raise ValueError(f"--to hf writes a local from_pretrained folder; pass a local DST (not {args.dst!r})")
    if remote and args.to == "megatron":
        raise ValueError(f"--to megatron reads a local from_pretrained folder; pass a local SRC (not {args.src!r})")
    src = args.src if remote else Path(args.src)
    if not remote and not src.exists():
        raise ValueError(f"{src} does not exist; pass a checkpoint directory (--to hf) or a from_pretrained folder")
    is_shardbridge = remote or (src / "shardbridge.json").is_file()
    stored = None
    if args.to == "megatron":
        stored = _read_config(src)
    elif is_shardbridge:
        from shardbridge import checkpoint as core

        stored = core.inspect(src).extra.get("hf_config")
        if stored is not None and not isinstance(stored, dict):
            raise ValueError(f"{src}: extra['hf_config'] is a {type(stored).__name__}, not a config mapping")
    arch = _arch(args, stored)
    dtype = None
    if args.dtype is not None:
        dtype = getattr(torch, args.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"--dtype {args.dtype!r} is not a torch dtype; e.g. bfloat16, float32")
    if args.to == "megatron":
        out = hf_to_checkpoint(src, args.dst, arch, hf_config=stored, overwrite=args.overwrite)
    elif is_shardbridge:
        out = export_hf(src, args.dst, arch, dtype=dtype, overwrite=args.overwrite)
        if stored is not None:  # the source folder's own config.json, dtype updated
            config = dict(stored)
            if dtype is not None:  # transformers 5 writes "dtype", 4.x "torch_dtype"
                key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
                config[key] = str(dtype).removeprefix("torch.")
            write_file(Path(out) / "config.json", (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    elif (src / ".metadata").is_file():
        out = fsdp_dtensor_to_hf(src, args.dst, arch, head_dim=args.head_dim, dtype=dtype, overwrite=args.overwrite)
    else:
        raise ValueError(
            f"{src} is neither a shardbridge checkpoint (shardbridge.json) nor a DCP / fsdp_dtensor checkpoint "
            "(.metadata); pass a checkpoint directory"
        )
    print(f"shardbridge ckpt convert: wrote {out}")
    return 0


_ARCH_FLAGS = {  # flag / LlamaArch field -> (config.json key, default)
    "num_attention_heads": ("num_attention_heads", None),
    "rope_theta": ("rope_theta", 10000.0),
    "rms_norm_eps": ("rms_norm_eps", 1e-5),
    "max_position_embeddings": ("max_position_embeddings", 4096),
    "num_experts_per_tok": ("num_experts_per_tok", None),  # MoE only: write_hf_config asks for it
}
_OPTIONAL = ("num_experts_per_tok",)


def _read_config(folder: Path) -> dict:
    from shardbridge.pretrained import read_json

    path = folder / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no config.json: pass a from_pretrained folder (save_pretrained writes one)")
    try:
        config = read_json(path)  # size and nesting bounded first: [Note: bounded structure]
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path} holds a {type(config).__name__}, not a config mapping")
    return config


def _arch(args: argparse.Namespace, config: dict | None) -> LlamaArch:
    """The architecture from the source's config and the flags; a flag that disagrees is refused."""
    values = {}
    for field, (key, default) in _ARCH_FLAGS.items():
        flag = getattr(args, field)
        known = None
        if config is not None:
            known = config.get(key)
            if key == "rope_theta" and known is None:
                known = (config.get("rope_parameters") or {}).get("rope_theta")
        if flag is not None and known is not None and flag != known:
            raise ValueError(
                f"--{field.replace('_', '-')} {flag} disagrees with the source's config.json {key}={known}; "
                "drop the flag (the source's value is used)"
            )
        value = flag if flag is not None else known if known is not None else default
        if value is None and field in _OPTIONAL:
            continue
        if value is None:
            raise ValueError(
                f"--{field.replace('_', '-')} is required: the source carries no config.json (pass the model's "
                "TransformerConfig value)"
            )
        if field in ("num_attention_heads", "num_experts_per_tok") and (not isinstance(value, int) or value <= 0):
            raise ValueError(f"--{field.replace('_', '-')} {value} must be a positive integer")
        values[field] = value
    return LlamaArch(**values)


cli_verb = Verb(
    help="convert Megatron-Core GPT checkpoints to / from Hugging Face folders",
    main=main,
    install_hint=MCORE_INSTALL_HINT,
)
