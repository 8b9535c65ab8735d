"""A checkpoint saved under one torch loads bit-exact under another (run by ``nox -s torch_cross``).

    python tools/torch_cross.py save DIR    # 4 gloo ranks, dp_shard=2 x tp=2: 2 AdamW steps, save DIR/ckpt
    python tools/torch_cross.py check DIR   # 4 gloo ranks, dp_shard=4: load DIR/ckpt, compare bit-exact

``save`` also writes what the saving ranks held, gathered to full plain tensors (``DIR/want.pt``:
model weights and every AdamW state, ``torch.save`` of plain tensors, read back with
``weights_only=True``). ``check`` loads the checkpoint into a freshly initialised model and
optimizer of another layout, gathers the same, and compares every tensor with ``torch.equal``.
Run ``save`` in one torch's environment and ``check`` in another's (both directions): docs/testing.md,
"torch versions", has the last run. A checkpoint saved by torch >= 2.15 loads under an older torch
too: its ``.metadata`` holds a field (``TensorProperties.strides``) the older DCP cannot read, which
shardbridge's reader drops there; ``check`` fails on any refusal.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Model and AdamW state as full plain tensors, fused parameters split into their components (a
    fused tensor's item order depends on the TP degree): ``model.<fqn>`` / ``optim.<fqn>.<state>``."""
    from shardbridge.fused import fused_params, split_fused
    from torch.distributed.tensor import DTensor, Shard

    fused = fused_params(model)

    def tp_size(t: torch.Tensor) -> int:
        if not isinstance(t, DTensor) or t.device_mesh.mesh_dim_names is None:
            return 1
        sizes = zip(t.device_mesh.mesh_dim_names, t.device_mesh.shape, t.placements)
        return max([s for n, s, p in sizes if n == "tp" and type(p) is Shard] or [1])

    out: dict[str, torch.Tensor] = {}
    for fqn, param in model.named_parameters():
        values = {"model": param, **{f"optim.{k}": v for k, v in opt.state.get(param, {}).items()}}
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                continue
            full = (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu().clone()
            spec = fused.get(fqn)
            if spec is not None and full.shape == param.shape:
                for name, part in split_fused(full, spec, tp_size(param)).items():
                    out[f"{key}.{fqn}[{name}]"] = part.clone()
            else:
                out[f"{key}.{fqn}"] = full
    return out


def _build(layout: dict[str, int], seed: int):
    from shardbridge import ParallelDims
    from shardbridge.models import Llama, LlamaConfig, parallelize_llama

    torch.manual_seed(seed)
    model = Llama(LlamaConfig.tiny())
    mesh = ParallelDims(**layout).build_mesh("cpu")
    parallelize_llama(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh


def _save(root: str) -> int:
    import torch.distributed as dist
    from shardbridge import checkpoint
    from shardbridge.models import synthetic_batch

    model, opt, _ = _build({"dp_shard": 2, "tp": 2}, seed=1)
    for step in range(2):
        tokens, labels = synthetic_batch(model.config, 2, 16, step=step)
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save(os.path.join(root, "ckpt"), model=model, optimizer=opt, step=2)
    want = _full_state(model, opt)
    if dist.get_rank() == 0:
        torch.save(want, os.path.join(root, "want.pt"))
    return len(want)


def _check(root: str) -> tuple[int, list[str]] | str:
    """The tensors that differ, or the error of a load refused by name."""
    from shardbridge import checkpoint

    model, opt, _ = _build({"dp_shard": 4}, seed=7)
    try:
        checkpoint.load(os.path.join(root, "ckpt"), model=model, optimizer=opt)
    except ValueError as err:
        return str(err)
    got = _full_state(model, opt)
    want = torch.load(os.path.join(root, "want.pt"), weights_only=True)
    wrong = sorted(k for k in want if k not in got or not torch.equal(got[k], want[k]))
    wrong += sorted(f"{k} (not in the checkpoint's state)" for k in got if k not in want)
    return len(want), wrong


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("verb", choices=("save", "check"))
    parser.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    from shardbridge.testing import run_distributed

    args.dir.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__}: {args.verb} {args.dir}", flush=True)
    if args.verb == "save":
        count = run_distributed(_save, str(args.dir), world_size=4)[0]
        print(f"saved {count} tensors (dp_shard=2 x tp=2)")
        return 0
    result = run_distributed(_check, str(args.dir), world_size=4)[0]
    if isinstance(result, str):
        # torch 2.15 pickles TensorProperties with a sixth field (`strides`) that older torches'
        # classes cannot take (their own DCP fails on it); shardbridge's reader drops it there.
        print(f"refused: {result}")
        return 1
    count, wrong = result
    if wrong:
        print(f"{len(wrong)} of {count} tensors differ after loading into dp_shard=4: {', '.join(wrong[:5])}")
        return 1
    print(f"all {count} tensors bit-exact after loading into dp_shard=4")
    return 0


if __name__ == "__main__":
    sys.exit(main())
