"""The architecture sweep (not a test module): every ``*ForCausalLM`` with a TP or EP plan, tiny, on 4 gloo ranks.

Used by ``test_hf_sweep.py`` (``CI_ARCHS``, HSDP for ``CI_HSDP``, and ``CI_VARIANTS`` by default;
everything with ``SHARDBRIDGE_HF_SWEEP=all``) and, to write the table of docs/hf.md, run as a script::

    OMP_NUM_THREADS=1 .venv/bin/python packages/hf-adapter/tests/hf_sweep.py [--shard I/N] [model_type ...]

Checks per architecture through ``ShardbridgeAccelerator`` (fp32, dropout 0, every rank built
with a different seed so rank 0's weights must win):

    train           dp_shard=2 x tp=2: finite losses over STEPS steps, the last below the first
    match_dp2_tp2   dp_shard=2 x tp=2 against one process on the global batch: the losses, EVERY
                    parameter's step-1 gradient (full tensors, after the first backward, before
                    clipping and the optimizer step) and the total gradient norm (the one
                    clip_grad_norm_ computes: the clipping factor); see "gradient comparison"
    match_hsdp_tp2  the same at dp_replicate=2 x tp=2 (HSDP: FSDP2 over a replicate axis), step 1
    resume          save at step 2, a fresh model + optimizer loads it and redoes step 3: weights
                    torch.equal to the uninterrupted run
    reshard         the step-3 checkpoint loaded at dp_shard=4 and at tp=4: torch.equal weights
    export          export_pretrained -> from_pretrained: logits equal the sharded model's
                    (rtol=RTOL, atol=ATOL)

and per VARIANT of the architecture (:func:`variants`: configs real models publish that the tiny
generic one misses, derived from the config class's fields): ``match_dp2_tp2`` at step 1.

Gradient comparison: a parameter's gradient ``g`` passes when ``||g - g_ref|| <= GRAD_RTOL * d``
with ``d = max(||g_ref||, GRAD_FLOOR * ||G_ref||)`` (``G_ref``: every gradient of the model; the
floor keeps near-zero gradients from being judged on their own rounding). The same relative
error of the one-process fp32 gradient against float64 (the same weights, ``model.double()``) is
the noise floor, reported beside the largest error; a parameter with a gradient in one run only
is compared with zeros.

Losses are compared with two oracles, the one-process fp32 run and the same run in float64: a
distributed run passes when it is within (RTOL, ATOL) of either (:func:`losses_match`; a few
AdamW steps can carry the fp32 reference itself away from the exact loss).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import hf_helpers as H  # noqa: E402

STEPS = 3
LR = 1e-3
RTOL, ATOL = 1e-4, 1e-5  # losses and logits, element-wise
GRAD_RTOL = 1e-4  # ||g - g_ref|| / d per parameter (fp32 sums in another order: ~1e-7 .. 1e-6)
GRAD_FLOOR = 1e-3  # d >= GRAD_FLOOR * ||G_ref||: gradients below a 1000th of the total are judged on that
LAYOUTS = {"dp2_tp2": {"dp_shard": 2, "tp": 2}, "hsdp_tp2": {"dp_replicate": 2, "dp_shard": 1, "tp": 2}}
DP2_TP2 = LAYOUTS["dp2_tp2"]
RESHARD = {"dp4": {"dp_shard": 4}, "tp4": {"dp_shard": 1, "tp": 4}}
CHECKS = ("train", "match_dp2_tp2", "match_hsdp_tp2", "resume", "reshard_dp4", "reshard_tp4", "export")

# Sizes every tiny model gets when its config has the field (tp up to 4 divides all of them).
BASE = dict(
    vocab_size=H.VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    # MoE
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
    n_shared_experts=1,
    first_k_dense_replace=1,
    # MLA
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    # shared experts: sizes only (whether a config has them is the "shared_experts" variant's business)
    shared_experts_intermediate_size=64,
    moe_shared_expert_intermediate_size=64,
    # per-layer input embeddings (Gemma 3n / 4): their own vocabulary, 262144 x 256 per layer by default
    vocab_size_per_layer_input=H.VOCAB,
)

# Per-architecture fixes on top of BASE (field names differ between configs).
# Grouped routing: n_group groups of n_routed_experts // n_group experts (8 groups of 4 experts = 0).
_ONE_GROUP = dict(n_group=1, topk_group=1, num_expert_group=1)
# DSA (sparse indexer) attention: MLA keys are per query head (no GQA repeat), indexer sized to the model.
_DSA = dict(_ONE_GROUP, num_key_value_heads=8, index_n_heads=8, index_head_dim=8, index_topk=16)
OVERRIDES: dict[str, dict] = {
    "deepseek_v3": _ONE_GROUP,
    "axk1": _ONE_GROUP,
    "deepseek_v32": _DSA,
    "glm_moe_dsa": _DSA,
    "axk2": _DSA,
    # hybrid linear attention: top-k named num_experts_per_token, linear heads sized to the model
    "kimi_linear": dict(num_experts_per_token=2, linear_head_dim=8, linear_num_heads=8),
    "bailing_hybrid": dict(_ONE_GROUP, num_experts_per_token=2, linear_head_dim=8, linear_num_heads=8),
    "lfm2_moe": dict(layer_types=["full_attention", "conv"], num_dense_layers=1),  # default: no layer types
    "dots3_note_text": dict(num_key_value_heads=8),  # its config requires kv heads == heads
    # default shares kv across more layers than the model has; per-layer-input vocab 262144 = 1.3e8 params;
    # no padding row: token 0 (in the batches) would embed to zeros, and the model's AltUp magnitude
    # mean(h ** 2) ** 0.5 has an infinite gradient there (NaN weights at step 3, in one process too)
    "gemma3n_text": dict(num_kv_shared_layers=0, vocab_size_per_layer_input=H.VOCAB, pad_token_id=None),
    # nGPT: hidden states are L2-normalised (x / ||x||), so the zero padding row of token 0 gives an
    # infinite gradient (NaN at step 3, in one process too); the default input / output layer counts
    # (8 + 8 of 2 layers) leave a negative recurrent count
    "dory": dict(pad_token_id=None, num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1, n_output_layers=1),
    "zaya": dict(num_experts_per_tok=1),  # its config refuses top-k above 1
    # per-layer-type rope: the default {} has no entry per layer type (KeyError 'full_attention')
    "cohere_compass_text": dict(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_parameters={
            t: {"rope_type": "default", "rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")
        },
    ),
    # default: 2e9 params; its fields are named moe_topk / num_layers (BASE's names are aliases the
    # config's to_dict does not list), so top-12 of 4 + 2 experts and 28 layers without these
    "longcat_flash": dict(ffn_hidden_size=128, expert_ffn_hidden_size=64, zero_expert_num=2, moe_topk=2, num_layers=1),
    # GPT-J style fields (BASE reaches n_embd / n_layer / n_head / n_positions through the aliases): the
    # default rotary_dim 64 is more than a tiny head (64 / 8 = 8)
    "codegen": dict(rotary_dim=4, n_ctx=64),
    "gptj": dict(rotary_dim=4),
}

# The default CI run: representative architectures, one per style family the adapter adds or
# corrects (budget: ~2 minutes on 2 cores); the rest with SHARDBRIDGE_HF_SWEEP=all (nox -s hf_sweep).
# Moved to the full sweep for CI time (each still passes there, docs/hf.md): gemma3_text (per-head
# norms: qwen3 has them), apertus, olmo2 (rowwise_split_input), starcoder2, granite_swa, olmoe
# (qwen3_moe runs the same expert styles), llama4_text; on 2026-11-28 (CI over budget): phi3 (fused
# Linears gathered: the core's fused tests), inkling_text (packed experts: qwen3_moe's styles).
CI_ARCHS = (
    "llama",  # colwise / rowwise / embedding_rowwise / colwise_gather_output
    "qwen3",  # replicated_with_grad_allreduce (q_norm / k_norm: local input, gradient all-reduced)
    "qwen3_moe",  # packed_colwise + rowwise expert parameters under moe_tp_experts
    "doge",  # upstream plan corrected: dt_proj reduce-scattered over kv heads, A sharded (_tp.py)
)

# The CI architectures that also run match_hsdp_tp2 in the default run (the full sweep: all of them):
# MoE experts with the data-flow gradient rule (the plain path is the same code without experts).
CI_HSDP = ("qwen3_moe",)

# Variants in the default CI run: (model_type, variant), one per knob that changes what the adapter
# does (head_dim and shared_experts change only shapes: the full sweep).
CI_VARIANTS = (
    ("deepseek_v2", "mla_without_q_lora"),  # kv_a_layernorm: replicated input and output gradient
    ("llama", "odd_vocab"),  # uneven vocab rows over dp x tp in the embedding and the head
    ("gemma3_text", "tied"),  # one tied embedding DTensor, both uses' gradients
)

# Documented exceptions (docs/hf.md, "Architecture sweep"): {model_type: reason}.
KNOWN: dict[str, str] = {
    "phimoe": "sparsemixer routing draws random jitter in training: match / resume cannot hold across processes",
    # Multimodal configs whose towers live in nested sub-configs the sweep's BASE does not reach: the
    # default sizes are far beyond the shared machine's per-run memory budget (4 GB), so never run.
    "llama4": "multimodal: default text/vision sub-configs = 1.1e11 params; no tiny nested config yet",
    "phi4_multimodal": "multimodal: default vision/audio towers = 8.7e8 params (3.5 GB fp32 per rank)",
}
NEEDS_EP = (
    "EP plan only (no base_model_tp_plan): tp > 1 is refused by name; trains in the EP sweep "
    "(hf_ep_sweep.py, docs/hf.md 'Expert parallelism')"
)


def sweep_archs() -> dict[str, str]:
    """``{model_type: *ForCausalLM class name}`` for every architecture whose config has a TP or an EP plan."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type, cls_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if not isinstance(cls_name, str) or not cls_name.endswith("ForCausalLM"):
            continue
        config_cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
        if config_cls is not None and (
            getattr(config_cls, "base_model_tp_plan", None) or getattr(config_cls, "base_model_ep_plan", None)
        ):
            out[model_type] = cls_name
    return out


def skip_reason(model_type: str) -> str | None:
    """Why ``model_type`` is not run: a documented exception, or an EP plan without a TP plan; None = run it."""
    if model_type in KNOWN:
        return KNOWN[model_type]
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    config_cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
    if config_cls is not None and not getattr(config_cls, "base_model_tp_plan", None):
        return NEEDS_EP
    return None


@functools.cache
def _defaults(model_type: str) -> frozenset:
    from transformers import AutoConfig

    return frozenset(AutoConfig.for_model(model_type).to_dict())


def tiny_config(model_type: str, **extra):
    """A tiny fp32 config of ``model_type``: BASE where the config has the field (or its alias), no dropout.

    Aliases are the config class's ``attribute_map`` (GPT-J / CodeGen: ``n_embd`` for ``hidden_size``).
    """
    from transformers import AutoConfig

    fields = _defaults(model_type)
    aliases = getattr(type(AutoConfig.for_model(model_type)), "attribute_map", {}) or {}
    # An alias never overrides a field BASE sets by its own name (DeepSeek-V4 maps intermediate_size to
    # moe_intermediate_size, which BASE sizes itself).
    kwargs = {aliases[k]: v for k, v in BASE.items() if k not in fields and aliases.get(k) in fields}
    kwargs.update({k: v for k, v in BASE.items() if k in fields})
    if "qk_rope_head_dim" in fields:  # MLA: the rotary part of a head
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    kwargs.update(OVERRIDES.get(model_type, {}))
    kwargs.update(extra)
    for name in fields:
        if "dropout" in name and name not in kwargs:
            kwargs[name] = 0.0
    return AutoConfig.for_model(model_type, **kwargs)


# -- variants: what published configs set and the tiny generic one misses ----------------------

ODD_VOCAB = H.VOCAB + 3  # 259: uneven over tp 2 and dp 2 (published: Granite 49155, GPT-2 50257)
_SHARED_COUNT = re.compile(r"(^|_)n(um)?_shared_experts$")  # n_shared_experts, num_shared_experts, moe_num_...
_SHARED_SIZE = re.compile(r"shared_experts?_intermediate_size$|^shared_intermediate_size$")


def variants(model_type: str) -> dict[str, dict]:
    """``{variant: config overrides}`` for the knobs ``model_type``'s config class has (from its fields).

    - ``mla_without_q_lora``: ``q_lora_rank`` None (DeepSeek-V2-Lite, Kimi, Sarvam publish it so);
    - ``odd_vocab``: a vocabulary no tp / dp degree divides (Granite: 49155);
    - ``head_dim``: ``head_dim`` 16 != hidden / heads = 8 (Gemma 2: 256 vs 288, Qwen3: 128 vs 64;
      not for MLA configs, whose ``head_dim`` is the rotary part);
    - ``tied``: ``tie_word_embeddings`` (Qwen2.5-0.5B, Llama-3.2-1B, Gemma);
    - ``shared_experts``: shared experts on (count 1, size 64) where the tiny config has none
      (Qwen1.5-MoE, DeepSeek publish them).

    A variant whose overrides leave the tiny config as it is (the knob already set), or that the
    config class refuses (a field typed ``int`` cannot be None), is not listed.
    """
    fields = _defaults(model_type)
    base = tiny_config(model_type).to_dict()
    mla = "q_lora_rank" in fields or "kv_lora_rank" in fields
    out: dict[str, dict] = {}
    if "q_lora_rank" in fields:
        out["mla_without_q_lora"] = {"q_lora_rank": None}
    if "vocab_size" in fields:
        out["odd_vocab"] = {"vocab_size": ODD_VOCAB}
    if "head_dim" in fields and not mla:
        out["head_dim"] = {"head_dim": 2 * BASE["head_dim"]}
    if "tie_word_embeddings" in fields:
        out["tied"] = {"tie_word_embeddings": True}
    counts = [f for f in fields if _SHARED_COUNT.search(f)]
    sizes = [f for f in fields if _SHARED_SIZE.search(f)]
    if (counts or sizes) and any(not base.get(f) for f in counts + sizes):
        out["shared_experts"] = {**dict.fromkeys(counts, 1), **dict.fromkeys(sizes, BASE["moe_intermediate_size"])}
    return {
        name: overrides
        for name, overrides in out.items()
        if any(base.get(k, object()) != v for k, v in overrides.items()) and _accepts(model_type, overrides)
    }


def _accepts(model_type: str, overrides: dict) -> bool:
    """Does the config class take these values (axk1 types ``q_lora_rank: int``: no MLA without q-LoRA)?"""
    from huggingface_hub.errors import StrictDataclassError  # transformers' typed config fields

    try:
        tiny_config(model_type, **overrides)
    except (TypeError, ValueError, StrictDataclassError):
        return False
    return True


MAX_PARAMS = 5e7  # a "tiny" model above this (200 MB fp32) has size fields BASE does not reach


def build(model_type: str, seed: int, **extra):
    """The tiny model, in fp32, train mode; ValueError (before allocating) when it is not tiny."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type, **extra)
    with torch.device("meta"):
        num_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if num_params > MAX_PARAMS:
        raise ValueError(
            f"the tiny {model_type} config has {num_params:.1e} parameters (> {MAX_PARAMS:.0e}): some of its size "
            "fields have names BASE does not reach; add them to hf_sweep.OVERRIDES"
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.train()


def probe_ids() -> torch.Tensor:
    return H.global_batch(99, 1)


def _grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full plain tensor (``full_tensor()`` for DTensors)."""
    from torch.distributed.tensor import DTensor

    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }


# -- one process: the oracle -------------------------------------------------------------------


def reference(model_type: str, steps: int = STEPS, dp: int = 2, **extra) -> dict:
    """One process on the global batch: losses of ``steps`` AdamW steps; step 1's gradients and total norm.

    ``grads64`` / ``losses64``: the same run in float64 (the noise floor, and the second loss
    oracle); None when the model does not run in float64.
    """
    losses, grads = _train_one_process(build(model_type, seed=0, **extra), steps, dp)
    model64 = build(model_type, seed=0, **extra).double()  # the same weights, in float64
    if model64.config._experts_implementation not in (None, "eager"):
        # torch's grouped_mm (transformers' default experts kernel) has no float64 path; "eager" is the same math.
        model64.set_experts_implementation("eager")
    try:
        losses64, grads64 = _train_one_process(model64, steps, dp)
    except (RuntimeError, TypeError, ValueError):  # a kernel or a cast that has no float64 path
        losses64, grads64 = None, None
    return {"losses": losses, "grads": grads, "losses64": losses64, "grads64": grads64}


def _train_one_process(model, steps: int, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(1, steps + 1):
        ids = H.global_batch(step, dp)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if step == 1:
            grads = _grads(model)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


# -- gloo workers ------------------------------------------------------------------------------


def _prepared(model_type: str, dims: dict, seed: int, **extra):
    from shardbridge import ParallelDims

    acc = H.sb_accelerator(ParallelDims(**dims))
    model = build(model_type, seed=seed, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _step(acc, model, opt, step: int) -> float:
    pm = acc.parallel_mesh
    ids = H.local_batch(step, pm["dp"].get_local_rank(), pm.dims.degree("dp"))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    acc.backward(loss)
    return loss


def _grads_and_norm(acc, model) -> tuple[dict[str, torch.Tensor], float]:
    """Step 1's full gradients, then the total norm clip_grad_norm_ computes (max_norm=inf: no clipping)."""
    grads = _grads(model)
    return grads, float(acc.clip_grad_norm_(model.parameters(), float("inf")))


def train_save_resume_export(model_type: str, root: str, **extra) -> dict:
    """dp_shard=2 x tp=2: train, save at 2 and 3, resume from 2, export; rank 0 returns the tensors."""
    import torch.distributed as dist

    rank0 = dist.get_rank() == 0
    acc, model, opt = _prepared(model_type, DP2_TP2, seed=dist.get_rank(), **extra)
    losses, grads, norm = [], None, None
    for step in range(1, STEPS + 1):
        loss = _step(acc, model, opt, step)
        if step == 1:
            grads, norm = _grads_and_norm(acc, model)
        opt.step()
        opt.zero_grad()
        acc.step = step
        losses.append(acc.reduce_loss(loss).item())
        if step == 2:
            acc.save_state(f"{root}/step-2")
    acc.save_state(f"{root}/step-3")
    params = H.full_params(model)
    with torch.no_grad():
        logits = model(input_ids=probe_ids(), use_cache=False).logits.detach().clone()
    num_params = len(list(model.parameters()))

    acc2, model2, opt2 = _prepared(model_type, DP2_TP2, seed=123, **extra)
    acc2.load_state(f"{root}/step-2")
    _step(acc2, model2, opt2, 3)
    opt2.step()
    resumed = H.full_params(model2)
    resume_equal = sorted(n for n in params if not torch.equal(params[n], resumed[n]))
    acc2.export_pretrained(f"{root}/step-3", f"{root}/hf")
    out = {"losses": losses, "resume_mismatch": resume_equal, "num_params": num_params}
    if rank0:
        from transformers import AutoModelForCausalLM

        exported = AutoModelForCausalLM.from_pretrained(f"{root}/hf", dtype=torch.float32).eval()
        with torch.no_grad():
            # use_cache=False: hybrid linear-attention caches (jamba, granitemoehybrid, ...) refuse
            # get_seq_length on a cache without attention layers; the logits do not depend on it.
            out["export_logits"] = exported(input_ids=probe_ids(), use_cache=False).logits
        out.update(grads=grads, norm=norm, params=params, logits=logits)
    return out


def first_step(model_type: str, *, layout: str = "dp2_tp2", **extra) -> dict | None:
    """Step 1 in ``LAYOUTS[layout]``: the dp-mean loss, full gradients and total norm (rank 0), no checkpoints."""
    import torch.distributed as dist

    acc, model, opt = _prepared(model_type, LAYOUTS[layout], seed=dist.get_rank(), **extra)
    loss = acc.reduce_loss(_step(acc, model, opt, 1)).item()
    grads, norm = _grads_and_norm(acc, model)
    return {"losses": [loss], "grads": grads, "norm": norm} if dist.get_rank() == 0 else None


def reference_per_dp_rank(model_type: str, **extra) -> dict:
    """One process, step 1, the loss computed on each dp rank's rows and averaged (dp = 2).

    The oracle for batch-nonlinear losses such as MoE load balancing (``output_router_logits``):
    under data parallelism each rank computes it on its own rows, as DDP / Accelerate do.
    """
    model = build(model_type, seed=0, **extra)
    ids = H.global_batch(1, 2)
    halves = (ids[: H.BATCH_PER_DP], ids[H.BATCH_PER_DP :])
    loss = sum(model(input_ids=h, labels=h, use_cache=False).loss for h in halves) / len(halves)
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def load_full(model_type: str, root: str, dims: dict, **extra) -> dict | None:
    """Load the step-3 checkpoint into ``dims``; rank 0 returns the full weights."""
    import torch.distributed as dist

    acc, model, _ = _prepared(model_type, dims, seed=321, **extra)
    acc.load_state(f"{root}/step-3")
    params = H.full_params(model)
    return params if dist.get_rank() == 0 else None


# -- the checks --------------------------------------------------------------------------------


def losses_match(losses: list[float], ref: dict) -> bool:
    """``losses`` match the one-process fp32 losses, or the float64 ones.

    Two oracles: after a few AdamW steps (whose update ``g / sqrt(v)`` turns a near-zero
    gradient's rounding into a full-size step) a model's fp32 loss can drift from the exact one by
    more than the tolerance. Gemma-4: step 3 of the one-process fp32 run is 1.8e-4 relative from
    float64, while dp2 x tp2 (other summation orders) lands within 2e-6 of float64. A distributed
    run must be close to one of them, so a wrong gradient still fails both.
    """
    got = torch.tensor(losses)
    n = len(losses)
    oracles = [ref["losses"]] + ([ref["losses64"]] if ref.get("losses64") else [])
    return any(_close(got, torch.tensor(o[:n])) for o in oracles)


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / (b.abs() + ATOL / RTOL)).max()) if a.numel() else 0.0


def _norm(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.double()))


@dataclasses.dataclass
class GradMatch:
    """One run's step-1 comparison with the one-process reference (see the module docstring)."""

    failures: list[str]
    """One line per failing item (loss, a parameter, the total norm); empty = match."""
    max_rel: float = 0.0
    """Largest ``||g - g_ref|| / d`` over the parameters."""
    noise: float | None = None
    """Largest ``||g_ref - g_ref64|| / d``: the one-process fp32 rounding (None: no float64 run)."""
    norm_rel: float = 0.0
    """Relative difference of the total gradient norm."""

    def verdict(self) -> str:
        if not self.failures:
            return "pass"
        return f"{len(self.failures)} differ: " + "; ".join(self.failures[:3])


def compare_step1(got: dict, ref: dict) -> GradMatch:
    """Losses, every parameter's gradient and the total norm of a distributed run against ``ref``.

    A parameter with a gradient in one run only is compared with zeros (no gradient = zero gradient).
    """
    ref_grads, got_grads = ref["grads"], got["grads"]
    total = math.sqrt(sum(_norm(g) ** 2 for g in ref_grads.values()))
    floor = GRAD_FLOOR * total
    failures: list[str] = []
    if not losses_match(got["losses"], ref):
        n = len(got["losses"])
        failures.append(f"losses {got['losses']} vs {ref['losses'][:n]} (float64: {(ref.get('losses64') or [])[:n]})")
    max_rel, noise = 0.0, None
    ref64 = ref.get("grads64")
    for name in sorted(set(ref_grads) | set(got_grads)):
        g, r = got_grads.get(name), ref_grads.get(name)
        g, r = (torch.zeros_like(r) if g is None else g), (torch.zeros_like(g) if r is None else r)
        d = max(_norm(r), floor)
        rel = _norm(g - r) / d if g.shape == r.shape else math.inf
        max_rel = max(max_rel, rel)
        if rel > GRAD_RTOL:
            failures.append(f"{name}: rel err {rel:.1e} (norm {_norm(g):.3e} vs {_norm(r):.3e})")
        if ref64 is not None and name in ref64:
            noise = max(noise or 0.0, _norm(r.double() - ref64[name]) / d)
    norm_rel = abs(got["norm"] - total) / total if total else abs(got["norm"])
    if norm_rel > GRAD_RTOL:
        failures.append(f"total grad norm {got['norm']:.6e} vs {total:.6e} (rel {norm_rel:.1e})")
    return GradMatch(failures=failures, max_rel=max_rel, noise=noise, norm_rel=norm_rel)


@dataclasses.dataclass
class ArchResult:
    """What :func:`run_arch` / :func:`run_variant` found: ``{check: "pass" | reason}`` and the gradient numbers."""

    checks: dict[str, str]
    grads: dict[str, GradMatch] = dataclasses.field(default_factory=dict)
    """Per layout (run_arch) or the variant's dp2_tp2 run."""

    def passed(self) -> bool:
        return all(v == "pass" for v in self.checks.values())


RUN_TIMEOUT = 300.0
"""Seconds one distributed run may take (the script's ``--timeout``)."""
PG_TIMEOUT: float | None = None
"""Collective timeout of the gloo pool; None = the harness default (the script's ``--pg-timeout``: a
background run at ``nice 19`` on a shared machine can wait longer than that for a core)."""


def _run4(fn, *args, **kwargs) -> list:
    from shardbridge.testing import run_distributed

    pg = {} if PG_TIMEOUT is None else {"pg_timeout": PG_TIMEOUT}
    return run_distributed(fn, *args, world_size=4, timeout=RUN_TIMEOUT, **pg, **kwargs)


def run_arch(model_type: str, *, hsdp: bool = True, **extra) -> ArchResult:
    """Every check of the module docstring for one architecture (``match_hsdp_tp2`` only if ``hsdp``)."""
    names = [c for c in CHECKS if hsdp or c != "match_hsdp_tp2"]
    checks: dict[str, str] = {}
    grads: dict[str, GradMatch] = {}
    with tempfile.TemporaryDirectory() as root:
        try:
            ref = reference(model_type, **extra)
            runs = _run4(train_save_resume_export, model_type, root, **extra)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            reason = _reason(exc)
            return ArchResult(dict.fromkeys(names, reason))
        r0 = runs[0]
        losses = torch.tensor(r0["losses"])
        ok = bool(torch.isfinite(losses).all()) and losses[-1] < losses[0]
        checks["train"] = "pass" if ok else f"losses {r0['losses']}"
        grads["dp2_tp2"] = compare_step1({"losses": r0["losses"], "grads": r0["grads"], "norm": r0["norm"]}, ref)
        checks["match_dp2_tp2"] = grads["dp2_tp2"].verdict()
        try:
            if hsdp:
                got = _run4(first_step, model_type, layout="hsdp_tp2", **extra)[0]
                grads["hsdp_tp2"] = compare_step1(got, ref)
                checks["match_hsdp_tp2"] = grads["hsdp_tp2"].verdict()
        except Exception as exc:  # noqa: BLE001
            checks["match_hsdp_tp2"] = _reason(exc)
        checks["resume"] = "pass" if not r0["resume_mismatch"] else f"differs: {r0['resume_mismatch'][:2]}"
        for name, dims in RESHARD.items():
            try:
                got = _run4(load_full, model_type, root, dims, **extra)[0]
                diff = [n for n, p in r0["params"].items() if not torch.equal(got[n], p)]
                checks[f"reshard_{name}"] = "pass" if not diff else f"differs: {diff[:2]}"
            except Exception as exc:  # noqa: BLE001
                checks[f"reshard_{name}"] = _reason(exc)
        if _close(r0["export_logits"], r0["logits"]):
            checks["export"] = "pass"
        else:
            checks["export"] = f"logits max rel diff {_max_rel(r0['export_logits'], r0['logits']):.1e}"
    return ArchResult({c: checks[c] for c in names}, grads)


def run_variant(model_type: str, variant: str) -> ArchResult:
    """``match_dp2_tp2`` (step 1) of ``model_type`` with the overrides of ``variants(model_type)[variant]``."""
    extra = variants(model_type)[variant]
    try:
        ref = reference(model_type, steps=1, **extra)
    except RuntimeError as exc:  # the model itself cannot run the variant (helium: o_proj sized hidden x hidden)
        return ArchResult({"match_dp2_tp2": UNSUPPORTED + _reason(exc)})
    try:
        got = _run4(first_step, model_type, **extra)[0]
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return ArchResult({"match_dp2_tp2": _reason(exc)})
    match = compare_step1(got, ref)
    return ArchResult({"match_dp2_tp2": match.verdict()}, {"dp2_tp2": match})


UNSUPPORTED = "one process fails too: "
"""A variant the model does not run even in one process: not a variant of it (listed apart, not a failure)."""


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    errors = [line for line in text if "Error" in line or "Exception" in line]
    line = (errors[-1] if errors else (text[-1] if text else type(exc).__name__)).strip()
    return (line[:157] + "...") if len(line) > 160 else line


# -- the docs/hf.md table ----------------------------------------------------------------------


def _gradient_cell(results: list[ArchResult]) -> str:
    matches = [m for r in results for m in r.grads.values()]
    if not matches:
        return "-"
    worst = max(m.max_rel for m in matches)
    noises = [m.noise for m in matches if m.noise is not None]
    return f"{worst:.1e} / {max(noises):.1e}" if noises else f"{worst:.1e} / -"


def row(model_type: str) -> str:
    """One markdown row of the docs/hf.md table (runs the architecture and its variants)."""
    start = time.perf_counter()
    reason = skip_reason(model_type)
    if reason is not None:
        return f"| {model_type} | " + " | ".join("-" for _ in CHECKS) + f" | - | - | {reason} |"
    try:
        base = run_arch(model_type)
        extra = {v: run_variant(model_type, v) for v in variants(model_type)}
    except Exception:  # noqa: BLE001
        base, extra = ArchResult({c: _reason(RuntimeError(traceback.format_exc())) for c in CHECKS}), {}
    cells = [base.checks.get(c, "-").replace("|", "/") for c in CHECKS]
    unsupported = [v for v, r in extra.items() if r.checks["match_dp2_tp2"].startswith(UNSUPPORTED)]
    extra = {v: r for v, r in extra.items() if v not in unsupported}
    failed = {v: r.checks["match_dp2_tp2"] for v, r in extra.items() if not r.passed()}
    if not extra:
        variant_cell = "-"
    elif not failed:
        variant_cell = "pass: " + ", ".join(extra)
    else:
        variant_cell = "; ".join(f"{v}: {reason}" for v, reason in failed.items()).replace("|", "/")
    if unsupported:  # named, so a reader sees the variant was tried
        variant_cell += " (n/a, one process fails too: " + ", ".join(unsupported) + ")"
    grad = _gradient_cell([base, *extra.values()])
    seconds = math.ceil(time.perf_counter() - start)
    return f"| {model_type} | " + " | ".join(cells) + f" | {variant_cell} | {grad} | {seconds} |"


def main(argv: list[str]) -> None:
    """Run the sweep and print the docs/hf.md table (markdown), one row per architecture as it finishes."""
    global RUN_TIMEOUT, PG_TIMEOUT
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("archs", nargs="*", help="model types (default: every architecture with a TP or EP plan)")
    parser.add_argument("--shard", default="1/1", help="I/N: run every N-th architecture starting at the I-th")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT, help="seconds per distributed run")
    parser.add_argument("--pg-timeout", type=float, default=None, help="gloo collective timeout (seconds)")
    args = parser.parse_args(argv)
    RUN_TIMEOUT, PG_TIMEOUT = args.timeout, args.pg_timeout
    index, count = (int(x) for x in args.shard.split("/"))
    archs = args.archs or sorted(sweep_archs())
    archs = archs[index - 1 :: count]
    print("| architecture | " + " | ".join(CHECKS) + " | variants | gradient rel err / noise floor | s |")
    print("|" + "---|" * (len(CHECKS) + 4), flush=True)
    for model_type in archs:
        print(row(model_type), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
