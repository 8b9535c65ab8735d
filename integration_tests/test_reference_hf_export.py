"""The reference Llama trained sharded (dp2 x tp2) -> checkpoint -> HF folder -> from_pretrained.

Oracle: the trained sharded model's own logits (all-gathered), against transformers'
LlamaForCausalLM loaded from the export. fp32 throughout; tolerance is fp32 rounding.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from shardbridge import ParallelDims, PrecisionPolicy, checkpoint  # noqa: E402
from shardbridge.models import (  # noqa: E402
    Llama,
    LlamaConfig,
    export_hf_llama,
    hf_llama_export_record,
    hf_llama_name,
    parallelize_llama,
    synthetic_batch,
)
from shardbridge.testing import run_distributed  # noqa: E402

CONFIG = LlamaConfig.tiny(vocab_size=250, intermediate_size=200)  # uneven over tp=2 x dp=2


def _train_and_save(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    model = parallelize_llama(Llama(CONFIG, seed=0), pm, PrecisionPolicy.fp32())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    dp_rank, dp_size = pm["dp"].get_local_rank(), pm["dp"].size()
    for step in range(4):
        tokens, labels = synthetic_batch(CONFIG, 2, 16, step=step, dp_rank=dp_rank, dp_size=dp_size)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    # The record makes `shardbridge ckpt export` (the core CLI, no model config) write a HF folder.
    checkpoint.save(path, model=model, optimizer=opt, step=4, extra={"export": hf_llama_export_record(CONFIG)})
    probe, _ = synthetic_batch(CONFIG, 2, 16, seed=7, step=0, dp_rank=0, dp_size=1)
    with torch.no_grad():
        out = model(probe)
    out = out.full_tensor() if hasattr(out, "full_tensor") else out
    return probe, out


def test_sharded_reference_llama_exports_to_from_pretrained(tmp_path):
    probe, sharded_logits = run_distributed(_train_and_save, str(tmp_path / "ckpt"), world_size=4)[0]
    out = export_hf_llama(tmp_path / "ckpt", tmp_path / "hf", CONFIG, progress=False)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["intermediate_size"] == 200
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        hf_logits = hf(probe).logits
    torch.testing.assert_close(hf_logits, sharded_logits, rtol=1e-5, atol=1e-5)
    # Every HF parameter came from the checkpoint (none left at its random init).
    exported = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(exported) == {n for n, _ in hf.named_parameters()}

    # `shardbridge ckpt export CKPT OUT` gives the same folder: config.json and every tensor
    from safetensors.torch import load_file
    from shardbridge.cli._main import main

    assert main(["ckpt", "export", str(tmp_path / "ckpt"), str(tmp_path / "cli"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == config
    cli = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cli")
    with torch.no_grad():
        assert torch.equal(cli(probe).logits, hf_logits)

    def tensors(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    ours, theirs = tensors(tmp_path / "cli"), tensors(out)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_hf_llama_name_refuses_unknown_names():
    assert hf_llama_name("layers.0.feed_forward.down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="'layers.0.attention.qkv.weight' is not a reference-Llama checkpoint name"):
        hf_llama_name("layers.0.attention.qkv.weight")
