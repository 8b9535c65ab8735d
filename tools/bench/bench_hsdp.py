"""Storage bytes an HSDP load reads: each stored byte once, whatever dp_replicate ([Note: reading once
under replication] in ``checkpoint/_load.py``).

On 4 gloo ranks, for dp_replicate x dp_shard = 1 x 4, 2 x 2 and 4 x 1 (R = 1, 2, 4), a Llama with
AdamW state (the sizes of ``bench_checkpoint.py``) is saved in that layout and loaded back into it
(a resume), ``verify=True``, after one untimed load, two ways in each round, the order alternating:

- ``read once``: ``shardbridge load`` as it is: the ranks at dp_replicate coordinate 0 read, and
  send what they read to their replicas over the dp_replicate group;
- ``every rank reads``: the same load with the read-once plan switched off (``_load._replicas``
  answering None, as for a state that is not replicated), as every load read before.

The bytes are measured: every byte any rank reads from a checkpoint file through the backend's read
functions (``shardbridge.testing._reads.counted_reads``), summed over the 4 ranks, against the
checkpoint's size (every file in it, the manifest, ``.metadata`` and the RNG files included). With
``--s3`` the checkpoints live on a moto S3 server on 127.0.0.1 and each row also shows the HTTP
requests the server logged during the load (all ranks); ``--remote-gap 0`` fetches only the bytes
wanted (``_reader.REMOTE_GAP``: by default wanted ranges of a file less than 4 MB apart are one
request, the gap read and dropped). Seconds: the median over the rounds.

``--saved-as 1`` saves every checkpoint at 1 x 4 (FSDP) instead, each then loaded into another layout.

    python tools/bench/bench_hsdp.py [--size 97MB] [--rounds 4] [--s3 [--remote-gap 0]] [--saved-as 1]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_checkpoint as local  # noqa: E402 (the models and timing of the local benchmark)

_RANKS = 4


@contextlib.contextmanager
def _every_rank_reads():
    from shardbridge.checkpoint import _load

    real = _load._replicas
    _load._replicas = lambda *args: None
    try:
        yield
    finally:
        _load._replicas = real


def _worker(
    root: str, size: str, rounds: int, env: dict[str, str] | None, log: str | None, gap: int | None, saved_as: int | None
):
    import torch.distributed as dist
    from shardbridge import checkpoint
    from shardbridge.checkpoint.storage import _reader
    from shardbridge.testing._reads import counted_reads

    if gap is not None:  # --remote-gap: what the object-store reads trade between bytes and requests
        _reader.REMOTE_GAP = gap

    if env is not None:
        from shardbridge.checkpoint.storage._fsspec import FsspecBackend as backend
        from shardbridge.testing._s3 import served, use_server

        use_server(env)
    else:
        from shardbridge.checkpoint.storage._local import LocalBackend as backend
    out = {}
    for replicate in (1, 2, 4):
        layout = {"dp_replicate": replicate, "dp_shard": _RANKS // replicate}
        model, opt = local._build(size, layout)
        if saved_as is not None:  # --saved-as: saved from dp_replicate x dp_shard = saved_as x (4 / saved_as)
            source = local._build(size, {"dp_replicate": saved_as, "dp_shard": _RANKS // saved_as})
        path = f"{root}/r{replicate}"
        saving = (model, opt) if saved_as is None else source
        checkpoint.save(path, model=saving[0], optimizer=saving[1], step=1)
        checkpoint.load(path, model=model, optimizer=opt)  # untimed: the first load after a save is slower
        row = {"seconds": {}, "bytes": {}, "requests": {}}
        for r in range(rounds):
            ways = [("read once", contextlib.nullcontext), ("every rank reads", _every_rank_reads)]
            for name, way in ways if r % 2 == 0 else ways[::-1]:
                before = len(served(log)) if log is not None else 0
                load = functools.partial(checkpoint.load, path, model=model, optimizer=opt)
                with way(), counted_reads(backend) as reads:
                    seconds = local._timed(load)
                sent = (len(served(log)) - before) if log is not None else 0
                got = [None] * _RANKS
                dist.all_gather_object(got, sum(reads.values()))
                row["seconds"].setdefault(name, []).append(float(seconds))
                row["bytes"][name] = sum(got)
                row["requests"].setdefault(name, []).append(sent)
        if dist.get_rank() == 0:
            if env is not None:
                from shardbridge.checkpoint.storage._location import locate

                fs = locate(path).backend.fs
                row["size"] = sum(fs.du(path.removeprefix("s3://"), total=False).values())
                fs.rm(path.removeprefix("s3://"), recursive=True)
            else:
                row["size"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        out[f"{replicate}x{_RANKS // replicate}"] = row
        dist.barrier()
    return out


def _report(size: str, result: dict, rounds: int, s3: bool, gap: int | None, saved_as: int | None) -> None:
    print(f"\n== {size}: {local._model_config(size)}")
    where = f"moto S3 server on 127.0.0.1{'' if gap is None else f', REMOTE_GAP={gap}'}" if s3 else "local disk"
    print(f"4 gloo ranks, {where}, verify=True, {'saved and loaded in each layout' if saved_as is None else f'saved at {saved_as} x {_RANKS // saved_as}'}, {rounds} rounds (median seconds)\n")
    head = f"{'R x dp_shard':<13} {'ckpt MB':>8} {'way':<17} {'read MB':>8} {'read/ckpt':>9} {'seconds':>8}"
    print(head + (f" {'requests':>8}" if s3 else ""))
    for layout, row in result.items():
        mb = row["size"] / 1e6
        for name in ("read once", "every rank reads"):
            read = row["bytes"][name] / 1e6
            line = f"{layout:<13} {mb:>8.1f} {name:<17} {read:>8.1f} {read / mb:>8.3f}x {statistics.median(row['seconds'][name]):>8.3f}"
            print(line + (f" {statistics.median(row['requests'][name]):>8.0f}" if s3 else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="97MB", help=f"one of {', '.join(local.SIZES)}")
    parser.add_argument("--rounds", type=int, default=4, help="loads per way and layout (median seconds)")
    parser.add_argument("--s3", action="store_true", help="on a moto S3 server (pip install 'moto[server]')")
    parser.add_argument("--saved-as", type=int, choices=(1, 2, 4), default=None,
                        help="save every checkpoint at dp_replicate SAVED_AS (default: in the layout it is loaded into)")
    parser.add_argument("--remote-gap", type=int, default=None, help="bytes read through between wanted ranges (S3)")
    args = parser.parse_args(argv)
    if args.size not in local.SIZES:
        parser.error(f"--size {args.size}: unknown; choose from {', '.join(local.SIZES)}")
    if args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: must be >= 1")
    if args.remote_gap is not None and (args.remote_gap < 0 or not args.s3):
        parser.error(f"--remote-gap {args.remote_gap}: takes bytes >= 0, with --s3 (local reads seek over gaps)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool

    server = None
    pool = WorkerPool(_RANKS)
    try:
        with tempfile.TemporaryDirectory(prefix="bench_hsdp_") as tmp:
            env = log = None
            root = tmp
            if args.s3:
                from shardbridge.testing._s3 import S3Server

                server = S3Server(timeout_s=120.0)
                env, log, root = server.client_env(), server.log, server.bucket("sb-hsdp") + "/ckpt"
            before = os.getloadavg()[0]
            result = pool.run(_worker, (root, args.size, args.rounds, env, log, args.remote_gap, args.saved_as), {}, timeout=7200)[0]
            _report(args.size, result, args.rounds, args.s3, args.remote_gap, args.saved_as)
            print(f"machine load average (1 min) before / after: {before:.1f} / {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        pool.close()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
