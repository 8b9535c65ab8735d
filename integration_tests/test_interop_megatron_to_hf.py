"""Across frameworks: Megatron-FSDP (dp2 x tp2) -> shardbridge checkpoint -> torch -> transformers.

The path users ask upstream for (Megatron-LM #2805, Megatron-Bridge #1211): a model trained with
Megatron-FSDP, its fused SwiGLU / QKV weights split in item coordinates by the core checkpoint,
loaded by plain torch in one process, exported as a Hugging Face folder and loaded by
``AutoModelForCausalLM.from_pretrained``. Oracles: the Megatron-FSDP model's own loss on a probe
batch, the single-process reference Llama loaded from the checkpoint, and its logits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron_fsdp")
transformers = pytest.importorskip("transformers")

from shardbridge import ParallelDims, PrecisionPolicy, checkpoint  # noqa: E402
from shardbridge.models import Llama, LlamaConfig, export_hf_llama, synthetic_batch  # noqa: E402
from shardbridge.testing import run_distributed  # noqa: E402

CONFIG = LlamaConfig.tiny()


def _probe() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batch(CONFIG, 2, 16, seed=11, step=0, dp_rank=0, dp_size=1)


def _train_megatron_fsdp(path: str) -> float:
    from shardbridge_megatron_fsdp import apply_llama_tp, save, shard_model

    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    model = apply_llama_tp(Llama(CONFIG, seed=0), pm["tp"])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, opt = shard_model(model, opt, pm, PrecisionPolicy.fp32(), strategy="optim_grads_params")
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm["dp"].size()
    for step in range(3):
        tokens, labels = synthetic_batch(CONFIG, 2, 16, step=step, dp_rank=dp_rank, dp_size=dp_size)
        F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten()).backward()
        opt.step()
        opt.zero_grad()
    save(path, model=model, optimizer=opt, step=3)
    tokens, labels = _probe()  # the same probe on every rank
    with torch.no_grad():
        return F.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten()).item()


def test_megatron_fsdp_checkpoint_becomes_a_from_pretrained_model(tmp_path):
    losses = run_distributed(_train_megatron_fsdp, str(tmp_path / "ckpt"), world_size=4, timeout=300)
    assert max(losses) - min(losses) < 1e-6  # every rank computed the same probe loss

    single = Llama(CONFIG, seed=99)  # other initial weights: everything must come from the checkpoint
    state = checkpoint.load(tmp_path / "ckpt", model=single, rng=False)
    assert state.step == 3
    tokens, labels = _probe()
    with torch.no_grad():
        logits = single(tokens)
    torch.testing.assert_close(
        F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item(), losses[0], rtol=1e-5, atol=0
    )

    hf = transformers.AutoModelForCausalLM.from_pretrained(export_hf_llama(tmp_path / "ckpt", tmp_path / "hf", CONFIG))
    with torch.no_grad():
        hf_logits = hf(tokens).logits
    torch.testing.assert_close(hf_logits, logits, rtol=1e-5, atol=1e-5)
