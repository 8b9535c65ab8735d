"""Export peak memory vs the size of the largest tensor, for checkpoints saved by 1 and 4 ranks.

Saves a checkpoint of a model whose largest tensor is known (the embedding / output matrices
dominate) in one process, and on 4 gloo ranks (dp_shard=2 x tp=2: every tensor stored as
several boxes), then runs ``shardbridge.checkpoint.export_safetensors`` in a FRESH process
and reports that process's peak RSS growth during the export: the kernel's peak (``VmHWM``) reset to
the resident memory just before the call (``/proc/self/clear_refs``), torch and shardbridge already
imported. Not ``ru_maxrss``: it counts from the import-time peak (which hides what the export reuses
of memory freed after the imports) and Linux carries it across ``exec`` from the forking parent
(a large parent makes it the parent's size). next to the largest tensor and the whole model. The
target of issue 14: growth <= 1.1x the largest tensor + a few MB, whatever the model size.

    python tools/bench/bench_export.py [--vocab-size 32000] [--dim 1024] [--layers 4] [--saved-by 1,4]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

_CHILD = r"""
import json, sys, time
import torch
import tqdm.auto, xxhash, safetensors  # imported by the export: not counted as its memory

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

from shardbridge import checkpoint
with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) starts again from what is resident now
    f.write("5")
before = status("VmRSS")
start = time.perf_counter()
checkpoint.export_safetensors(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], progress=False)
seconds = time.perf_counter() - start
print(json.dumps({"peak_growth": status("VmHWM") - before, "seconds": seconds}))
"""


def _config(vocab: int, dim: int, layers: int):
    from shardbridge.models import LlamaConfig

    return LlamaConfig.tiny(
        vocab_size=vocab, dim=dim, num_layers=layers, num_heads=8, num_kv_heads=4, intermediate_size=dim * 2
    )


def _save(path: str, vocab: int, dim: int, layers: int) -> None:
    from shardbridge import checkpoint
    from shardbridge.models import Llama

    checkpoint.save(path, model=Llama(_config(vocab, dim, layers), seed=0))


def _save_4_ranks(path: str, vocab: int, dim: int, layers: int) -> None:
    from shardbridge import ParallelDims, checkpoint
    from shardbridge.models import Llama, parallelize_llama

    pm = ParallelDims(dp_shard=2, tp=2).build_mesh("cpu")
    checkpoint.save(path, model=parallelize_llama(Llama(_config(vocab, dim, layers), seed=0), pm))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-shard-size", default="200MB")
    parser.add_argument("--saved-by", default="1,4", help="ranks that save the checkpoint: 1, 4 or 1,4")
    args = parser.parse_args(argv)
    ranks = [int(r) for r in args.saved_by.split(",") if r.strip()]
    if not ranks or set(ranks) - {1, 4}:
        parser.error(f"--saved-by {args.saved_by!r}: use 1, 4 or 1,4")

    from shardbridge import checkpoint

    print(f"model: vocab {args.vocab_size}, dim {args.dim}, {args.layers} layers; max shard {args.max_shard_size}")
    root = tempfile.mkdtemp(prefix="sb-bench-export-")
    try:
        for world in ranks:
            ckpt = os.path.join(root, f"ckpt-{world}")
            _save_checkpoint(ckpt, world, args)
            info = checkpoint.inspect(ckpt)
            model_tensors = [t for t in info.tensors if t.name.startswith("model.")]
            largest = max(t.nbytes for t in model_tensors)
            boxes = max(t.num_chunks for t in model_tensors)
            out = subprocess.run(
                [sys.executable, "-c", _CHILD, ckpt, os.path.join(root, f"hf-{world}"), args.max_shard_size],
                check=True,
                capture_output=True,
                text=True,
            )
            result = json.loads(out.stdout.strip().splitlines()[-1])
            _report(world, boxes, largest, info.model_bytes, result)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


def _save_checkpoint(ckpt: str, world: int, args) -> None:
    """Save in other processes, so this one never holds the model."""
    if world == 1:
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                f"import bench_export as b; b._save({ckpt!r}, {args.vocab_size}, {args.dim}, {args.layers})",
            ],
            check=True,
        )
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool

    pool = WorkerPool(world)
    try:
        pool.run(_save_4_ranks, (ckpt, args.vocab_size, args.dim, args.layers), {}, timeout=1800)
    finally:
        pool.close()


def _report(world: int, boxes: int, largest: int, total: int, result: dict) -> None:
    peak = result["peak_growth"]
    print(f"\nsaved by {world} rank(s) (up to {boxes} stored boxes per tensor)")
    print(f"{'quantity':<34} {'MB':>9} {'ratio to largest':>17}")
    for name, value in (("largest tensor", largest), ("whole model", total), ("export peak RSS growth", peak)):
        print(f"{name:<34} {value / 1e6:>9.1f} {value / largest:>17.2f}")
    print(f"export time {result['seconds']:.2f} s ({total / 1e6 / result['seconds']:.0f} MB/s)")


if __name__ == "__main__":
    sys.exit(main())
