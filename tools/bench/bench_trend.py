"""Real-process trend of the checkpoint path: 4, 8 and 16 gloo processes, shardbridge vs plain DCP.

The same small Llama with AdamW state (``bench_checkpoint.py``'s "8MB" size: a checkpoint of a
few MB) is parallelized the same way at every world size (dp_shard = world / tp x tp, FSDP2 per
block and root, ``parallelize_llama``) and saved and loaded by both contenders, side by side in
one run, the order shuffled each round (``bench_checkpoint._rotated``); per world size:

- save: shardbridge ``save`` (the derived protocol: argument round and write round, no plan
  round: [Note: the derived protocol]) as the first save of a job (nothing cached: every rank
  derives its entries' layouts) and as every later save (entries kept); plain DCP
  (``get_state_dict`` + ``dcp.save``: ``DefaultSavePlanner``, ``FileSystemWriter``, which fsyncs
  every file as shardbridge does), on the same local disk;
- load into the same world size: shardbridge ``load``; plain DCP (``get_state_dict`` +
  ``dcp.load`` with ``DefaultLoadPlanner`` + ``set_state_dict``);
- load into another world size: the same, from the checkpoints the previous world size of the
  run saved (the first world size loads the last one's, in a pool of its own at the end).

Measured per rank around the call alone (``os.sync()`` and a barrier before, untimed, as in
``bench_checkpoint.py``): wall time, CPU time (the process's, every thread), and every
collective the call makes (:class:`Counter`: torch.distributed's collectives wrapped, at the
call's level -- the "collective rounds" -- and at the tensor level, where the bytes are). The
first round warms up (imports, page cache, the plan cache) and is profiled: the gloo operations
torch's profiler records must equal the tensor collectives the counter saw, else the run stops
(a collective the counter missed). Times are medians over the other rounds of the slowest rank;
CPU seconds the mean over ranks.

Bytes per collective, per rank, are the data that must reach or leave it (``n`` ranks, ``b``
this rank's tensor): all-gather (n-1) b in and out; gather (n-1) b into the root, b out of each
other rank; broadcast and scatter b into each non-root rank, (n-1) b out of the root;
all-reduce 2 (n-1)/n b in and out (a ring). torch's object collectives are their tensor
collectives (sizes first, then the pickles padded to the largest rank's).

16 processes on a 2-core machine time-share: the times show how the protocol's cost grows with
the world size on one machine, not a cluster's times. What grows at thousands of ranks is the
simulated scale model's (``bench_scale.py``, docs/benchmarks.md "Scale").

    python tools/bench/bench_trend.py                      # the table of docs/benchmarks.md, "Trend"
    python tools/bench/bench_trend.py --worlds 4,8 --rounds 2
    nox -s trend
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_checkpoint as local  # noqa: E402 (the model, the quiescing and the shuffling of the local benchmark)
from shardbridge.checkpoint.derived import _spread  # noqa: E402

WORLDS = (4, 8, 16)
SIZE = "8MB"

# ------------------------------------------------------------------------- counting collectives


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _group_size(a: dict[str, Any]) -> int:
    import torch.distributed as dist

    return dist.get_world_size(a.get("group"))


def _is_broadcast_root(a: dict[str, Any]) -> bool:
    import torch.distributed as dist

    if a.get("group_src") is not None:
        return dist.get_rank(a.get("group")) == a["group_src"]
    return dist.get_rank() == a.get("src")


def _all_gather(a: dict[str, Any], key: str) -> tuple[int, int]:
    moved = (_group_size(a) - 1) * _nbytes(a[key])
    return moved, moved


def _rooted(root: bool, n: int, b: int, into_root: bool) -> tuple[int, int]:
    """(sent, received) of a rooted collective: gather (into the root) or broadcast / scatter (out of it)."""
    if into_root:
        return (0, (n - 1) * b) if root else (b, 0)
    return ((n - 1) * b, 0) if root else (0, b)


def _ring(a: dict[str, Any], key: str, factor: float) -> tuple[int, int]:
    n = _group_size(a)
    moved = int(factor * (n - 1) / n * _nbytes(a[key]))
    return moved, moved


# Tensor collectives: (sent, received) bytes of this rank, from the call's bound arguments.
_TENSOR: dict[str, Callable[[dict[str, Any]], tuple[int, int]]] = {
    "all_gather": lambda a: _all_gather(a, "tensor"),
    "all_gather_into_tensor": lambda a: _all_gather(a, "input_tensor"),
    "gather": lambda a: _rooted(bool(a.get("gather_list")), _group_size(a), _nbytes(a["tensor"]), into_root=True),
    "reduce": lambda a: _rooted(
        _is_broadcast_root({**a, "src": a.get("dst"), "group_src": a.get("group_dst")}),
        _group_size(a),
        _nbytes(a["tensor"]),
        into_root=True,
    ),  # fmt: skip
    "scatter": lambda a: _rooted(bool(a.get("scatter_list")), _group_size(a), _nbytes(a["tensor"]), into_root=False),
    "broadcast": lambda a: _rooted(_is_broadcast_root(a), _group_size(a), _nbytes(a["tensor"]), into_root=False),
    "all_reduce": lambda a: _ring(a, "tensor", 2),
    "reduce_scatter_tensor": lambda a: _ring(a, "input", 1),
    "reduce_scatter": lambda a: _all_gather(a, "output"),
    "all_to_all_single": lambda a: _ring(a, "input", 1),
    "all_to_all": lambda a: (sum(map(_nbytes, a["input_tensor_list"])),) * 2,
    "send": lambda a: (_nbytes(a["tensor"]), 0),
    "isend": lambda a: (_nbytes(a["tensor"]), 0),
    "recv": lambda a: (0, _nbytes(a["tensor"])),
    "irecv": lambda a: (0, _nbytes(a["tensor"])),
    "barrier": lambda a: (0, 0),
    "monitored_barrier": lambda a: (0, 0),
}
# Object collectives: counted as calls; their bytes are their tensor collectives'.
_OBJECT = ("all_gather_object", "gather_object", "scatter_object_list", "broadcast_object_list", "send_object_list",
           "recv_object_list")  # fmt: skip


@dataclass
class Calls:
    """The collectives one operation made on one rank."""

    rounds: list[str] = field(default_factory=list)
    """Collective calls at the caller's level (torch's object collectives count once), in order."""
    tensor: int = 0
    """Tensor collectives (what gloo runs: an object collective is two or three)."""
    sent: int = 0
    received: int = 0
    profiled: int | None = None
    """gloo operations torch's profiler recorded (warm-up round only)."""


class Counter:
    """torch.distributed's collectives wrapped while :meth:`counting` (as ``bench_scale.SimGroup``
    intercepts them, but the real collectives run): both ``torch.distributed.X`` and
    ``distributed_c10d.X`` are replaced, so that the tensor collectives torch's object collectives
    call inside are seen too (``calls`` records the outermost call only)."""

    def __init__(self) -> None:
        self.calls: Calls | None = None
        self.depth = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[Calls]:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        saved: dict[str, Any] = {}
        for name in (*_TENSOR, *_OBJECT):
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            saved[name] = fn
            wrapped = self._wrap(name, fn)
            setattr(c10d, name, wrapped)
            setattr(dist, name, wrapped)
        self.calls, self.depth = Calls(), 0
        try:
            yield self.calls
        finally:
            for name, fn in saved.items():
                setattr(c10d, name, fn)
                setattr(dist, name, fn)
            self.calls = None

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)
        size = _TENSOR.get(name)

        @functools.wraps(fn)
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls = self.calls
            assert calls is not None
            if self.depth == 0:
                calls.rounds.append(name)
            if size is not None:
                sent, received = size(signature.bind(*args, **kwargs).arguments)
                calls.tensor += 1
                calls.sent += sent
                calls.received += received
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted


# -------------------------------------------------------------------------------- on each rank


def _measure(fn: Callable[[], Any], counter: Counter, *, profile: bool) -> tuple[float, float, Calls]:
    """This rank's (wall s, CPU s, collectives) of ``fn`` (write-back quiesced and a barrier before)."""
    import torch
    import torch.distributed as dist

    local._quiesce()
    profiler = (
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        if profile
        else contextlib.nullcontext()
    )
    with profiler as prof, counter.counting() as calls:
        cpu, start = time.process_time(), time.perf_counter()
        fn()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if profile:
        calls.profiled = sum(1 for e in prof.events() if e.name.startswith("gloo:"))
    dist.barrier()
    return wall, cpu, calls


def _worker(root: str, size: str, tp: int, rounds: int, source: dict[str, Any] | None, saves: bool) -> dict[str, Any]:
    """Every contender on this world size; ``source``: the other world size's checkpoints (its
    ``world``, ``sb``, ``dcp``) to load from; ``saves``: False = only those loads."""
    import warnings

    import torch.distributed as dist
    from shardbridge import checkpoint

    # a load into another world size warns once per load that every rank restores rank 0's RNG
    warnings.filterwarnings("ignore", message=r".*restores rank 0's RNG state")
    world = dist.get_world_size()
    layout = {"dp_shard": world // tp, "tp": tp}
    model, opt = local._build(size, layout)
    model_b, opt_b = local._build(size, layout)
    counter = Counter()
    out: dict[str, list[tuple[float, float, Calls]]] = {}
    kept: dict[str, str] = {}
    for r in range(-1, rounds):  # round -1 warms up, profiled; not in the medians
        d = os.path.join(root, f"w{world}-{'s' if saves else 'l'}", f"r{r + 1}")
        sb, first, plain = (os.path.join(d, k) for k in ("sb", "sb-first", "dcp"))

        def first_save(path: str = first, step: int = r + 1) -> None:
            _spread._TABLES.clear()  # this job's first save: no layout's table kept ([Note: the derived protocol])
            checkpoint.save(path, model=model, optimizer=opt, step=step)

        contenders: list[tuple[str, Callable[[], Any]]] = []
        if saves:
            contenders += [
                ("sb save, first", first_save),
                ("sb save", functools.partial(checkpoint.save, sb, model=model, optimizer=opt, step=r + 1)),
                ("dcp save", functools.partial(local._dcp_save, model, opt, plain)),
            ]
        loads = []
        if saves:
            loads += [
                ("sb load same", functools.partial(checkpoint.load, sb, model=model_b, optimizer=opt_b)),
                ("dcp load same", functools.partial(local._dcp_load, model_b, opt_b, plain)),
            ]
        if source is not None:
            loads += [
                ("sb load other", functools.partial(checkpoint.load, source["sb"], model=model_b, optimizer=opt_b)),
                ("dcp load other", functools.partial(local._dcp_load, model_b, opt_b, source["dcp"])),
            ]
        # saves before loads (the loads read this round's checkpoints); each group shuffled
        for name, fn in local._rotated(contenders, r) + local._rotated(loads, r):
            result = _measure(fn, counter, profile=r < 0)
            calls = result[2]
            if calls.profiled is not None and calls.profiled != calls.tensor:
                raise RuntimeError(
                    f"{name} at {world} ranks: torch's profiler saw {calls.profiled} gloo operations, the counter "
                    f"{calls.tensor} tensor collectives ({calls.rounds}): a collective the counter does not wrap"
                )
            if r >= 0:
                out.setdefault(name, []).append(result)
        kept = {"world": world, "sb": sb, "dcp": plain}
    sizes = {"sb": local._dir_bytes(kept["sb"]), "dcp": local._dir_bytes(kept["dcp"])} if saves else {}
    return {"world": world, "layout": f"{world // tp}x{tp}", "results": out, "kept": kept if saves else None,
            "sizes": sizes}  # fmt: skip


# ------------------------------------------------------------------------------------ the table


@dataclass
class Op:
    """One contender's operation at one world size, over every rank and round."""

    seconds: float
    """Median over rounds of the slowest rank's wall time."""
    cpu: float
    """Median over rounds of the mean CPU seconds per rank."""
    calls: Calls
    """Rank 0's collectives (every rank's calls checked equal)."""
    other_sent: int
    other_received: int
    """The largest of the other ranks'."""


def _op(per_rank: list[list[tuple[float, float, Calls]]]) -> Op:
    rounds = len(per_rank[0])
    walls = [max(rank[i][0] for rank in per_rank) for i in range(rounds)]
    cpus = [statistics.fmean(rank[i][1] for rank in per_rank) for i in range(rounds)]
    calls = [rank[-1][2] for rank in per_rank]
    for r, c in enumerate(calls):
        assert c.rounds == calls[0].rounds, (r, c.rounds, calls[0].rounds)
    return Op(statistics.median(walls), statistics.median(cpus), calls[0],
              max(c.sent for c in calls[1:]), max(c.received for c in calls[1:]))  # fmt: skip


_ROWS = (  # label, shardbridge's op, plain DCP's op
    ("save, job's first", "sb save, first", "dcp save"),
    ("save, later", "sb save", "dcp save"),
    ("load, same world", "sb load same", "dcp load same"),
    ("load, from world {other}", "sb load other", "dcp load other"),
)
HEAD = ("world", "dp_shard x tp", "operation", "s (sb / DCP)", "DCP/sb", "CPU s/rank (sb / DCP)", "rounds (sb / DCP)",
        "tensor colls", "KB in, rank 0", "KB in, other", "KB out, rank 0", "KB out, other")  # fmt: skip


def _kb(n: int) -> str:
    return f"{n / 1e3:.1f}"


def rows(runs: dict[int, dict[str, Any]], sources: dict[int, int]) -> list[tuple[str, ...]]:
    """One row per (world, operation): shardbridge / plain DCP in each cell, and the time ratio."""
    out = []
    for world, run in runs.items():
        ops = {name: _op([rank[name] for rank in run["results"]]) for name in run["results"][0]}
        for label, sb_name, dcp_name in _ROWS:
            if sb_name not in ops:
                continue
            sb, dcp = ops[sb_name], ops[dcp_name]
            out.append((
                str(world), run["layout"], label.format(other=sources.get(world)),
                f"{sb.seconds:.3f} / {dcp.seconds:.3f}", f"{dcp.seconds / sb.seconds:.2f}x",
                f"{sb.cpu:.3f} / {dcp.cpu:.3f}", f"{len(sb.calls.rounds)} / {len(dcp.calls.rounds)}",
                f"{sb.calls.tensor} / {dcp.calls.tensor}",
                f"{_kb(sb.calls.received)} / {_kb(dcp.calls.received)}",
                f"{_kb(sb.other_received)} / {_kb(dcp.other_received)}",
                f"{_kb(sb.calls.sent)} / {_kb(dcp.calls.sent)}",
                f"{_kb(sb.other_sent)} / {_kb(dcp.other_sent)}",
            ))  # fmt: skip
    return out


def rounds_by_world(runs: dict[int, dict[str, Any]]) -> list[tuple[str, ...]]:
    """Collective rounds (calls, in order) per operation and contender, one column per world size."""
    worlds = sorted(runs)
    names = {}
    for world in worlds:
        for name, per_round in runs[world]["results"][0].items():
            names.setdefault(name, {})[world] = per_round[-1][2].rounds
    out = []
    for name in ("sb save, first", "sb save", "dcp save", "sb load same", "dcp load same", "sb load other",
                 "dcp load other"):  # fmt: skip
        if name in names:
            seq = names[name]
            same = len({tuple(s) for s in seq.values()}) == 1
            out.append((name, *(str(len(seq[w])) if w in seq else "-" for w in worlds),
                        "yes" if same else "NO", " ".join(_short(c) for c in next(iter(seq.values())))))  # fmt: skip
    return out


def _short(name: str) -> str:
    return {"all_reduce": "AR", "broadcast": "B", "gather_object": "GO", "scatter_object_list": "SO",
            "broadcast_object_list": "BO", "all_gather_object": "AGO", "all_gather": "AG", "barrier": "BAR"}.get(name, name)  # fmt: skip


def render(head: tuple[str, ...], body: list[tuple[str, ...]]) -> str:
    """A markdown table."""
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def main(argv: list[str] | None = None) -> int:
    """Print the trend table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma list of gloo world sizes")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (medians), after one warm-up round")
    parser.add_argument("--tp", type=int, default=2, help="TP degree (dp_shard = world / tp)")
    parser.add_argument("--size", default=SIZE, help=f"bench_checkpoint size, of {', '.join(local.SIZES)}")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    args = parser.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w.strip()]
    bad = [w for w in worlds if w < 2 or w % args.tp]
    if bad or len(set(worlds)) < 2 or args.size not in local.SIZES or args.rounds < 1:
        parser.error(f"--worlds {args.worlds!r}: two or more distinct sizes >= 2, each divisible by --tp {args.tp}; "
                     f"--size of {', '.join(local.SIZES)}; --rounds >= 1")  # fmt: skip
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool

    root = args.dir or tempfile.mkdtemp(prefix="sb-bench-trend-")
    os.makedirs(root, exist_ok=True)
    runs: dict[int, dict[str, Any]] = {}
    sources: dict[int, int] = {}
    before = os.getloadavg()[0]
    started = time.perf_counter()

    def in_pool(world: int, source: dict[str, Any] | None, saves: bool) -> list[dict[str, Any]]:
        # 16 processes sharing 2 cores: a collective may wait minutes for the slowest rank
        pool = WorkerPool(world, pg_timeout=600)
        try:
            return pool.run(_worker, (root, args.size, args.tp, args.rounds, source, saves), {}, timeout=7200)
        finally:
            pool.close()

    try:
        kept = None
        for world in worlds:
            print(f"... {world} processes", file=sys.stderr, flush=True)
            runs[world] = {"results": [], "layout": ""}
            per_rank = in_pool(world, kept, saves=True)
            runs[world] = {"results": [p["results"] for p in per_rank], "layout": per_rank[0]["layout"],
                           "sizes": per_rank[0]["sizes"]}  # fmt: skip
            if kept is not None:
                sources[world] = kept["world"]
            kept = per_rank[0]["kept"]
        first = worlds[0]
        print(f"... {first} processes, loading the {kept['world']}-process checkpoints", file=sys.stderr, flush=True)
        per_rank = in_pool(first, kept, saves=False)
        for mine, more in zip(runs[first]["results"], (p["results"] for p in per_rank), strict=True):
            mine.update(more)
        sources[first] = kept["world"]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    sizes = runs[worlds[0]]["sizes"]
    print(f"model: bench_checkpoint size {args.size} {local._model_config(args.size)}, AdamW state; checkpoint on "
          f"disk: shardbridge {sizes['sb'] / 1e6:.2f} MB, plain DCP {sizes['dcp'] / 1e6:.2f} MB; gloo, "
          f"OMP_NUM_THREADS=1, {args.rounds} timed rounds (medians of the slowest rank), {os.cpu_count()} cores")  # fmt: skip
    print(render(HEAD, rows(runs, sources)))
    print("s: wall time of the slowest rank; DCP/sb: plain DCP's time / shardbridge's (above 1: shardbridge faster); "
          "rounds: collective calls per rank; tensor colls: the tensor collectives they run; KB in / out: bytes "
          "that reach / leave the rank (other: the largest of the other ranks')\n")  # fmt: skip
    worlds_sorted = sorted(runs)
    print(
        "collective rounds per save / load, by world size (AR all_reduce, B broadcast, GO gather_object, "
        "SO scatter_object_list, BO broadcast_object_list, AGO all_gather_object, BAR barrier)"
    )
    print(render(("operation", *map(str, worlds_sorted), "same calls at every world", "calls"),
                 rounds_by_world(runs)))  # fmt: skip
    after = os.getloadavg()[0]
    print(f"machine load average (1 min) before / after: {before:.1f} / {after:.1f} on {os.cpu_count()} cores; "
          f"{time.perf_counter() - started:.0f} s in all")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
