"""Checkpoints on an object store: shardbridge vs plain DCP's FsspecWriter/FsspecReader, same S3 server.

A real S3-compatible server (moto's, started here on 127.0.0.1; ``pip install "moto[server]"``),
s3fs as the client of both contenders. On 4 gloo ranks (layout A = dp_shard=2 x tp=2) a Llama with
AdamW state (the sizes of ``bench_checkpoint.py``) is saved and loaded by every contender, side by
side in one run, the order shuffled each round; medians:

- save: ``shardbridge save`` (up to ``FILES_PER_RANK`` concurrent uploads per rank), the same with
  one upload per rank, plain DCP (``get_state_dict`` + ``dcp.save(storage_writer=FsspecWriter)``,
  one file per rank, as DCP's defaults are);
- load: ``shardbridge load`` (``verify=True``: every file's checksum) into the same layout and into
  dp_shard=4, plain DCP (``dcp.load(storage_reader=FsspecReader)`` + ``set_state_dict``, both
  layouts; it checks no checksum).

``--latency-ms N`` puts a proxy between both contenders and the server that holds back the first
byte of every response N ms (each request's first-byte latency, as a real object store's 20-60 ms;
the server itself answers in about a millisecond on this machine): a protocol's cost in requests
shows. Every row prints the requests per rank next to the seconds: the HTTP requests the server
logged during the operation, divided by the 4 ranks (both contenders counted alike).

Ratios are throughput ratios (baseline time / our time), as the ratio of the medians and as the
median of the per-round ratios ("paired"). The server runs on the same machine: what is measured
is the protocol's and the client's cost (requests, copies, concurrency), not a network.

    python tools/bench/bench_s3.py [--sizes 97MB,252MB] [--rounds 4] [--latency-ms 30] [--loads-only]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_checkpoint as local  # noqa: E402 (the models, timing and shuffling of the local benchmark)

_RANKS = 4


def _worker(env: dict[str, str], log: str, root: str, size: str, rounds: int, loads_only: bool):
    from shardbridge.testing._s3 import use_server

    use_server(env)
    a, b = {"dp_shard": 2, "tp": 2}, {"dp_shard": 4, "tp": 1}
    model, opt = local._build(size, a)
    model_a, opt_a = local._build(size, a)
    model_b, opt_b = local._build(size, b)
    times: dict[str, list[float]] = {}
    requests: dict[str, list[float]] = {}
    for r in range(rounds):
        _round(r, log, root, times, requests, loads_only, (model, opt), (model_a, opt_a), (model_b, opt_b))
    return {"times": times, "requests": requests}


def _counted(log: str, fn):
    """(seconds, HTTP requests per rank the server answered meanwhile): ``local._timed`` with the server's log."""
    import torch.distributed as dist
    from shardbridge.testing._s3 import served

    dist.barrier()
    before = len(served(log))
    seconds = local._timed(fn)  # barriers before and after: every rank's requests are in
    return seconds, (len(served(log)) - before) / _RANKS


def _round(r, log, root, times, requests, loads_only, source, same, other):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from shardbridge import checkpoint
    from shardbridge._compat import dcp_fsspec_classes
    from shardbridge.checkpoint import _save

    writer_cls, reader_cls = dcp_fsspec_classes()
    (model, opt), (model_a, opt_a), (model_b, opt_b) = source, same, other
    ours, one, plain = (f"{root}/{k}-{r}" for k in ("sb", "sb1", "dcp"))

    def add(name, measured):
        seconds, sent = measured
        times.setdefault(name, []).append(seconds)
        requests.setdefault(name, []).append(sent)

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
    if loads_only:  # the checkpoints the loads read, untimed
        saves[0][1]()
        plain_save()
    else:
        for name, fn in local._rotated(saves, r):
            add(name, _counted(log, fn))
    loads = [
        ("load same", lambda: checkpoint.load(ours, model=model_a, optimizer=opt_a)),
        ("load other", lambda: checkpoint.load(ours, model=model_b, optimizer=opt_b)),
        ("dcp.load FsspecReader", lambda: plain_load(model_a, opt_a)),
        ("dcp.load FsspecReader other", lambda: plain_load(model_b, opt_b)),
    ]
    for name, fn in local._rotated(loads, r):
        add(name, _counted(log, fn))
    dist.barrier()
    if dist.get_rank() == 0:
        from shardbridge.checkpoint.storage._location import locate

        fs = locate(root).backend.fs
        for path in (ours, one, plain):
            if fs.exists(path.removeprefix("s3://")):
                fs.rm(path.removeprefix("s3://"), recursive=True)
    dist.barrier()


class _LatencyProxy:
    """A TCP proxy on 127.0.0.1 in front of the S3 server: every response's first byte waits ``delay_s``.

    A response starts when the server sends after the client did (a request, or the body after a
    ``100 Continue``, which then waits too: a round trip of its own, as on a network). The rest of
    a response streams through at once. Runs on an event loop in a thread of this process.
    """

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.delay_s, self._upstream = delay_s, upstream_port
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()

        threading.Thread(target=run, name="latency-proxy", daemon=True).start()
        ready.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream)
        asked = asyncio.Event()

        async def upstream() -> None:
            while data := await reader.read(1 << 16):
                asked.set()
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()

        async def downstream() -> None:
            while data := await up_reader.read(1 << 20):
                if asked.is_set():
                    asked.clear()
                    await asyncio.sleep(self.delay_s)
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    def env(self, env: dict[str, str], endpoint: str) -> dict[str, str]:
        """``env`` (a server's client environment) pointed at this proxy."""
        mine = f"http://127.0.0.1:{self.port}"
        return {k: v.replace(endpoint, mine) for k, v in env.items()}

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)


def _report(size: str, result: dict, rounds: int, mb: float, latency_ms: float, loads_only: bool) -> None:
    t = {k: statistics.median(v) for k, v in result["times"].items()}
    sent = {k: statistics.median(v) for k, v in result["requests"].items()}
    per_round = result["times"]
    print(f"\n== {size}: {local._model_config(size)}")
    network = f", {latency_ms:g} ms first-byte latency per request (proxy)" if latency_ms else ""
    print(f"checkpoint ~{mb:.0f} MB; 4 gloo ranks, dp_shard=2 x tp=2, moto S3 server on 127.0.0.1{network}, {rounds} rounds\n")
    print(f"{'operation':<44} {'seconds':>8} {'MB/s':>8} {'req/rank':>8} {'vs base':>8} {'paired':>7}  base")
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
        if key not in t:
            continue
        sec = t[key]
        ratio = "" if base is None else f"{t[base] / sec:.2f}x"
        paired = "" if base is None else f"{local._ratio(per_round, base, key):.2f}x"
        print(f"{label:<44} {sec:>8.3f} {mb / sec:>8.1f} {sent[key]:>8.1f} {ratio:>8} {paired:>7}  {base or ''}")
    print(
        f"\nreshard / same-layout load (time): shardbridge {t['load other'] / t['load same']:.2f}, plain DCP "
        f"{t['dcp.load FsspecReader other'] / t['dcp.load FsspecReader']:.2f}"
        + ("" if loads_only else f"; concurrent uploads: {t['save, one upload per rank'] / t['save']:.2f}x one upload per rank")
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="97MB,252MB", help=f"comma-separated, of {', '.join(local.SIZES)}")
    parser.add_argument("--rounds", type=int, default=4, help="rounds per size (medians; shuffled order)")
    parser.add_argument("--latency-ms", type=float, default=0.0, help="first-byte delay per request (0: none)")
    parser.add_argument("--loads-only", action="store_true", help="time the loads only (the saves run untimed)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in local.SIZES]
    if bad:
        parser.error(f"--sizes: unknown {bad}; choose from {', '.join(local.SIZES)}")
    if args.latency_ms < 0:
        parser.error(f"--latency-ms {args.latency_ms:g}: must be >= 0 (0 = no proxy)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool
    from shardbridge.testing._s3 import S3Server

    server = S3Server(timeout_s=120.0)
    proxy = _LatencyProxy(server.port, args.latency_ms / 1000) if args.latency_ms else None
    env = server.client_env() if proxy is None else proxy.env(server.client_env(), server.endpoint)
    pool = WorkerPool(_RANKS)
    try:
        root = server.bucket("sb-bench") + "/ckpt"
        for size in sizes:
            before = os.getloadavg()[0]
            work = (env, server.log, root, size, args.rounds, args.loads_only)
            result = pool.run(_worker, work, {}, timeout=7200)[0]
            mb = {"8MB": 8.0, "97MB": 97.0, "252MB": 252.0, "1GB": 957.0}[size]
            _report(size, result, args.rounds, mb, args.latency_ms, args.loads_only)
            load = (before, os.getloadavg()[0])
            print(f"machine load average (1 min) before / after: {load[0]:.1f} / {load[1]:.1f} on {os.cpu_count()} cores")
    finally:
        pool.close()
        if proxy is not None:
            proxy.close()
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
