"""Checkpoints on an object store: shardbridge vs plain DCP's FsspecWriter/FsspecReader, same S3 server.

A real S3-compatible server (moto's, started here on 127.0.0.1; ``pip install "moto[server]"``),
s3fs as the client of both contenders. On 4 gloo ranks (layout A = dp_shard=2 x tp=2) a Llama with
AdamW state (the sizes of ``bench_checkpoint.py``) is saved and loaded by every contender, side by
side in one run, the order shuffled each round; medians:

- save: ``shardbridge save`` (up to ``FILES_PER_RANK`` concurrent uploads per rank), the same with
  one upload per rank, plain DCP (``get_state_dict`` + ``dcp.save(storage_writer=FsspecWriter)``,
  one file per rank, as DCP's defaults are);
- load: ``shardbridge load`` into the same layout and into dp_shard=4 (ranged GETs of the rows a
  rank needs), plain DCP (``dcp.load(storage_reader=FsspecReader)`` + ``set_state_dict``, both
  layouts).

Ratios are throughput ratios (baseline time / our time), as the ratio of the medians and as the
median of the per-round ratios ("paired"). The server runs on the same machine: what is measured
is the protocol's and the client's cost (requests, copies, concurrency), not a network.

    python tools/bench/bench_s3.py [--sizes 97MB,252MB] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_checkpoint as local  # noqa: E402 (the models, timing and shuffling of the local benchmark)


def _worker(env: dict[str, str], root: str, size: str, rounds: int):
    from shardbridge.testing._s3 import use_server

    use_server(env)
    a, b = {"dp_shard": 2, "tp": 2}, {"dp_shard": 4, "tp": 1}
    model, opt = local._build(size, a)
    model_a, opt_a = local._build(size, a)
    model_b, opt_b = local._build(size, b)
    times: dict[str, list[float]] = {}
    for r in range(rounds):
        _round(r, root, times, (model, opt), (model_a, opt_a), (model_b, opt_b))
    return {"times": times}


def _round(r, root, times, source, same, other):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from shardbridge import checkpoint
    from shardbridge._compat import dcp_fsspec_classes
    from shardbridge.checkpoint import _save

    writer_cls, reader_cls = dcp_fsspec_classes()
    (model, opt), (model_a, opt_a), (model_b, opt_b) = source, same, other
    ours, one, plain = (f"{root}/{k}-{r}" for k in ("sb", "sb1", "dcp"))

    def add(name, seconds):
        times.setdefault(name, []).append(seconds)

    def one_upload():
        before = _save.FILES_PER_RANK[True]
        _save.FILES_PER_RANK[True] = 1
        try:
            checkpoint.save(one, model=model, optimizer=opt, step=r)
        finally:
            _save.FILES_PER_RANK[True] = before

    def plain_save():
        dcp.save(local._dcp_state(model, opt), storage_writer=writer_cls(plain))

    def plain_load(m, o):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = local._dcp_state(m, o)
        dcp.load(state, storage_reader=reader_cls(plain))
        set_state_dict(m, o, model_state_dict=state["model"], optim_state_dict=state["optim"])

    saves = [
        ("save", lambda: checkpoint.save(ours, model=model, optimizer=opt, step=r)),
        ("save, one upload per rank", one_upload),
        ("dcp.save FsspecWriter", plain_save),
    ]
    for name, fn in local._rotated(saves, r):
        add(name, local._timed(fn))
    loads = [
        ("load same", lambda: checkpoint.load(ours, model=model_a, optimizer=opt_a)),
        ("load other", lambda: checkpoint.load(ours, model=model_b, optimizer=opt_b)),
        ("dcp.load FsspecReader", lambda: plain_load(model_a, opt_a)),
        ("dcp.load FsspecReader other", lambda: plain_load(model_b, opt_b)),
    ]
    for name, fn in local._rotated(loads, r):
        add(name, local._timed(fn))
    dist.barrier()
    if dist.get_rank() == 0:
        from shardbridge.checkpoint.storage._location import locate

        fs = locate(root).backend.fs
        for path in (ours, one, plain):
            fs.rm(path.removeprefix("s3://"), recursive=True)
    dist.barrier()


def _report(size: str, result: dict, rounds: int, mb: float) -> None:
    t = {k: statistics.median(v) for k, v in result["times"].items()}
    per_round = result["times"]
    print(f"\n== {size}: {local._model_config(size)}")
    print(f"checkpoint ~{mb:.0f} MB; 4 gloo ranks, dp_shard=2 x tp=2, moto S3 server on 127.0.0.1, {rounds} rounds\n")
    print(f"{'operation':<44} {'seconds':>8} {'MB/s':>8} {'vs base':>8} {'paired':>7}  base")
    rows = [
        ("plain DCP save (FsspecWriter)", "dcp.save FsspecWriter", None),
        ("shardbridge save", "save", "dcp.save FsspecWriter"),
        ("shardbridge save, one upload per rank", "save, one upload per rank", "dcp.save FsspecWriter"),
        ("plain DCP load (FsspecReader)", "dcp.load FsspecReader", None),
        ("shardbridge load, same layout", "load same", "dcp.load FsspecReader"),
        ("plain DCP load, into dp_shard=4", "dcp.load FsspecReader other", None),
        ("shardbridge load, into dp_shard=4", "load other", "dcp.load FsspecReader other"),
    ]
    for label, key, base in rows:
        sec = t[key]
        ratio = "" if base is None else f"{t[base] / sec:.2f}x"
        paired = "" if base is None else f"{local._ratio(per_round, base, key):.2f}x"
        print(f"{label:<44} {sec:>8.3f} {mb / sec:>8.1f} {ratio:>8} {paired:>7}  {base or ''}")
    print(
        f"\nreshard / same-layout load (time): shardbridge {t['load other'] / t['load same']:.2f}, plain DCP "
        f"{t['dcp.load FsspecReader other'] / t['dcp.load FsspecReader']:.2f}; concurrent uploads: "
        f"{t['save, one upload per rank'] / t['save']:.2f}x one upload per rank"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="97MB,252MB", help=f"comma-separated, of {', '.join(local.SIZES)}")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per size (medians; shuffled order)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in local.SIZES]
    if bad:
        parser.error(f"--sizes: unknown {bad}; choose from {', '.join(local.SIZES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool
    from shardbridge.testing._s3 import S3Server

    server = S3Server(timeout_s=120.0)
    pool = WorkerPool(4)
    try:
        root = server.bucket("sb-bench") + "/ckpt"
        for size in sizes:
            before = os.getloadavg()[0]
            result = pool.run(_worker, (server.client_env(), root, size, args.rounds), {}, timeout=3600)[0]
            _report(size, result, args.rounds, {"97MB": 97.0, "252MB": 252.0, "1GB": 957.0}[size])
            load = (before, os.getloadavg()[0])
            print(f"machine load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores")
    finally:
        pool.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
