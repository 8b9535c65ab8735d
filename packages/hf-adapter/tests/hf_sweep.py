"""The architecture sweep (not a test module): every ``*ForCausalLM`` with a TP plan, tiny, on 4 gloo ranks.

Used by ``test_hf_sweep.py`` (a third of the architectures by default, all with
``SHARDBRIDGE_HF_SWEEP=all``) and, to write the table of docs/hf.md, run as a script::

    OMP_NUM_THREADS=1 .venv/bin/python packages/hf-adapter/tests/hf_sweep.py [model_type ...]

Checks per architecture, at dp_shard=2 x tp=2 through ``ShardbridgeAccelerator`` (fp32, dropout
0, every rank built with a different seed so rank 0's weights must win):

    train     finite losses over STEPS steps, the last below the first
    match     losses and step-1 gradients equal a one-process run on the global batch
              (allclose rtol=RTOL, atol=ATOL element-wise, and for each gradient
              ||g - g_ref|| <= RTOL * ||g_ref|| + NORM_ATOL: the element-wise test alone
              passes a small gradient that is wrong as a whole)
    resume    save at step 2, a fresh model + optimizer loads it and redoes step 3: weights
              torch.equal to the uninterrupted run
    reshard   the step-3 checkpoint loaded at dp_shard=4 and at tp=4: torch.equal weights
    export    export_pretrained -> from_pretrained: logits equal the sharded model's
              (rtol=RTOL, atol=ATOL)
"""

from __future__ import annotations

import functools
import math
import os
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
RTOL, ATOL = 1e-4, 1e-5
NORM_ATOL = 1e-7  # absolute slack of the per-gradient norm test (fp32 sums in another order)
DP2_TP2 = {"dp_shard": 2, "tp": 2}
RESHARD = {"dp4": {"dp_shard": 4}, "tp4": {"dp_shard": 1, "tp": 4}}
CHECKS = ("train", "match", "resume", "reshard_dp4", "reshard_tp4", "export")

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
}

# The default CI run: representative architectures, one or more per style family (budget:
# ~2 minutes on 2 cores); the rest with SHARDBRIDGE_HF_SWEEP=all.
CI_ARCHS = (
    "llama",  # colwise / rowwise / embedding_rowwise / colwise_gather_output
    "qwen3",  # replicated_with_grad_allreduce (q_norm / k_norm)
    "gemma3_text",  # per-head norms, sliding window
    "apertus",  # a learnable activation between colwise and rowwise (auto-handled)
    "olmo2",  # colwise_gather_output + rowwise_split_input
    "phi3",  # fused qkv / gate_up Linears, gathered
    "starcoder2",  # biases, LayerNorm
    "granite_swa",  # local_params + a colwise bare parameter (attention sinks)
    "qwen3_moe",  # packed_colwise + rowwise expert parameters under moe_tp_experts
    "mixtral",  # MoE
    "olmoe",  # MoE + rowwise_split_input
    "llama4_text",  # packed_rowwise experts, in-place add into a rowwise output
    "doge",  # upstream plan corrected: dt_proj reduce-scattered over kv heads, A sharded (_tp.py)
    "inkling_text",  # upstream plan corrected: packed gate_up experts; all_reduce with local params
)

# Documented exceptions (docs/hf.md, "Architecture sweep"): {model_type: reason}.
KNOWN: dict[str, str] = {
    "phimoe": "sparsemixer routing draws random jitter in training: match / resume cannot hold across processes",
    # Multimodal configs whose towers live in nested sub-configs the sweep's BASE does not reach: the
    # default sizes are far beyond the shared machine's per-run memory budget (4 GB), so never run.
    "llama4": "multimodal: default text/vision sub-configs = 1.1e11 params; no tiny nested config yet",
    "phi4_multimodal": "multimodal: default vision/audio towers = 8.7e8 params (3.5 GB fp32 per rank)",
}


def sweep_archs() -> dict[str, str]:
    """``{model_type: *ForCausalLM class name}`` for every architecture whose config has a TP plan."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type, cls_name in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()):
        if not isinstance(cls_name, str) or not cls_name.endswith("ForCausalLM"):
            continue
        config_cls = getattr(transformers, CONFIG_MAPPING_NAMES.get(model_type, ""), None)
        if config_cls is not None and getattr(config_cls, "base_model_tp_plan", None):
            out[model_type] = cls_name
    return out


@functools.cache
def _defaults(model_type: str) -> frozenset:
    from transformers import AutoConfig

    return frozenset(AutoConfig.for_model(model_type).to_dict())


def tiny_config(model_type: str, **extra):
    """A tiny fp32 config of ``model_type``: BASE where the config has the field, no dropout."""
    from transformers import AutoConfig

    fields = _defaults(model_type)
    kwargs = {k: v for k, v in BASE.items() if k in fields}
    if "qk_rope_head_dim" in fields:  # MLA: the rotary part of a head
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]
    kwargs.update(OVERRIDES.get(model_type, {}))
    kwargs.update(extra)
    for name in fields:
        if "dropout" in name and name not in kwargs:
            kwargs[name] = 0.0
    return AutoConfig.for_model(model_type, **kwargs)


def build(model_type: str, seed: int, **extra):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **extra), dtype=torch.float32)
    return model.train()


def probe_ids() -> torch.Tensor:
    return H.global_batch(99, 1)


# -- one process: the oracle -------------------------------------------------------------------


def reference(model_type: str, steps: int = STEPS, dp: int = 2, **extra) -> dict:
    model = build(model_type, seed=0, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], None
    for step in range(1, steps + 1):
        ids = H.global_batch(step, dp)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        if step == 1:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


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


def train_save_resume_export(model_type: str, root: str, **extra) -> dict:
    """dp_shard=2 x tp=2: train, save at 2 and 3, resume from 2, export; rank 0 returns the tensors."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    rank0 = dist.get_rank() == 0
    acc, model, opt = _prepared(model_type, DP2_TP2, seed=dist.get_rank(), **extra)
    losses, grads = [], None
    for step in range(1, STEPS + 1):
        loss = _step(acc, model, opt, step)
        if step == 1:
            grads = {
                n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                for n, p in model.named_parameters()
                if p.grad is not None
            }
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
        out.update(grads=grads, params=params, logits=logits)
    return out


def first_step(model_type: str, **extra) -> dict | None:
    """dp_shard=2 x tp=2: step 1's dp-mean loss and full gradients (rank 0), no checkpoints."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    acc, model, opt = _prepared(model_type, DP2_TP2, seed=dist.get_rank(), **extra)
    loss = acc.reduce_loss(_step(acc, model, opt, 1)).item()
    grads = {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return {"loss": loss, "grads": grads} if dist.get_rank() == 0 else None


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


def _close(a, b) -> bool:
    return torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _grad_close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        _close(a, b) and float(torch.linalg.vector_norm(a - b)) <= RTOL * float(torch.linalg.vector_norm(b)) + NORM_ATOL
    )


def _rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a - b).abs() / (b.abs() + ATOL / RTOL)).max()) if a.numel() else 0.0


def run_arch(model_type: str, *, timeout: float = 300, **extra) -> dict[str, str]:
    """Every check of the module docstring for one architecture: ``{check: "pass" | reason}``."""
    from shardbridge.testing import run_distributed

    result: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as root:
        try:
            ref = reference(model_type, **extra)
            runs = run_distributed(train_save_resume_export, model_type, root, world_size=4, timeout=timeout, **extra)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            reason = _reason(exc)
            return {c: reason for c in CHECKS}
        r0 = runs[0]
        losses = torch.tensor(r0["losses"])
        ok = bool(torch.isfinite(losses).all()) and losses[-1] < losses[0]
        result["train"] = "pass" if ok else f"losses {r0['losses']}"
        ref_losses = torch.tensor(ref["losses"])
        bad = [n for n, g in ref["grads"].items() if n not in r0["grads"] or not _grad_close(r0["grads"][n], g)]
        if _close(losses, ref_losses) and not bad:
            result["match"] = "pass"
        else:
            worst = max(
                [_max_rel(losses, ref_losses)]
                + [_max_rel(r0["grads"][n], ref["grads"][n]) for n in bad if n in r0["grads"]]
            )
            worst_norm = max([_rel_norm(r0["grads"][n], ref["grads"][n]) for n in bad if n in r0["grads"]] or [0.0])
            result["match"] = (
                f"max rel diff {worst:.1e}, worst gradient rel-norm diff {worst_norm:.1e} "
                f"({len(bad)} grads differ, e.g. {bad[:2]})"
            )
        result["resume"] = "pass" if not r0["resume_mismatch"] else f"differs: {r0['resume_mismatch'][:2]}"
        for name, dims in RESHARD.items():
            try:
                got = run_distributed(load_full, model_type, root, dims, world_size=4, timeout=timeout, **extra)[0]
                diff = [n for n, p in r0["params"].items() if not torch.equal(got[n], p)]
                result[f"reshard_{name}"] = "pass" if not diff else f"differs: {diff[:2]}"
            except Exception as exc:  # noqa: BLE001
                result[f"reshard_{name}"] = _reason(exc)
        if _close(r0["export_logits"], r0["logits"]):
            result["export"] = "pass"
        else:
            result["export"] = f"logits max rel diff {_max_rel(r0['export_logits'], r0['logits']):.1e}"
    return result


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    errors = [line for line in text if "Error" in line or "Exception" in line]
    line = (errors[-1] if errors else (text[-1] if text else type(exc).__name__)).strip()
    return (line[:157] + "...") if len(line) > 160 else line


def main(archs: list[str]) -> None:
    """Run the sweep and print the docs/hf.md table (markdown)."""
    archs = archs or sorted(sweep_archs())
    print("| architecture | " + " | ".join(CHECKS) + " | s |")
    print("|" + "---|" * (len(CHECKS) + 2))
    for model_type in archs:
        start = time.perf_counter()
        try:
            result = run_arch(model_type)
        except Exception:  # noqa: BLE001
            result = {c: _reason(RuntimeError(traceback.format_exc())) for c in CHECKS}
        cells = [result.get(c, "-").replace("|", "/") for c in CHECKS]
        print(f"| {model_type} | " + " | ".join(cells) + f" | {math.ceil(time.perf_counter() - start)} |", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1:])
