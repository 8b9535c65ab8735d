"""HSDP loads read each stored byte once: [Note: reading once under replication] in ``_load.py``.

The bytes each rank reads are counted at the local backend's read functions (every byte that comes
out of a file through ``stream``, ``read_into`` and ``read_bytes``), per file; the values loaded are
compared bit-exact on every rank (each replica's own ``full_tensor()``) with the saved model's.
"""

from __future__ import annotations

import os
import re

import pytest
import torch.distributed as dist
from ckpt_helpers import assert_equal_states, build, full_state
from shardbridge import checkpoint as ck
from shardbridge.checkpoint.state._rng import rng_file
from shardbridge.checkpoint.storage._local import LocalBackend
from shardbridge.testing import run_distributed
from shardbridge.testing._reads import counted_reads

HSDP = {"dp_replicate": 2, "dp_shard": 2}
DDP = {"dp_replicate": 4, "dp_shard": 1}


def _save(path: str, layout: dict[str, int]):
    model, opt = build(layout)
    ck.save(path, model=model, optimizer=opt, step=1)
    state = full_state(model, opt)  # a collective
    return state if dist.get_rank() == 0 else None


def _load(path: str, layout: dict[str, int]):
    model, opt = build(layout, seed=7, lr=0.5)  # every value must come from the checkpoint
    with counted_reads(LocalBackend) as reads:
        ck.load(path, model=model, optimizer=opt)
    return full_state(model, opt), opt.param_groups[0]["lr"], dict(reads)


def _data(reads: dict[str, int]) -> int:
    return sum(n for name, n in reads.items() if name.endswith(".distcp"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A model saved at HSDP 2 x 2, its full state and its data files' sizes."""
    path = str(tmp_path_factory.mktemp("read_once") / "ckpt")
    want = run_distributed(_save, path, HSDP, world_size=4)[0]
    sizes = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".distcp")}
    return path, want, sizes


@pytest.mark.parametrize("layout", [HSDP, DDP], ids=["2x2", "4x1"])
def test_replicas_receive_what_one_replica_read(saved, layout):
    path, want, sizes = saved
    results = run_distributed(_load, path, layout, world_size=4)
    readers = [0, 1] if layout is HSDP else [0]  # coordinate 0 on dp_replicate
    for rank, (state, lr, reads) in enumerate(results):
        assert_equal_states(state, want)  # each replica's own full tensors
        assert lr == 0.01
        if rank not in readers:  # its own RNG file and the manifest only
            assert _data(reads) == 0, (rank, reads)
            assert set(reads) == {"shardbridge.json", os.path.basename(rng_file(rank))}, (rank, reads)
    total = sum(_data(reads) for _, _, reads in results)
    if layout is DDP:  # one reader, hashing every data file whole: each byte read once
        assert total == sum(sizes.values()), (total, sizes)
    else:  # each file hashed whole by one reader; the other reads the few scalar records (optimizer
        # steps, param_groups) it holds from it too: a few KB, 19% of this tiny model's bytes (< 1% at
        # 8 MB: tools/bench/bench_hsdp.py), against 100% more when every rank reads
        assert sum(sizes.values()) < total <= 1.25 * sum(sizes.values()), (total, sizes)


def test_every_rank_reads_when_the_state_is_not_replicated(saved):
    path, want, sizes = saved
    results = run_distributed(_load, path, {"dp_shard": 4}, world_size=4)
    assert all(_data(reads) > 0 for _, _, reads in results)
    assert_equal_states(results[3][0], want)


def _load_damaged(path: str):
    model, opt = build(HSDP, seed=7)
    try:
        ck.load(path, model=model, optimizer=opt)
    except ValueError as exc:
        return str(exc)
    return None


def test_damage_the_reader_finds_is_raised_on_every_rank(saved, tmp_path):
    path, _, sizes = saved
    import shutil

    damaged = tmp_path / "ckpt"
    shutil.copytree(path, damaged)
    name = max(sizes, key=sizes.get)
    with open(damaged / name, "r+b") as f:  # one byte in the middle of a data file
        f.seek(sizes[name] // 2)
        byte = f.read(1)
        f.seek(sizes[name] // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    for message in run_distributed(_load_damaged, str(damaged), world_size=4):
        assert message is not None and re.search(rf"{name}: checksum mismatch", message), message


def _with_nested(model, opt, fill: float):
    """A DTensor sharded over dp_replicate too, nested in the optimizer state (found by review: the
    replicas once received their reader's shard of it, silently)."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    p = next(iter(model.parameters()))
    dt = distribute_tensor(torch.arange(16.0).reshape(4, 4) + fill, p.device_mesh, [Shard(0), Shard(1)])
    opt.state[p]["extra"] = {"m": dt}


def _nested_round_trip(path: str, missed: bool):
    from shardbridge.checkpoint import _load as load_module

    model, opt = build(HSDP)
    _with_nested(model, opt, 0.0)
    ck.save(path, model=model, optimizer=opt, step=1)
    want = next(iter(opt.state.values()))["extra"]["m"].to_local().clone()
    model, opt = build(HSDP, seed=7, lr=0.5)
    _with_nested(model, opt, 1000.0)
    real = load_module._tensors_in
    if missed:  # the decision overlooks the nested DTensor: the boxes compared before sending stop it
        load_module._tensors_in = lambda value, depth=0: []
    try:
        ck.load(path, model=model, optimizer=opt)
    except ValueError as exc:
        return "raised", str(exc)
    finally:
        load_module._tensors_in = real  # the pool's processes run other tests next
    got = next(iter(opt.state.values()))["extra"]["m"].to_local()
    return "loaded", bool((got == want).all())


@pytest.mark.parametrize("missed", [False, True], ids=["decided", "decision-missed"])
def test_a_nested_dtensor_sharded_over_replicas_is_never_sent_to_the_wrong_rank(tmp_path, missed):
    results = run_distributed(_nested_round_trip, str(tmp_path / "c"), missed, world_size=4)
    if not missed:  # every rank reads: each gets its own shard
        assert results == [("loaded", True)] * 4, results
    else:
        assert all(kind == "raised" and "does not hold what its reader holds" in text for kind, text in results), results
