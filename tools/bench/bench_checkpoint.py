"""Checkpoint throughput: shardbridge.checkpoint vs torch.save/torch.load of the same bytes.

On 4 gloo ranks (layout A = dp_shard=2 x tp=2) a model with AdamW state is saved with
``shardbridge.checkpoint.save`` and, as the baseline, every rank ``torch.save``s exactly its own
local shards (model + optimizer) to the same disk. Then the checkpoint is loaded back into the
same layout, and into a different one (dp_shard=4), against ``torch.load`` of the per-rank files.
Plain torch DCP (get_state_dict + dcp.save / dcp.load + set_state_dict) runs alongside, so
the table separates DCP's own cost from shardbridge's. Rounds alternate between the
contenders; the table shows medians and ratios (1.00 = as fast as torch.save / torch.load).
Verification ([Note: checkpoint integrity]) is timed on its own too: the checksums of every
file split over the 4 ranks (what ``load(verify=True)`` adds), the same in one process
(``checkpoint.verify``), and a load with ``verify=False``; all with the page cache warm.

    python tools/bench/bench_checkpoint.py [--rounds 3] [--dir /tmp/sb-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch.distributed.checkpoint as dcp


def _model_config():
    from shardbridge.models import LlamaConfig

    return LlamaConfig.tiny(vocab_size=8192, dim=512, num_layers=4, num_heads=8, num_kv_heads=4, intermediate_size=1536)


def _build(layout):
    import torch
    from shardbridge import ParallelDims
    from shardbridge.models import Llama, parallelize_llama, synthetic_batch

    pm = ParallelDims(**layout).build_mesh("cpu")
    model = parallelize_llama(Llama(_model_config(), seed=0), pm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, labels = synthetic_batch(
        model.config, 4, 16, dp_rank=pm["dp"].get_local_rank(), dp_size=pm.dims.degree("dp")
    )
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), labels.flatten()).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _local_state(model, opt):
    """Exactly the bytes this rank holds: local shards of params and optimizer states."""
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    state = {f"model.{k}": local(p.detach()) for k, p in model.named_parameters()}
    names = {p: k for k, p in model.named_parameters()}
    for p, s in opt.state.items():
        for key, value in s.items():
            state[f"optim.{names[p]}.{key}"] = local(value)
    return state


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _dcp_load(model, opt, path):
    """Plain torch DCP, the way its docs show it: get_state_dict, dcp.load, set_state_dict."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _timed(fn):
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(root: str, rounds: int):
    import torch
    import torch.distributed as dist
    from shardbridge import checkpoint

    rank = dist.get_rank()
    a = {"dp_shard": 2, "tp": 2}
    b = {"dp_shard": 4, "tp": 1}
    model, opt = _build(a)
    model_a, opt_a = _build(a)
    model_b, opt_b = _build(b)
    names = ("save", "torch.save", "dcp.save", "load same", "load other", "torch.load", "dcp.load")
    names += ("load same, verify=False", "verify, 4 ranks", "verify, 1 process")
    times = {k: [] for k in names}
    sizes = {}
    for r in range(rounds):
        ckpt = os.path.join(root, f"sb-{r}")
        raw = os.path.join(root, f"raw-{r}")
        os.makedirs(raw, exist_ok=True)
        local = _local_state(model, opt)
        raw_file = os.path.join(raw, f"rank{rank}.pt")
        dcp_dir = os.path.join(root, f"dcp-{r}")
        contenders = [
            ("save", lambda ckpt=ckpt, r=r: checkpoint.save(ckpt, model=model, optimizer=opt, step=r)),
            ("torch.save", lambda local=local, raw_file=raw_file: torch.save(local, raw_file)),
            ("dcp.save", lambda dcp_dir=dcp_dir: dcp.save(_dcp_state(model, opt), checkpoint_id=dcp_dir)),
        ]
        for name, fn in contenders if r % 2 == 0 else reversed(contenders):
            times[name].append(_timed(fn))
        loads = [
            ("load same", lambda ckpt=ckpt: checkpoint.load(ckpt, model=model_a, optimizer=opt_a)),
            ("load other", lambda ckpt=ckpt: checkpoint.load(ckpt, model=model_b, optimizer=opt_b)),
            ("torch.load", lambda raw_file=raw_file: torch.load(raw_file, weights_only=True)),
            ("dcp.load", lambda dcp_dir=dcp_dir: _dcp_load(model_a, opt_a, dcp_dir)),
            (
                "load same, verify=False",
                lambda ckpt=ckpt: checkpoint.load(ckpt, model=model_a, optimizer=opt_a, verify=False),
            ),
            ("verify, 4 ranks", lambda ckpt=ckpt: _verify_all_ranks(ckpt)),
            ("verify, 1 process", lambda ckpt=ckpt: rank == 0 and checkpoint.verify(ckpt).ok),
        ]
        for name, fn in loads if r % 2 == 0 else reversed(loads):
            times[name].append(_timed(fn))
        if rank == 0:
            sizes = {"checkpoint": _dir_bytes(ckpt), "torch.save": _dir_bytes(raw)}
        dist.barrier()
        if rank == 0:
            for path in (ckpt, raw, dcp_dir):
                shutil.rmtree(path)
        dist.barrier()
    return {"times": times, "sizes": sizes}


def _verify_all_ranks(path):
    from pathlib import Path

    from shardbridge.checkpoint._integrity import verify_on_all_ranks
    from shardbridge.checkpoint._manifest import read_manifest

    assert not verify_on_all_ranks(Path(path), read_manifest(path), checksums=True)


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool

    root = args.dir or tempfile.mkdtemp(prefix="sb-bench-ckpt-")
    os.makedirs(root, exist_ok=True)
    pool = WorkerPool(4)
    try:
        result = pool.run(_worker, (root, args.rounds), {}, timeout=3600)[0]
    finally:
        pool.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    t = {k: statistics.median(v) for k, v in result["times"].items()}
    size = result["sizes"]["checkpoint"]
    mb = size / 1e6
    print(f"model {_model_config()}\n4 gloo ranks, layout A = dp_shard=2 x tp=2, {args.rounds} rounds, medians\n")
    print(f"checkpoint {mb:.1f} MB on disk; torch.save files {result['sizes']['torch.save'] / 1e6:.1f} MB\n")
    print(f"{'operation':<36} {'seconds':>8} {'MB/s':>8} {'ratio':>7}")
    rows = [
        ("torch.save (per-rank local shards)", t["torch.save"], None),
        ("torch DCP save (get_state_dict)", t["dcp.save"], t["dcp.save"] / t["torch.save"]),
        ("shardbridge save", t["save"], t["save"] / t["torch.save"]),
        ("torch.load (per-rank local shards)", t["torch.load"], None),
        ("torch DCP load (+set_state_dict)", t["dcp.load"], t["dcp.load"] / t["torch.load"]),
        ("shardbridge load, same layout", t["load same"], t["load same"] / t["torch.load"]),
        ("shardbridge load, dp_shard=4", t["load other"], t["load other"] / t["torch.load"]),
    ]
    for name, sec, ratio in rows:
        print(f"{name:<36} {sec:>8.3f} {mb / sec:>8.1f} {'' if ratio is None else f'{ratio:.2f}':>7}")
    rows = [
        ("shardbridge load, verify=False", t["load same, verify=False"], t["load same, verify=False"] / t["torch.load"]),
        ("verify checksums, split on 4 ranks", t["verify, 4 ranks"], None),
        ("checkpoint.verify, one process", t["verify, 1 process"], None),
    ]
    for name, sec, ratio in rows:
        print(f"{name:<36} {sec:>8.3f} {mb / sec:>8.1f} {'' if ratio is None else f'{ratio:.2f}':>7}")
    print(f"\nshardbridge / torch DCP: save {t['save'] / t['dcp.save']:.2f}, load {t['load same'] / t['dcp.load']:.2f}")
    print(
        f"verification (4 ranks) / load (verify=True, same layout): {t['verify, 4 ranks'] / t['load same']:.1%}; "
        f"load verify=True / verify=False: {t['load same'] / t['load same, verify=False']:.2f}"
    )
    print(f"load into a different layout / same layout: {t['load other'] / t['load same']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
