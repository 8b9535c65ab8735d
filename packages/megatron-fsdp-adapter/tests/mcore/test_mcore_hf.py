"""Megatron-Core GPT <-> Hugging Face LlamaForCausalLM, both ways, at dp2 x tp2 on 4 gloo ranks:
export (``shardbridge ckpt convert --to hf``) -> ``from_pretrained`` logits equal the sharded
model's; a ``save_pretrained`` folder -> shard-on-read into the sharded model (each rank reads
its slices only) -> first loss equals the HF model's; and ``--to megatron`` -> ``load``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mcore_helpers import (
    BATCH,
    FFN,
    GROUPS,
    HEADS,
    HIDDEN,
    LAYERS,
    SEQ,
    VOCAB,
    batch,
    build_sharded,
    loss_of,
    positions,
    train,
)
from shardbridge.testing import run_distributed

transformers = pytest.importorskip("transformers")


def _full_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    from megatron.core import tensor_parallel

    with torch.no_grad():
        local = model(tokens, positions(tokens.shape[0]), None)  # [b, s, vocab / tp]
        return tensor_parallel.gather_from_tensor_model_parallel_region(local).clone()


def _train_and_save(root: str) -> torch.Tensor:
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, save

    try:
        model, opt = build_sharded({"dp_shard": 2, "tp": 2}, adam=True)
        train(model, opt, steps=1)
        save(f"{root}/ckpt", model=model, optimizer=opt, step=1)
        logits = _full_logits(model, batch(5)[0])
        dist.barrier()
        return logits
    finally:
        destroy_parallel_state()


def _hf_logits(folder, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def test_export_to_hf_logits_match(tmp_path):
    from shardbridge.cli._main import main

    logits = run_distributed(_train_and_save, str(tmp_path), world_size=4, timeout=300)[0]
    # The CLI verb, in this process (no process group); max_position_embeddings as the model's.
    argv = ["ckpt", "convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf",
            "--num-attention-heads", str(HEADS), "--max-position-embeddings", str(SEQ)]  # fmt: skip
    assert main(argv) == 0
    hf = _hf_logits(tmp_path / "hf", batch(5)[0])
    assert hf.shape == logits.shape == (BATCH, SEQ, VOCAB)
    torch.testing.assert_close(hf, logits, rtol=0, atol=1e-5)


def _make_hf_folder(folder) -> tuple[float, int]:
    torch.manual_seed(7)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=GROUPS, head_dim=HIDDEN // HEADS, rms_norm_eps=1e-5,
        max_position_embeddings=SEQ, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).float()
    with torch.no_grad():  # norms away from 1, so a wrong norm mapping shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(folder, max_shard_size="100KB")  # several shard files
    tokens, labels = batch(0)
    with torch.no_grad():
        logits = model(tokens).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return loss.item()


def _load_hf_and_step(folder: str, ckpt: str | None) -> dict:
    from shardbridge_megatron_fsdp.mcore import destroy_parallel_state, load, load_hf

    try:
        model, opt = build_sharded({"dp_shard": 2, "tp": 2}, seed=3, weights=False)
        if ckpt is None:
            report = load_hf(model, folder)
        else:
            load(ckpt, model=model, strict=True, rng=False)
            report = {}
        tokens, labels = batch(0)
        with torch.no_grad():
            loss = loss_of(model, tokens, labels).item()  # the full batch on every rank
        return {"loss": loss, **report}
    finally:
        destroy_parallel_state()


def test_import_from_pretrained_shard_on_read(tmp_path):
    hf_loss = _make_hf_folder(tmp_path / "hf")
    out = run_distributed(_load_hf_and_step, str(tmp_path / "hf"), None, world_size=4, timeout=300)
    for rank, result in enumerate(out):
        assert abs(result["loss"] - hf_loss) < 1e-5, (rank, result["loss"], hf_loss)
        # Each rank reads only the slices it holds: ~1/4 of the weights at dp2 x tp2.
        assert 0 < result["bytes_read"] < 0.35 * result["checkpoint_bytes"], (rank, result)
    # Every byte read once, the RMSNorm weights (replicated over tp=2) twice.
    norm_bytes = (2 * LAYERS + 1) * HIDDEN * 4
    assert sum(r["bytes_read"] for r in out) == out[0]["checkpoint_bytes"] + norm_bytes


def test_hf_to_megatron_checkpoint_then_load(tmp_path):
    from shardbridge.cli._main import main

    hf_loss = _make_hf_folder(tmp_path / "hf")
    argv = ["ckpt", "convert", str(tmp_path / "hf"), str(tmp_path / "mc"), "--to", "megatron",
            "--num-attention-heads", str(HEADS)]  # fmt: skip
    assert main(argv) == 0
    out = run_distributed(_load_hf_and_step, str(tmp_path / "hf"), str(tmp_path / "mc"), world_size=4, timeout=300)
    for rank, result in enumerate(out):
        assert abs(result["loss"] - hf_loss) < 1e-5, (rank, result["loss"], hf_loss)


def test_hf_to_megatron_to_hf_keeps_the_config_and_refuses_disagreeing_flags(tmp_path):
    import json

    from shardbridge.cli._main import main

    _make_hf_folder(tmp_path / "hf")
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    # A flag that disagrees with the folder's config.json is refused, not ignored.
    bad = ["ckpt", "convert", str(tmp_path / "hf"), str(tmp_path / "bad"), "--to", "megatron",
           "--num-attention-heads", str(2 * HEADS)]  # fmt: skip
    assert main(bad) == 2
    assert not (tmp_path / "bad").exists()
    assert main(["ckpt", "convert", str(tmp_path / "hf"), str(tmp_path / "mc"), "--to", "megatron"]) == 0
    assert main(["ckpt", "convert", str(tmp_path / "mc"), str(tmp_path / "back"), "--to", "hf"]) == 0
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back == source  # eps, max positions, RoPE settings: the source's own config, not defaults
    from safetensors.torch import load_file

    def tensors(folder):
        out = {}
        for f in sorted(folder.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    src, got = tensors(tmp_path / "hf"), tensors(tmp_path / "back")
    assert set(src) == set(got) and all(torch.equal(src[k], got[k]) for k in src)
