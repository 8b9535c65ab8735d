"""A tiny causal-LM training script: Accelerate's API, shardbridge's FSDP2 x TP underneath.

The only shardbridge-specific lines are the import and the accelerator class. Launch::

    shardbridge launch --config_file examples/hf/cpu_fsdp2_tp2.yaml examples/hf/train.py --steps 8

Options cover what the integration tests need: save checkpoints, resume from one, export the
last one to a Hugging Face folder, and write a JSON report (losses, logits on a fixed batch).
The model is built from a config in code (no hub download); the data is synthetic and
learnable (each token determines the next), so the loss falls within a few steps.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.utils import InitProcessGroupKwargs, gather_object
from shardbridge_hf import ShardbridgeAccelerator as Accelerator  # <- the one changed line
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoConfig, AutoModelForCausalLM

ARCHS = {
    # hidden 64, 2 layers, 8 heads / 4 kv heads (tp up to 4), intermediate 128 (fp8: multiples of 16)
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),  # q/k/v biases
    "mistral": dict(model_type="mistral"),
}


def tiny_config(arch: str, hidden_size: int = 64):
    return AutoConfig.for_model(
        **ARCHS[arch],
        vocab_size=256,
        hidden_size=hidden_size,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def synthetic_tokens(num_sequences: int, seq_len: int, vocab: int, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (num_sequences, 1), generator=gen)
    steps = torch.arange(seq_len).unsqueeze(0)
    return (start * 5 + steps * 3) % vocab  # next token is a function of this one: learnable


def where_am_i(accelerator) -> dict:
    """This rank's global rank, machine (working directory, host) and the global ranks of its groups."""
    pm = accelerator.parallel_mesh
    groups = {axis: dist.get_process_group_ranks(pm[axis].get_group()) for axis in ("dp_replicate", "dp_shard", "tp")}
    return {"rank": dist.get_rank(), "cwd": os.getcwd(), "host": socket.gethostname(), "groups": groups}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument(
        "--hidden-size",
        type=int,
        default=64,
        help="model width (torchao mxfp8 at tp 2 needs 128: TP-local dims multiples of 32)",
    )
    p.add_argument("--batch-size", type=int, default=2, help="per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="clip gradients to this total norm (0 = off)")
    p.add_argument("--save-every", type=int, default=0, help="save a checkpoint every N steps (0 = never)")
    p.add_argument("--ckpt-root", default=None)
    p.add_argument("--resume", default=None, help="checkpoint directory to resume from")
    p.add_argument("--export", default=None, help="export the last checkpoint to this Hugging Face folder")
    p.add_argument(
        "--report", default=None, help="write losses, logits and every rank's groups (JSON + .pt) here, from rank 0"
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="process-group timeout: a collective some rank never reaches fails after this long instead of "
        "hanging (default 600; docs/troubleshooting.md)",
    )
    args = p.parse_args()
    if not args.collective_timeout > 0:
        p.error(f"--collective-timeout={args.collective_timeout} must be > 0 seconds")

    timeout = InitProcessGroupKwargs(timeout=timedelta(seconds=args.collective_timeout))
    accelerator = Accelerator(kwargs_handlers=[timeout])
    torch.manual_seed(0)  # same init everywhere (rank 0's weights are broadcast anyway)
    cfg = tiny_config(args.arch, args.hidden_size)
    model = AutoModelForCausalLM.from_config(cfg)  # FP8 (the yaml's fp8 block): converted in prepare()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    dp = accelerator.parallel_mesh.dims.degree("dp")
    data = synthetic_tokens(args.steps * args.batch_size * dp, args.seq_len, cfg.vocab_size)
    loader = DataLoader(TensorDataset(data), batch_size=args.batch_size, shuffle=False)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    start = 0
    if args.resume:
        start = accelerator.load_state(args.resume)
    losses: dict[int, float] = {}
    last_ckpt = args.resume
    batches = accelerator.skip_first_batches(loader, start) if start else loader
    for step, (ids,) in enumerate(batches, start=start + 1):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        if args.max_grad_norm:  # parameters on the TP and FSDP meshes: see docs/hf.md
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses[step] = accelerator.reduce_loss(loss).item()
        norm_text = f" grad_norm {grad_norm.item():.4f}" if args.max_grad_norm else ""
        accelerator.print(f"step {step} loss {losses[step]:.6f}{norm_text}")
        if args.save_every and step % args.save_every == 0:
            last_ckpt = accelerator.save_state(str(Path(args.ckpt_root) / f"step-{step:08d}"))

    if args.export and last_ckpt:
        accelerator.export_pretrained(last_ckpt, args.export)
    probe = synthetic_tokens(2, args.seq_len, cfg.vocab_size, seed=99)
    with torch.no_grad():
        logits = model(input_ids=probe).logits.float()
    if args.report:  # every rank's place: its machine (working directory, host) and its groups' ranks
        ranks = gather_object([where_am_i(accelerator)])
    if args.report and accelerator.is_main_process:
        Path(args.report).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"logits": logits, "probe": probe}, args.report + ".pt")
        Path(args.report).write_text(
            json.dumps(
                {"losses": losses, "last_ckpt": last_ckpt, "dims": str(accelerator.parallel_mesh.dims), "ranks": ranks}
            )
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


if __name__ == "__main__":
    main()
