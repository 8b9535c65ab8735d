"""Export peak memory vs the size of the largest tensor.

Saves a checkpoint of a model whose largest tensor is known (the embedding / output matrices
dominate), then runs ``shardbridge.checkpoint.export_safetensors`` in a FRESH process and
reports that process's peak RSS growth during the export (``ru_maxrss`` after - before, torch
already imported) next to the largest tensor and the whole checkpoint. A streaming export
keeps the ratio to the largest tensor small and independent of the model size.

    python tools/bench/bench_export.py [--vocab-size 32000] [--dim 1024] [--layers 4]
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
import json, resource, sys, time
import torch
from shardbridge import checkpoint
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
checkpoint.export_safetensors(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], progress=False)
seconds = time.perf_counter() - start
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"peak_growth": (after - before) * 1024, "seconds": seconds}))
"""


def _save(path: str, vocab: int, dim: int, layers: int) -> None:
    from shardbridge import checkpoint
    from shardbridge.models import Llama, LlamaConfig

    cfg = LlamaConfig.tiny(
        vocab_size=vocab, dim=dim, num_layers=layers, num_heads=8, num_kv_heads=4, intermediate_size=dim * 2
    )
    checkpoint.save(path, model=Llama(cfg, seed=0))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab-size", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--max-shard-size", default="200MB")
    args = parser.parse_args(argv)

    from shardbridge import checkpoint

    root = tempfile.mkdtemp(prefix="sb-bench-export-")
    try:
        ckpt = os.path.join(root, "ckpt")
        # Save in a child process too, so this process never holds the model.
        subprocess.run(
            [
                sys.executable,
                "-c",
                f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                f"import bench_export as b; b._save({ckpt!r}, {args.vocab_size}, {args.dim}, {args.layers})",
            ],
            check=True,
        )
        info = checkpoint.inspect(ckpt)
        largest = max(t.nbytes for t in info.tensors if t.name.startswith("model."))
        total = info.model_bytes
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, ckpt, os.path.join(root, "hf"), args.max_shard_size],
            check=True,
            capture_output=True,
            text=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    peak = result["peak_growth"]
    print(f"model: vocab {args.vocab_size}, dim {args.dim}, {args.layers} layers; max shard {args.max_shard_size}\n")
    print(f"{'quantity':<34} {'MB':>9} {'ratio to largest':>17}")
    for name, value in (("largest tensor", largest), ("whole model", total), ("export peak RSS growth", peak)):
        print(f"{name:<34} {value / 1e6:>9.1f} {value / largest:>17.2f}")
    print(f"\nexport time {result['seconds']:.2f} s ({total / 1e6 / result['seconds']:.0f} MB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
