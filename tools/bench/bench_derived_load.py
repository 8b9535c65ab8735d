"""A load that derives its storage records vs one that broadcasts ``.metadata``, paired, on real processes.

Both loads read the same checkpoint into the same model; the only difference is where the
storage records come from: every rank derives them from the manifest's ``layout.derived``
([Note: derived loads] in ``checkpoint/_derived.py``; the default), or rank 0 reads
``.metadata`` with the restricted reader and broadcasts it (what a checkpoint without
``layout.derived`` gets; forced here by making ``derive_load`` find nothing). The order
alternates each round; the first round is a warm-up.

    OMP_NUM_THREADS=1 python tools/bench/bench_derived_load.py                 # 4 and 8 gloo processes
    OMP_NUM_THREADS=1 python tools/bench/bench_derived_load.py --worlds 4 --rounds 4

At scale (thousands of ranks) the difference is the whole point, and it is measured by
``bench_scale.py``; this measures what the derivation costs where ``.metadata`` is small.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shardbridge.testing import run_distributed  # noqa: E402


def _worker(root: str, size: str, rounds: int) -> dict[str, list[tuple[float, float]]]:
    import bench_checkpoint as local
    import torch.distributed as dist
    from shardbridge import checkpoint
    from shardbridge.checkpoint import _load

    layout = {"dp_shard": dist.get_world_size() // 2, "tp": 2}
    model, opt = local._build(size, layout)
    model_b, opt_b = local._build(size, layout)
    path = checkpoint.save(f"{root}/ckpt", model=model, optimizer=opt, step=1)
    real = _load.derive_load
    times: dict[str, list[tuple[float, float]]] = {"derived": [], "broadcast": []}
    try:
        for r in range(rounds + 1):
            for name in ("derived", "broadcast") if r % 2 else ("broadcast", "derived"):
                _load.derive_load = real if name == "derived" else (lambda *args: None)
                dist.barrier()
                wall, cpu = time.perf_counter(), time.process_time()
                checkpoint.load(path, model=model_b, optimizer=opt_b)
                dist.barrier()
                if r:
                    times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    finally:
        _load.derive_load = real
    return times


def main(argv: list[str] | None = None) -> int:
    """Print the paired table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--worlds", default="4,8", help="comma list of gloo process counts (even)")
    parser.add_argument("--size", default="8MB", help="a bench_checkpoint.py model size")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    print("| world | derived s | broadcast s | derived / broadcast | CPU s/rank (derived / broadcast) |")
    print("|-------|-----------|-------------|---------------------|----------------------------------|")
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            res: list[Any] = run_distributed(_worker, tmp, args.size, args.rounds, world_size=world)
        wall = {n: statistics.median(t[0] for t in res[0][n]) for n in ("derived", "broadcast")}
        # per round, the busiest rank's CPU time; then the median over rounds
        cpu = {n: statistics.median(max(r[n][i][1] for r in res) for i in range(args.rounds)) for n in wall}
        print(f"| {world} | {wall['derived']:.3f} | {wall['broadcast']:.3f} | {wall['derived'] / wall['broadcast']:.2f}x "
              f"| {cpu['derived']:.3f} / {cpu['broadcast']:.3f} |")  # fmt: skip
    print(f"model {args.size}, dp_shard x tp = world/2 x 2, {args.rounds} rounds (medians), order alternating")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
