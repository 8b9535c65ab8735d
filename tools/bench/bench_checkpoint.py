"""Checkpoint speed: shardbridge.checkpoint vs torch.save/torch.load of the same bytes and plain DCP.

On 4 gloo ranks (layout A = dp_shard=2 x tp=2) a Llama with AdamW state is saved and loaded
by every contender, side by side in one run, the order shuffled each round; medians:

- save: ``shardbridge save`` (sync), per-rank ``torch.save`` of exactly this rank's local
  shards with and without ``fsync`` (shardbridge and DCP fsync every file), plain DCP
  (``get_state_dict`` + ``dcp.save``);
- training blocked by a save: the time until the call returns, for the sync save,
  ``save(..., async_=True)`` and plain ``dcp.async_save`` (torch's thread-based async save
  on its own gloo group, as torchtitan sets it up), each followed by waiting for the save;
- load: ``shardbridge load`` into the same layout and into dp_shard=4, per-rank
  ``torch.load`` (``weights_only=True``), plain DCP (``dcp.load`` + ``set_state_dict``).

What shardbridge keeps beyond DCP's defaults is measured against DCP's default in the same run,
the same bytes, each as a contender of its own ([Note: save protocols] in
``checkpoint/_protocol.py``; docs/benchmarks.md, "What is kept"):

- ``save, dcp.save protocol``: ``dcp.save`` with DCP's plan caching instead of shardbridge's
  derived plans ([Note: the derived protocol]: no plan round, storage records derived by rule);
- ``save, DCP-style file writer``: zip CRC32 computed and each file hashed by reading it back,
  instead of CRC32 left at 0 and hashing while writing ([Note: the data file writer]);
- ``save / load same, object collectives``: torch's two-collective object collectives instead of
  one fixed-size collective per small round ([Note: one-collective rounds]);
- ``load same, whole records``: every record ``torch.load``-ed whole and copied (DCP's reader)
  instead of its bytes read straight into the tensors ([Note: reading records in one pass]).

Ratios are throughput ratios (baseline time / our time: 1.00 = as fast as the baseline,
0.5 = half as fast), as the ratio of the medians and as the median of the per-round ratios
("paired"). The page cache is warm for every contender alike, and before each timed
operation ``os.sync()`` writes back every dirty page (untimed), so no contender's fsync pays
for another's writes. A save contender's files that no load reads are deleted right after
it (untimed, ``_drop``), so a late place in the round does not pay for the earlier ones' page
cache. The order is shuffled each round (``_rotated``, seeded: the same run twice shuffles alike).

    python tools/bench/bench_checkpoint.py [--sizes 252MB,1GB] [--rounds 6] [--dir /tmp/x]
    python tools/bench/bench_checkpoint.py --sizes 97MB,252MB,1GB   # the size curve
    python tools/bench/bench_checkpoint.py --profile save --sizes 252MB   # cProfile of rank 0
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

# name -> (vocab, dim, layers, intermediate): model + AdamW state on disk ~ the name.
SIZES = {
    "8MB": (1024, 128, 2, 384),  # tools/bench/bench_trend.py: 4-16 processes on 2 cores
    "97MB": (4096, 384, 3, 1024),
    "252MB": (8192, 512, 4, 1536),
    "1GB": (8192, 1024, 5, 3072),
}


def _model_config(size: str):
    from shardbridge.models import LlamaConfig

    vocab, dim, layers, inter = SIZES[size]
    return LlamaConfig.tiny(
        vocab_size=vocab, dim=dim, num_layers=layers, num_heads=8, num_kv_heads=4, intermediate_size=inter
    )


def _build(size, layout):
    import torch
    from shardbridge import ParallelDims
    from shardbridge.models import Llama, parallelize_llama, synthetic_batch

    pm = ParallelDims(**layout).build_mesh("cpu")
    model = parallelize_llama(Llama(_model_config(size), seed=0), pm)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = pm.dims.degree("dp")
    tokens, labels = synthetic_batch(model.config, max(4, dp), 16, dp_rank=pm["dp"].get_local_rank(), dp_size=dp)
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


def _torch_save(local, path, fsync):
    import torch

    with open(path, "wb") as f:
        torch.save(local, f)
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _dcp_load(model, opt, path):
    """Plain torch DCP, the way its docs show it: get_state_dict, dcp.load, set_state_dict."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _dcp_async(model, opt, path, group):
    """torchtitan's setup: dcp.async_save on a gloo group of its own; returns the future."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(_dcp_state(model, opt), checkpoint_id=path, process_group=group)


def _max_over_ranks(value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _quiesce():
    """Before every timed operation: no dirty page of an earlier contender left for this one's
    fsyncs to write back (on ext4 an fsync may commit other files' data too), then a barrier."""
    import torch.distributed as dist

    os.sync()
    dist.barrier()


class _Seconds(float):
    """A wall time that also carries the CPU seconds the 4 ranks spent (``cpu``: all threads, summed)."""

    cpu: float


def _timed(fn):
    """Wall time of fn on all ranks (write-back quiesced and barrier before, barrier after), with
    the CPU time every rank's process spent meanwhile, summed over ranks (``.cpu``): on a shared,
    loaded machine wall times follow the other users, CPU seconds the work each contender does."""
    import torch
    import torch.distributed as dist

    _quiesce()
    cpu = time.process_time()
    start = time.perf_counter()
    fn()
    dist.barrier()
    wall = _Seconds(time.perf_counter() - start)
    spent = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.all_reduce(spent)
    wall.cpu = float(spent.item())
    return wall


def _timed_blocking(start_fn, wait_fn):
    """(time until start_fn returned, slowest rank; total until wait_fn returned on all ranks)."""
    import torch.distributed as dist

    _quiesce()
    start = time.perf_counter()
    handle = start_fn()
    blocked = time.perf_counter() - start
    wait_fn(handle)
    dist.barrier()
    total = time.perf_counter() - start
    return _max_over_ranks(blocked), total


def _worker(root: str, size: str, rounds: int, profile: str | None, loads_only: bool = False):
    import torch.distributed as dist

    a = {"dp_shard": 2, "tp": 2}
    b = {"dp_shard": 4, "tp": 1}
    model, opt = _build(size, a)
    model_a, opt_a = _build(size, a)
    model_b, opt_b = _build(size, b)
    group = dist.new_group(backend="gloo")
    times: dict[str, list[float]] = {}
    sizes: dict[str, float] = {}

    def add(name, value):
        times.setdefault(name, []).append(float(value))
        if isinstance(value, _Seconds):
            times.setdefault(f"{name} [cpu]", []).append(value.cpu)

    if profile:
        return _profile(root, profile, model, opt, model_a, opt_a)
    for r in range(rounds):
        sizes = _round(r, root, add, group, (model, opt), (model_a, opt_a), (model_b, opt_b), loads_only)
    return {"times": times, "sizes": sizes}


def _round(r, root, add, group, source, same, other, loads_only=False):
    """One round: every save contender, then every load contender; order alternates.

    ``loads_only``: the saves the loads read (shardbridge's, torch.save's, plain DCP's) run untimed."""
    import pickle
    from pathlib import Path

    import torch
    import torch.distributed as dist
    from shardbridge import checkpoint
    from shardbridge.checkpoint.storage._trust import read_metadata

    rank = dist.get_rank()
    (model, opt), (model_a, opt_a), (model_b, opt_b) = source, same, other
    ckpt, raw, dcp_dir = (os.path.join(root, f"{k}-{r}") for k in ("sb", "raw", "dcp"))
    sb_async, dcp_async = os.path.join(root, f"sba-{r}"), os.path.join(root, f"dcpa-{r}")
    os.makedirs(raw, exist_ok=True)
    local = _local_state(model, opt)
    raw_file = os.path.join(raw, f"rank{rank}.pt")
    raw_nofsync = os.path.join(raw, f"nofsync-rank{rank}.pt")
    alt = {k: os.path.join(root, f"{k}-{r}") for k in ("sb-dcp", "sb-crc", "sb-obj")}

    def save_as(key, path, variant=contextlib.nullcontext, **kwargs):
        with variant():
            add(key, _timed(lambda: checkpoint.save(path, model=model, optimizer=opt, step=r, **kwargs)))

    saves = [  # (contender, what it writes: deleted right after it unless a load reads it)
        (lambda: add("save", _timed(lambda: checkpoint.save(ckpt, model=model, optimizer=opt, step=r))), None),
        (lambda: save_as("save, dcp.save protocol", alt["sb-dcp"], protocol="dcp"), alt["sb-dcp"]),
        (lambda: save_as("save, DCP-style file writer", alt["sb-crc"], _dcp_style_writer), alt["sb-crc"]),
        (lambda: save_as("save, object collectives", alt["sb-obj"], _object_collectives), alt["sb-obj"]),
        (lambda: add("torch.save+fsync", _timed(lambda: _torch_save(local, raw_file, True))), None),
        (lambda: add("torch.save", _timed(lambda: _torch_save(local, raw_nofsync, False))), raw_nofsync),
        (lambda: add("dcp.save", _timed(lambda: _dcp_save(model, opt, dcp_dir))), None),
        (lambda: _add_pair(add, "async", _timed_blocking(
            lambda: checkpoint.save(sb_async, model=model, optimizer=opt, step=r, async_=True), lambda h: h.wait())),
         sb_async),
        (lambda: _add_pair(add, "dcp.async_save", _timed_blocking(
            lambda: _dcp_async(model, opt, dcp_async, group), lambda f: f.result())), dcp_async),
    ]  # fmt: skip
    if loads_only:
        checkpoint.save(ckpt, model=model, optimizer=opt, step=r)
        _torch_save(local, raw_file, False)
        _dcp_save(model, opt, dcp_dir)
    for fn, written in [] if loads_only else _rotated(saves, r):
        fn()
        if written is not None:
            _drop(written)
    loads = [
        ("load same", lambda: checkpoint.load(ckpt, model=model_a, optimizer=opt_a)),
        ("load other", lambda: checkpoint.load(ckpt, model=model_b, optimizer=opt_b)),
        ("torch.load", lambda: torch.load(raw_file, weights_only=True)),
        ("dcp.load", lambda: _dcp_load(model_a, opt_a, dcp_dir)),
        ("dcp.load other", lambda: _dcp_load(model_b, opt_b, dcp_dir)),
        ("load same, verify=False", lambda: checkpoint.load(ckpt, model=model_a, optimizer=opt_a, verify=False)),
        ("load same, whole records", lambda: checkpoint.load(ckpt, model=model_a, optimizer=opt_a), _whole_records),
        ("load same, object collectives", lambda: checkpoint.load(ckpt, model=model_a, optimizer=opt_a),
         _object_collectives),
    ]  # fmt: skip
    for name, fn, *variant in _rotated([(*load, ) for load in loads], r):
        with (variant[0] if variant else contextlib.nullcontext)():
            add(name, _timed(fn))
    # Where a load's time goes beyond torch.load's (the parts outside shardbridge): reading
    # DCP's .metadata pickle with the restricted unpickler (rank 0, once per load) and with
    # plain pickle (DCP's own way, which runs code from the file: measured on our own file
    # only), and torch's state-dict plumbing that every DCP load does (get/set_state_dict).
    parts = [
        ("metadata, restricted", lambda: _on_rank0(lambda: read_metadata(ckpt))),
        ("metadata, pickle", lambda: _on_rank0(lambda: pickle.loads(Path(ckpt, ".metadata").read_bytes()))),
        ("state dicts", lambda: _state_dict_round_trip(model_a, opt_a)),
    ]
    for name, fn in parts:
        add(name, _timed(fn))
    sizes = {"checkpoint": _dir_bytes(ckpt), "torch.save": sum(os.path.getsize(os.path.join(raw, f)) for f in os.listdir(raw) if f.startswith("rank"))} if rank == 0 else {}
    dist.barrier()
    if rank == 0:
        for path in (ckpt, raw, dcp_dir, sb_async, dcp_async, *alt.values()):
            shutil.rmtree(path, ignore_errors=True)  # --loads-only writes some of them only
    dist.barrier()
    return sizes


def _drop(path):
    """Untimed: a save contender's files that no load reads, deleted (rank 0; a per-rank file by its rank).

    Their page cache goes with them. Kept, the 9 saves of a round filled ~9 GB of it at 1 GB, and
    the later places in a round paid for it: medians of 9 rounds at 1 GB, 54 contender-rounds,
    places 1-3 / 4-6 / 7-9: 1.22 / 2.19 / 2.15 s and 1.29 / 2.36 / 2.70 CPU s (docs/benchmarks.md,
    "1 GB save, the 0.62x examined"). Seeds 0-8 never put shardbridge's save in the first 3 places."""
    import torch.distributed as dist

    dist.barrier()
    if os.path.isfile(path):
        os.remove(path)
    elif dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()


@contextlib.contextmanager
def _dcp_style_writer():
    """Data files written as DCP's FileSystemWriter writes them: torch.save with the zip CRC32, then
    each file hashed by reading it back (shardbridge: CRC32 left at 0, hashed while written)."""
    import torch
    from shardbridge.checkpoint.storage import _integrity, _writer

    real_items = _writer._write_items

    def items_then_hash(backend, path, name, items, planner):
        results, _ = real_items(backend, path, name, items, planner)
        size, digest = _integrity.checksum(backend, path)
        return results, {"size": size, "xxh3_128": digest}

    saved = (_writer.torch_save_without_crc, _writer._write_items)
    _writer.torch_save_without_crc = lambda t, f: torch.save(t, f)
    _writer._write_items = items_then_hash
    try:
        yield
    finally:
        _writer.torch_save_without_crc, _writer._write_items = saved


@contextlib.contextmanager
def _object_collectives():
    """Every small round as torch's object collectives (two collectives each) instead of one."""
    from shardbridge.checkpoint import _dist

    real, _dist._cpu_collectives = _dist._cpu_collectives, lambda: False
    try:
        yield
    finally:
        _dist._cpu_collectives = real


@contextlib.contextmanager
def _whole_records():
    """Every record torch.load-ed whole, then copied into its target (DCP's reader), not read in place:
    no record matches a template, so each is read whole from the same stream and torch.load-ed."""
    from shardbridge.checkpoint.storage import _read

    real, _read._template = _read._template, lambda sizes, dtype: None
    try:
        yield
    finally:
        _read._template = real


def _rotated(items: list, r: int) -> list:
    """Round ``r``'s order: a shuffle seeded by ``r`` (the same on every rank).

    Position matters on this VM: whatever runs right after a 1 GB write and fsync often writes
    at the disk's speed (~0.7 GB/s) instead of the host cache's (~2.5 GB/s), even after
    ``os.sync()`` and a 2 s pause. Alternating two orders gave one contender the first and last
    places only; rotating one order keeps neighbours together, so a contender always ran right
    after the same one (the paired ratio of two neighbours was biased: 1.08x paired against
    0.70x for the medians of 12 rotated rounds at 1 GB). A shuffle per round varies both the
    position and the neighbour."""
    order = list(items)
    random.Random(r).shuffle(order)
    return order


def _on_rank0(fn):
    import torch.distributed as dist

    if dist.get_rank() == 0:
        fn()


def _state_dict_round_trip(model, opt):
    """torch's get_state_dict + set_state_dict with the same tensors: no I/O, the plumbing alone."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)


def _dcp_save(model, opt, path):
    import torch.distributed.checkpoint as dcp

    dcp.save(_dcp_state(model, opt), checkpoint_id=path)


def _add_pair(add, name, pair):
    add(f"{name} (blocking)", pair[0])
    add(f"{name} (total)", pair[1])


def _profile(root, what, model, opt, model_a, opt_a):
    """cProfile of rank 0 for one shardbridge save or load (after a warm-up one)."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist
    from shardbridge import checkpoint

    path = os.path.join(root, "prof")
    checkpoint.save(path, model=model, optimizer=opt, overwrite=True)
    run = {
        "save": lambda: checkpoint.save(path, model=model, optimizer=opt, overwrite=True),
        "async": lambda: checkpoint.save(path, model=model, optimizer=opt, overwrite=True, async_=True),
        "load": lambda: checkpoint.load(path, model=model_a, optimizer=opt_a),
    }[what]
    run()
    checkpoint.wait()
    prof = cProfile.Profile()
    dist.barrier()
    start = time.perf_counter()
    prof.enable()
    run()  # async: the part that blocks training
    prof.disable()
    seconds = time.perf_counter() - start
    checkpoint.wait()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(45)
    return {"profile": f"{what}: {seconds:.3f} s on rank {dist.get_rank()}\n{out.getvalue()}"}


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _ratio(times: dict[str, list[float]], base: str, ours: str) -> float:
    """Median over rounds of base time / our time, each round's pair measured back to back.

    On a VM disk the same save varies 2-4x from one round to the next; a pair taken within one
    round sees the same disk, so the median of the per-round ratios is steadier than the ratio
    of the medians (both are printed)."""
    return statistics.median(b / o for b, o in zip(times[base], times[ours], strict=True))


def _report(size: str, result: dict, rounds: int) -> None:
    t = {k: statistics.median(v) for k, v in result["times"].items()}
    per_round = result["times"]
    mb = result["sizes"]["checkpoint"] / 1e6
    print(f"\n== {size}: {_model_config(size)}")
    print(f"checkpoint {mb:.1f} MB on disk; torch.save files {result['sizes']['torch.save'] / 1e6:.1f} MB; "
          f"4 gloo ranks, dp_shard=2 x tp=2, {rounds} rounds, medians\n")  # fmt: skip
    print(f"{'operation':<44} {'seconds':>8} {'MB/s':>8} {'vs base':>8} {'paired':>7} {'CPU s':>7}  base")
    rows = [
        ("torch.save per rank, fsync", "torch.save+fsync", None),
        ("torch.save per rank, no fsync", "torch.save", None),
        ("plain DCP save", "dcp.save", "torch.save+fsync"),
        ("shardbridge save", "save", "torch.save+fsync"),
        ("shardbridge save (vs no-fsync torch.save)", "save", "torch.save"),
        ("torch.load per rank", "torch.load", None),
        ("plain DCP load (+set_state_dict)", "dcp.load", "torch.load"),
        ("shardbridge load, same layout", "load same", "torch.load"),
        ("shardbridge load, same layout, verify=False", "load same, verify=False", "torch.load"),
        ("shardbridge load, into dp_shard=4", "load other", "torch.load"),
        ("plain DCP load, into dp_shard=4", "dcp.load other", "torch.load"),
    ]
    for label, key, base in rows:
        if key not in t or (base is not None and base not in t):  # --loads-only: no save was timed
            continue
        sec = t[key]
        ratio = "" if base is None else f"{t[base] / sec:.2f}x"
        paired = "" if base is None else f"{_ratio(per_round, base, key):.2f}x"
        print(f"{label:<44} {sec:>8.3f} {mb / sec:>8.1f} {ratio:>8} {paired:>7} {t[key + ' [cpu]']:>7.3f}  {base or ''}")
    print("(vs base: ratio of the medians; paired: median of the per-round ratios, each pair measured in one round; "
          "CPU s: every rank's process, summed)")  # fmt: skip
    print(f"\n{'what is kept (ours vs the DCP default it replaces)':<52} {'ours s':>8} {'default s':>9} {'x':>6} "
          f"{'paired':>7} {'CPU s ours / default (4 ranks)':>31}")  # fmt: skip
    kept = [
        ("derived plans vs dcp.save + plan caching", "save", "save, dcp.save protocol"),
        ("data file writer vs DCP-style (CRC32, read-back hash)", "save", "save, DCP-style file writer"),
        ("one-collective rounds vs object collectives (save)", "save", "save, object collectives"),
        ("one-collective rounds vs object collectives (load)", "load same", "load same, object collectives"),
        ("in-place reads vs whole records (DCP's reader)", "load same", "load same, whole records"),
    ]
    for label, ours, default in kept:
        if ours not in t:
            continue
        cpu = f"{t[ours + ' [cpu]']:.3f} / {t[default + ' [cpu]']:.3f} = {t[default + ' [cpu]'] / t[ours + ' [cpu]']:.2f}x"
        print(f"{label:<52} {t[ours]:>8.3f} {t[default]:>9.3f} {t[default] / t[ours]:>5.2f}x "
              f"{_ratio(per_round, default, ours):>6.2f}x {cpu:>31}")  # fmt: skip
    explained = t["torch.load"] + t["metadata, restricted"] + t["state dicts"]
    print(
        f"\nload, where the time goes (s): torch.load {t['torch.load']:.3f} + .metadata restricted unpickling "
        f"{t['metadata, restricted']:.3f} (plain pickle: {t['metadata, pickle']:.3f}) + torch's get/set_state_dict "
        f"{t['state dicts']:.3f} = {explained:.3f}; shardbridge load {t['load same']:.3f} "
        f"(verify=False {t['load same, verify=False']:.3f}); the rest: {t['load same'] - explained:+.3f} "
        f"({t['load same, verify=False'] - explained:+.3f}): shardbridge's own work (argument and layout "
        "checks, 3 collective rounds (2 with verify=False), checksums, planning and checking the records)"
    )
    if "save" not in t:
        print(f"\nshardbridge / plain DCP load throughput: {t['dcp.load'] / t['load same']:.2f}x (paired "
              f"{_ratio(per_round, 'dcp.load', 'load same'):.2f}x); load into dp_shard=4 / same layout (time): "
              f"{t['load other'] / t['load same']:.2f} (plain DCP's: {t['dcp.load other'] / t['dcp.load']:.2f})")  # fmt: skip
        return
    print(f"\n{'training blocked by a save':<44} {'blocked s':>9} {'total s':>8}")
    for label, key in (("shardbridge save (sync)", None), ("shardbridge save(async_=True)", "async"),
                       ("plain dcp.async_save (own gloo group)", "dcp.async_save")):  # fmt: skip
        blocked = t["save"] if key is None else t[f"{key} (blocking)"]
        total = t["save"] if key is None else t[f"{key} (total)"]
        print(f"{label:<44} {blocked:>9.3f} {total:>8.3f}")
    print(
        f"\nshardbridge / plain DCP throughput: save {t['dcp.save'] / t['save']:.2f}x (paired "
        f"{_ratio(per_round, 'dcp.save', 'save'):.2f}x), load {t['dcp.load'] / t['load same']:.2f}x (paired "
        f"{_ratio(per_round, 'dcp.load', 'load same'):.2f}x); load into dp_shard=4 / same layout (time): "
        f"{t['load other'] / t['load same']:.2f} (paired {1 / _ratio(per_round, 'load same', 'load other'):.2f}; "
        f"plain DCP's: {t['dcp.load other'] / t['dcp.load']:.2f}); "
        f"async blocking / dcp.async_save blocking: {t['async (blocking)'] / t['dcp.async_save (blocking)']:.2f}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="252MB,1GB", help=f"comma-separated, of {', '.join(SIZES)}")
    parser.add_argument("--rounds", type=int, default=6, help="rounds per size (medians; the order is shuffled each round)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--profile", choices=("save", "async", "load"), default=None,
                        help="cProfile rank 0 instead (async: the part of save(async_=True) that blocks)")
    parser.add_argument("--loads-only", action="store_true", help="time the loads only (the saves they read run untimed)")
    args = parser.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    bad = [s for s in sizes if s not in SIZES]
    if bad:
        parser.error(f"--sizes: unknown {bad}; choose from {', '.join(SIZES)}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from shardbridge.testing import WorkerPool

    root = args.dir or tempfile.mkdtemp(prefix="sb-bench-ckpt-")
    os.makedirs(root, exist_ok=True)
    pool = WorkerPool(4)
    try:
        for size in sizes:
            before = os.getloadavg()[0]
            work = (root, size, args.rounds, args.profile, args.loads_only)
            result = pool.run(_worker, work, {}, timeout=3600)[0]
            if args.profile:
                print(result["profile"])
            else:
                _report(size, result, args.rounds)
            load = (before, os.getloadavg()[0])
            # "after" counts this benchmark's own 4 ranks (a load of 4-10 on 2 cores by itself): only
            # the load before it says whether others were using the machine
            print(f"machine load average (1 min) before / after (this run included): {load[0]:.1f} / {load[1]:.1f} on "
                  f"{os.cpu_count()} cores" + ("  <- loaded: ratios are noise, rerun on a quiet machine"
                                              if load[0] > os.cpu_count() / 2 else ""))  # fmt: skip
    finally:
        pool.close()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
