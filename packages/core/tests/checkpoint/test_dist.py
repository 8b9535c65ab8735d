"""[Note: symmetric errors]: a failure on some ranks raises on every rank, never hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from shardbridge.checkpoint import _dist
from shardbridge.testing import run_distributed


def _fail_on(bad_rank: int, only_rank0: bool):
    def fn():
        if dist.get_rank() == bad_rank:
            raise ValueError(f"bad thing on {bad_rank}")
        return dist.get_rank()

    try:
        result = _dist.on_all_ranks(fn, only_rank0=only_rank0)
    except ValueError as exc:
        return f"ValueError: {exc}"
    # The next collective still lines up on every rank.
    return result, _dist.broadcast_from_rank0(dist.get_rank() * 10)


def test_error_on_one_rank_raises_on_all():
    results = run_distributed(_fail_on, 2, False, world_size=4)
    assert results[2] == "ValueError: bad thing on 2"
    for r in (0, 1, 3):
        assert results[r] == "ValueError: bad thing on 2 [raised on rank 2; 1 rank(s) failed]"


def test_only_rank0_runs_and_shares_success():
    assert run_distributed(_fail_on, 3, True, world_size=4) == [(0, 0), (None, 0), (None, 0), (None, 0)]
    results = run_distributed(_fail_on, 0, True, world_size=4)
    assert all(r.startswith("ValueError: bad thing on 0") for r in results)


def _share_all():
    rank = dist.get_rank()
    return _dist.one_round(lambda: {"big": [rank] * 1000, "part": rank * 7}, result="all", share=lambda v: v["part"])


def test_one_round_shares_a_part_of_every_ranks_result():
    results = run_distributed(_share_all, world_size=4)
    assert [own["big"][0] for own, _ in results] == [0, 1, 2, 3]  # each rank keeps its own whole result
    assert [every for _, every in results] == [[0, 7, 14, 21]] * 4  # and gets everyone's part
    assert _dist.one_round(lambda: {"part": 3}, result="all", share=lambda v: v["part"]) == ({"part": 3}, [3])


def _rounds_of_every_size():
    rank = dist.get_rank()
    out = []
    for big_on in (None, 2):  # every payload fits the one-collective buffer; or rank 2's does not
        mine = {"rank": rank, "blob": "x" * (10_000 if rank == big_on else 10), "empty": b""}
        out.append(_dist.all_gather(mine, small=True))
    out.append(_dist.broadcast_from_rank0(("small", rank)))
    out.append(_dist.broadcast_from_rank0(b"y" * 200_000 if rank == 0 else None)[-3:])
    out.append(_dist.gather_reduce(lambda: rank * 2, lambda parts: ("sum", sum(parts), "z" * 100_000))[:2])
    return out


def test_one_collective_rounds_fall_back_for_payloads_that_do_not_fit():
    # [Note: one-collective rounds]: a payload over the fixed buffer on any rank (every rank
    # sees the mark) goes through torch's object collective; the answer is the same.
    results = run_distributed(_rounds_of_every_size, world_size=4)
    for rank, (fits, big, small_bc, big_bc, reduced) in enumerate(results):
        assert [g["rank"] for g in fits] == [0, 1, 2, 3] and {len(g["blob"]) for g in fits} == {10}
        assert [len(g["blob"]) for g in big] == [10, 10, 10_000, 10] and big[2]["empty"] == b""
        assert small_bc == ("small", 0) and big_bc == b"yyy", rank
        assert reduced == ("sum", 12)


def _gather_rounds_with_errors():
    rank = dist.get_rank()

    def local_fails_on_2():
        if rank == 2:
            raise OSError(28, "disk full on 2")
        return rank

    def reduce_fails(parts):
        raise FileExistsError(f"rank 0 saw {parts}")

    out = []
    for call in (
        lambda: _dist.gather_reduce(local_fails_on_2, lambda parts: parts),
        lambda: _dist.gather_reduce(lambda: rank, reduce_fails),
    ):
        try:
            out.append(("ok", call()))
        except Exception as exc:  # noqa: BLE001
            out.append((type(exc).__name__, getattr(exc, "errno", None), str(exc)))
    out.append(_dist.broadcast_from_rank0(rank))  # the collectives still line up
    return out


def test_gather_rounds_raise_every_error_on_every_rank():
    results = run_distributed(_gather_rounds_with_errors, world_size=4)
    for rank, (local, reduced, after) in enumerate(results):
        assert local[:2] == ("OSError", 28) and "disk full on 2" in local[2], (rank, local)
        assert (rank == 2) == ("[raised on rank 2" not in local[2])
        assert reduced[0] == "FileExistsError" and "rank 0 saw [0, 1, 2, 3]" in reduced[2], (rank, reduced)
        assert after == 0


def test_without_process_group_errors_pass_through():
    assert _dist.rank() == 0 and _dist.world_size() == 1 and not _dist.is_distributed()
    with pytest.raises(KeyError):
        _dist.on_all_ranks(lambda: {}["x"])
    assert _dist.broadcast_from_rank0(5) == 5


# -- save / load check their arguments on every rank together --------------------------------


def _bad_arg_on_rank2(root: str, what: str):
    import time

    from shardbridge import checkpoint as ck
    from torch import nn

    model = nn.Linear(2, 2)
    # Built before the clock starts: a process's first optimizer imports torch._dynamo (10-20 s under load)
    opt = torch.optim.SGD(model.parameters(), lr=0.1) if "swapped" in what or "optimizer" in what else None
    ck.save(f"{root}/base", model=model, step=1, overwrite=True)  # a checkpoint without optimizer state
    bad = dist.get_rank() == 2
    calls = {
        "save_extra_nan": lambda: ck.save(f"{root}/c", model=model, extra={"x": float("nan") if bad else 1.0}),
        "save_step": lambda: ck.save(f"{root}/c", model=model, step=-1 if bad else 3),
        "load_strict": lambda: ck.load(f"{root}/base", model=model, strict="yes" if bad else True),
        "load_optimizer": lambda: ck.load(f"{root}/base", model=model, optimizer=opt if bad else None),
        # valid values that differ between ranks: rank 0's would be committed for everyone
        "save_path_differs": lambda: ck.save(f"{root}/c{'x' if bad else ''}", model=model),
        "save_step_differs": lambda: ck.save(f"{root}/c", model=model, step=4 if bad else 3),
        "save_extra_differs": lambda: ck.save(f"{root}/c", model=model, extra={"seen": 2 if bad else 1}),
        "load_rng_differs": lambda: ck.load(f"{root}/base", model=model, rng=not bad),
        # swapped arguments: one TypeError, raised by every rank before any collective
        "save_swapped": lambda: ck.save(f"{root}/c", model=opt if bad else model, optimizer=model if bad else opt),
        "load_swapped": lambda: ck.load(f"{root}/base", model=opt if bad else model),
    }
    start = time.monotonic()
    try:
        calls[what]()
        outcome = "no error"
    except (ValueError, TypeError) as exc:  # the failing rank catches its error and goes on
        outcome = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    # The next collective still lines up on every rank.
    return outcome, elapsed, _dist.broadcast_from_rank0(7)


@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("save_extra_nan", "extra['x'] is nan"),
        ("save_step", "step=-1 must be an int >= 0"),
        ("load_strict", "strict='yes' must be True or False"),
        ("load_optimizer", "has no optimizer state"),
        ("save_path_differs", "path differs between ranks (rank 0: "),
        ("save_step_differs", "step differs between ranks (rank 0: 3, rank 2: 4)"),
        ("save_extra_differs", "extra differs between ranks"),
        ("load_rng_differs", "rng differs between ranks (rank 0: True, rank 2: False)"),
        ("save_swapped", "TypeError: model must be a torch.nn.Module, got torch.optim.sgd.SGD; model and optimizer look"),
        ("load_swapped", "TypeError: model must be a torch.nn.Module, got torch.optim.sgd.SGD"),
    ],
)
def test_bad_argument_on_one_rank_raises_on_every_rank_within_seconds(tmp_path, what, match):
    # Before: rank 2 raised alone and the others waited in a collective (30 min by default).
    results = run_distributed(_bad_arg_on_rank2, str(tmp_path), what, world_size=4, timeout=60)
    for rank, (outcome, elapsed, after) in enumerate(results):
        assert match in outcome, (rank, outcome)
        if "differs" not in what:  # a value compare raises alike on every rank, naming both values
            assert ("[raised on rank 2" in outcome) == (rank != 2)
        assert elapsed < 25 and after == 7  # a rank left waiting would raise at the pool's 30 s timeout
    assert not (tmp_path / "c").exists() and not (tmp_path / "cx").exists()


def _os_error_on_rank0():
    import errno

    def fn():
        if dist.get_rank() == 0:
            raise PermissionError(errno.EROFS, "Read-only file system")
        return 1

    try:
        _dist.on_all_ranks(fn)
    except OSError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_an_os_error_on_one_rank_is_an_os_error_on_every_rank():
    """An ``except OSError:`` around a save runs on every rank, or on none (never splits the ranks)."""
    results = run_distributed(_os_error_on_rank0, world_size=4)
    assert results[0] == ("PermissionError", "[Errno 30] Read-only file system")
    for name, message in results[1:]:
        assert name == "PermissionError" and "[raised on rank 0; 1 rank(s) failed]" in message


@pytest.mark.parametrize(
    ("backend", "cpu"),
    [("gloo", True), ("nccl", False), ("cpu:gloo,cuda:nccl", True), ("cuda:nccl,cpu:gloo", True), ("cuda:gloo", False)],
)
def test_one_collective_rounds_only_on_groups_that_take_cpu_tensors(monkeypatch, backend, cpu):
    # [Note: one-collective rounds]: the fixed buffer is a CPU tensor; a default group that is
    # NCCL alone keeps torch's object collectives (they move the bytes to the GPU).
    monkeypatch.setattr(_dist.dist, "get_backend", lambda group=None: backend)
    assert _dist._cpu_collectives() is cpu


def _nccl_shaped_rank(rank: int, world: int, workdir: str) -> None:
    """One rank of a job whose default group takes no CPU tensors, as an NCCL-only one: its
    backend is "cuda:gloo" (on this CPU machine a CPU collective on it raises and an object
    collective tries the GPU). [Note: the checkpoint group]: the checkpoint runs on its own gloo
    side group. The model lives on a gloo group of its own (NCCL's, on a GPU job)."""
    import json
    from datetime import timedelta
    from pathlib import Path

    import shardbridge.checkpoint as ck
    from ckpt_helpers import Mlp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    new_group, made, objects = dist.new_group, [], []
    dist.new_group = lambda *a, **k: made.append(k.get("backend")) or new_group(*a, **k)
    def counted(name, real):
        return lambda *a, **k: objects.append(name) or real(*a, **k)

    for name in ("all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list"):
        setattr(dist, name, counted(name, getattr(dist, name)))

    def build(mesh, seed):
        torch.manual_seed(seed)
        model = fully_shard(Mlp(), mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for p in model.parameters():
            p.grad = torch.rand_like(p)
        opt.step()
        return model, opt

    report = {}
    for job in range(2):  # after destroy_process_group, the next default group gets a side group of its own
        dist.init_process_group(
            "cuda:gloo", init_method=f"file://{workdir}/init-{job}", rank=rank, world_size=world,
            timeout=timedelta(seconds=30),
        )  # fmt: skip
        assert dist.get_backend() == "cuda:gloo"
        mesh = DeviceMesh.from_group(new_group(backend="gloo"), "cpu")
        model, opt = build(mesh, seed=job)
        root = Path(workdir) / f"job{job}"
        ck.save(ck.step_dir(root, 1), model=model, optimizer=opt, step=1)
        side = _dist.group()
        ck.save(ck.step_dir(root, 2), model=model, optimizer=opt, step=2, async_=True).wait()
        fresh, fresh_opt = build(mesh, seed=job + 10)
        state = ck.load_latest(root, model=fresh, optimizer=fresh_opt)
        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731 (DTensor's equal is a collective)
        exact = all(torch.equal(local(a), local(b)) for a, b in zip(model.parameters(), fresh.parameters()))
        exact &= all(
            torch.equal(local(a), local(b))
            for p, q in zip(model.parameters(), fresh.parameters())
            for a, b in zip(opt.state[p].values(), fresh_opt.state[q].values())
        )
        report[job] = {
            "step": state.step, "exact": exact, "groups": list(made), "objects": list(objects),
            "side": dist.get_backend(side), "reused": _dist.group() is side,
        }  # fmt: skip
        made.clear()
        objects.clear()
        dist.destroy_process_group()
    Path(workdir, f"rank-{rank}.json").write_text(json.dumps(report))


def test_a_default_group_without_a_cpu_backend_checkpoints_on_a_gloo_side_group(tmp_path):
    """A real 2-process job whose default group is NCCL-shaped: save, async save and load_latest
    round-trip bit-exact with no object collective (the fixed-size rounds), one side group per
    default group for the checkpoint and one for the async writer, each made once."""
    import json
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    procs = [ctx.Process(target=_nccl_shaped_rank, args=(rank, 2, str(tmp_path))) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=240)
        if proc.is_alive():
            proc.kill()
    assert [proc.exitcode for proc in procs] == [0, 0]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        for job in ("0", "1"):
            got = report[job]
            assert got["step"] == 2 and got["exact"], got
            assert got["groups"] == ["gloo", "gloo"], got  # the checkpoint's side group, then the async writer's
            assert got["objects"] == [], got  # only fixed-size collectives
            assert got["side"] == "gloo" and got["reused"], got
