"""GPU tier for shardbridge_te (NOT run in CI; needs a GPU and TransformerEngine 2.x).

torchrun --nproc-per-node 4 examples/te/gpu_tier.py --recipe {none,current,delayed}
torchrun --nproc-per-node 4 examples/te/gpu_tier.py --backend gloo   # 4 ranks sharing ONE GPU

NCCL cannot put two ranks on one GPU; with ``--backend gloo`` the ranks share ``cuda:0`` (rank
i uses device ``i % device_count``) and gloo moves the bytes, so a single-GPU machine runs
the same dp2 x tp2 layout.

Builds TransformerLayers on meta (FP8 parameters with --recipe current/delayed), runs
shardbridge_te.parallelize at dp2 x tp2, trains 3 steps, saves a checkpoint, loads it at tp4 and
into a non-FP8 model, and prints the max difference of full parameters; exits non-zero when a
non-FP8 target differs at all or an FP8 target by more than one E4M3 step of the largest value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from datetime import timedelta

import shardbridge.checkpoint as ckpt
import shardbridge_te
import torch
import torch.distributed as dist
import transformer_engine.pytorch as te
from shardbridge import ParallelDims, PrecisionPolicy
from torch.distributed.tensor import DTensor
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling

HIDDEN, FFN, HEADS, LAYERS = 256, 1024, 8, 2


def build(tp: int, recipe) -> torch.nn.Module:
    ctx = te.quantized_model_init(enabled=True, recipe=recipe) if recipe is not None else contextlib.nullcontext()
    with torch.device("meta"), ctx:
        return torch.nn.Sequential(
            *[
                te.TransformerLayer(
                    HIDDEN, FFN, HEADS, tp_size=tp, set_parallel_mode=tp > 1, params_dtype=torch.float32
                )
                for _ in range(LAYERS)
            ]
        )


def full(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[k] = (v.dequantize() if hasattr(v, "dequantize") else v).float().cpu()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", choices=["none", "current", "delayed"], default="none")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="process-group timeout: a collective some rank never reaches fails after this long instead of "
        "hanging (default 600; docs/troubleshooting.md)",
    )
    args = parser.parse_args()
    if not args.collective_timeout > 0:
        parser.error(f"--collective-timeout={args.collective_timeout} must be > 0 seconds")
    dist.init_process_group(args.backend, timeout=timedelta(seconds=args.collective_timeout))
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
    recipe = {"none": None, "current": Float8CurrentScaling(), "delayed": DelayedScaling()}[args.recipe]
    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cuda")
    model = build(2, recipe)
    shardbridge_te.parallelize(model, pm, PrecisionPolicy.fp32())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(0)
    for _ in range(3):
        x = torch.randn(16, 2, HIDDEN, device="cuda")
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    if dist.get_rank() == 0:
        print(f"loss after 3 steps: {loss.item():.6f}")
    path = os.path.join(tempfile.gettempdir(), f"sb-te-gpu-{args.recipe}")
    ckpt.save(path, model=model, step=3, overwrite=True)
    ref = full(model)
    failures = []
    for dims, rec in (({"dp_shard": 1, "tp": 4}, recipe), ({"dp_shard": 4}, None)):
        pm2 = ParallelDims(**dims).build_mesh("cuda")
        other = build(pm2.dims.tp, rec)
        shardbridge_te.parallelize(other, pm2, PrecisionPolicy.fp32())
        ckpt.load(path, model=other)
        got = full(other)
        # gelu MLP: fc1 is not fused, so every full tensor is comparable across TP degrees
        diff = max((ref[k] - got[k]).abs().max().item() for k in ref)
        scale = max(ref[k].abs().max().item() for k in ref)
        # a plain target holds exactly the saved (dequantized) values; an FP8 target re-quantizes:
        # allow one E4M3 step (2^-3 relative) of the largest value
        tol = 0.0 if rec is None else scale * 2.0**-3
        if dist.get_rank() == 0:
            print(f"load at {dims} (fp8={rec is not None}): max |diff| = {diff:.3e} (tolerance {tol:.3e})")
        if diff > tol:
            failures.append(dims)
    dist.destroy_process_group()
    if failures:
        raise SystemExit(f"GPU tier FAILED: checkpoint loaded at {failures} differs beyond tolerance")


if __name__ == "__main__":
    main()
