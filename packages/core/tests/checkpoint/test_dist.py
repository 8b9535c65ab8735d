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
    ck.save(f"{root}/base", model=model, step=1, overwrite=True)  # a checkpoint without optimizer state
    bad = dist.get_rank() == 2
    calls = {
        "save_extra_nan": lambda: ck.save(f"{root}/c", model=model, extra={"x": float("nan") if bad else 1.0}),
        "save_step": lambda: ck.save(f"{root}/c", model=model, step=-1 if bad else 3),
        "load_strict": lambda: ck.load(f"{root}/base", model=model, strict="yes" if bad else True),
        "load_optimizer": lambda: ck.load(
            f"{root}/base", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1) if bad else None
        ),
        # valid values that differ between ranks: rank 0's would be committed for everyone
        "save_path_differs": lambda: ck.save(f"{root}/c{'x' if bad else ''}", model=model),
        "save_step_differs": lambda: ck.save(f"{root}/c", model=model, step=4 if bad else 3),
        "save_extra_differs": lambda: ck.save(f"{root}/c", model=model, extra={"seen": 2 if bad else 1}),
        "load_rng_differs": lambda: ck.load(f"{root}/base", model=model, rng=not bad),
    }
    start = time.monotonic()
    try:
        calls[what]()
        outcome = "no error"
    except ValueError as exc:  # the failing rank catches its error and goes on
        outcome = str(exc)
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
    ],
)
def test_bad_argument_on_one_rank_raises_on_every_rank_within_seconds(tmp_path, what, match):
    # Before: rank 2 raised alone and the others waited in a collective (30 min by default).
    results = run_distributed(_bad_arg_on_rank2, str(tmp_path), what, world_size=4, timeout=25)
    for rank, (outcome, elapsed, after) in enumerate(results):
        assert match in outcome, (rank, outcome)
        if "differs" not in what:  # a value compare raises alike on every rank, naming both values
            assert ("[raised on rank 2" in outcome) == (rank != 2)
        assert elapsed < 10 and after == 7
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
