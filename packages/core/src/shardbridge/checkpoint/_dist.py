"""Collective helpers that keep every checkpoint code path symmetric across ranks.

[Note: symmetric errors]
~~~~~~~~~~~~~~~~~~~~~~~~
A rank that raises while the others enter a collective hangs the job until the process
group times out. Every step of save/load that may fail on some ranks only (a layout that is
bad on some coordinates, a file one rank cannot write, rank 0's directory checks) runs inside
:func:`on_all_ranks`: each rank runs the step, the ranks all-gather "ok or which error", and
if any rank failed, EVERY rank raises (the failing rank its own exception, the others a copy
naming the failing rank). DCP's own save/load do the same internally (``_DistWrapper``).
Without an initialised process group (one process) these helpers are plain calls.

The collectives run on the default group, or on the group :func:`using_group` sets for the
calling thread: an asynchronous save's writer thread uses its own gloo group, so that its
collectives never interleave with the training thread's (see [Note: async save] in
``_async.py``).
"""

from __future__ import annotations

import hashlib
import pickle
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "all_gather",
    "barrier",
    "gather_reduce",
    "broadcast_from_rank0",
    "check_same_on_all_ranks",
    "group",
    "is_distributed",
    "on_all_ranks",
    "one_round",
    "rank",
    "replay",
    "summary",
    "using_group",
    "world_size",
]

T = TypeVar("T")
_THREAD = threading.local()


def group() -> Any:
    """The process group this thread's checkpoint collectives use (None = the default group)."""
    return getattr(_THREAD, "group", None)


@contextmanager
def using_group(pg: Any, *, rank: int | None = None, world_size: int | None = None) -> Iterator[None]:
    """Run this thread's checkpoint collectives on ``pg`` (a group of every rank) inside the block.

    ``rank`` / ``world_size``: what :func:`rank`, :func:`world_size` and :func:`is_distributed`
    answer in this thread inside the block (an asynchronous save's writer fixes them when it
    starts: a ``destroy_process_group`` meanwhile must make its collectives fail, not turn it
    into a one-process save of this rank's files).
    """
    previous = (group(), getattr(_THREAD, "rank", None), getattr(_THREAD, "world_size", None))
    _THREAD.group, _THREAD.rank, _THREAD.world_size = pg, rank, world_size
    try:
        yield
    finally:
        _THREAD.group, _THREAD.rank, _THREAD.world_size = previous


# [Note: one-collective rounds]
# torch's all_gather_object / broadcast_object_list are two collectives each (the sizes, then
# the padded bytes): ~7.6 ms against ~4.3 ms for one fixed-size all_gather on 4 processes
# sharing 2 cores. A round whose payload is usually small (arguments, a path, an error, an
# outcome) sends it in ONE collective of a fixed-size buffer: an 8-byte length, then the
# pickle. A payload that does not fit is marked so (every rank sees every mark), and the
# round falls back to torch's object collective: correct for any size, one collective more.
# The buffer is a CPU tensor: only a group with a gloo backend takes it (a job whose default
# group is NCCL alone uses torch's object collectives, which move the bytes to the GPU).
_SMALL_GATHER_BYTES = 4 << 10
"""Per rank, for all-gathers (the buffer is world_size times this on every rank)."""
_SMALL_BROADCAST_BYTES = 64 << 10
_TOO_BIG = (1 << 64) - 1


def _cpu_collectives() -> bool:
    """Whether the checkpoint group takes CPU tensors (a gloo backend, alone or beside NCCL)."""
    try:
        backend = str(dist.get_backend(group())).lower()
    except (RuntimeError, ValueError):
        return False
    if ":" not in backend:  # one backend for every device
        return backend == "gloo"
    devices = dict(pair.split(":", 1) for pair in backend.split(",") if ":" in pair)  # "cpu:gloo,cuda:nccl"
    return devices.get("cpu") == "gloo"


def _pack(obj: Any, capacity: int) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = torch.zeros(8 + capacity, dtype=torch.uint8)
    fits = len(data) <= capacity
    buf[:8] = torch.frombuffer(bytearray((len(data) if fits else _TOO_BIG).to_bytes(8, "little")), dtype=torch.uint8)
    if fits and data:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _length(buf: torch.Tensor) -> int:
    return int.from_bytes(buf[:8].numpy().tobytes(), "little")


def _unpack(buf: torch.Tensor) -> Any:
    # The peers' own pickles, as in torch's object collectives (never data from disk).
    return pickle.loads(buf[8 : 8 + _length(buf)].numpy().tobytes())


def all_gather(obj: Any, *, small: bool = False) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` in one process).

    ``small``: the payloads are usually a few KB: one collective ([Note: one-collective rounds]).
    """
    if not is_distributed():
        return [obj]
    if small and _cpu_collectives():
        buf = _pack(obj, _SMALL_GATHER_BYTES)
        bufs = [torch.empty_like(buf) for _ in range(world_size())]
        dist.all_gather(bufs, buf, group=group())
        if all(_length(b) != _TOO_BIG for b in bufs):
            return [_unpack(b) for b in bufs]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=group())
    return out


def _broadcast(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank, in one collective when it is small (see above)."""
    if not _cpu_collectives():
        box = [obj]
        dist.broadcast_object_list(box, src=_rank0(), group=group())
        return box[0]
    buf = (
        _pack(obj, _SMALL_BROADCAST_BYTES)
        if rank() == 0
        else torch.empty(8 + _SMALL_BROADCAST_BYTES, dtype=torch.uint8)
    )
    dist.broadcast(buf, src=_rank0(), group=group())
    if _length(buf) != _TOO_BIG:
        return _unpack(buf)
    box = [obj]
    dist.broadcast_object_list(box, src=_rank0(), group=group())
    return box[0]


# Exception types re-raised as themselves on the ranks that did not fail.
_REPLAYED = (ValueError, NotImplementedError, FileExistsError, FileNotFoundError, PermissionError, OSError)


def is_distributed() -> bool:
    """Whether a default process group with more than one rank is initialised (or fixed for this thread)."""
    fixed = getattr(_THREAD, "world_size", None)
    if fixed is not None:
        return fixed > 1
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the default group (0 without a process group; or fixed for this thread)."""
    fixed = getattr(_THREAD, "rank", None)
    if fixed is not None:
        return fixed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """World size of the default group (1 without a process group; or fixed for this thread)."""
    fixed = getattr(_THREAD, "world_size", None)
    if fixed is not None:
        return fixed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """Barrier on the default group; a no-op in one process."""
    if is_distributed():
        dist.barrier(group=group())


def broadcast_from_rank0(obj: T, *, large: bool = False) -> T:
    """Rank 0's ``obj`` on every rank (a picklable object).

    ``large``: usually more than the one-collective buffer holds (a ``.metadata``): torch's object
    broadcast directly, so the round is the same collective whatever the size (not one that falls
    back to a second when the object outgrows the buffer).
    """
    if not is_distributed():
        return obj
    if large:
        box = [obj]
        dist.broadcast_object_list(box, src=_rank0(), group=group())
        return box[0]
    return _broadcast(obj)


def on_all_ranks(fn: Callable[..., T], *args: Any, only_rank0: bool = False, **kwargs: Any) -> T | None:
    """Run ``fn`` (on every rank, or on rank 0 only) and raise on every rank if any failed.

    See [Note: symmetric errors]. Returns ``fn``'s result (None on the ranks that did not
    run it when ``only_rank0``).
    """
    return one_round(fn, args, kwargs, only_rank0=only_rank0)


def one_round(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
    *,
    only_rank0: bool = False,
    result: str = "own",
    same: tuple[str, dict[str, Any]] | None = None,
    share: Callable[[Any], Any] | None = None,
    small: bool | None = None,
    all_of: Callable[[Any], bool] | None = None,
    agree: Callable[[Any], int] | None = None,
) -> Any:
    """:func:`on_all_ranks` with more riding on its one round.

    Every collective round costs ~10 ms on 4 processes sharing 2 cores, so the checks of a
    save or load share rounds (see docs/benchmarks.md, checkpoint throughput).

    Args:
        fn: run on every rank (or rank 0 only).
        args: positional arguments of ``fn``.
        kwargs: keyword arguments of ``fn``.
        only_rank0: run ``fn`` on rank 0 only.
        result: "own" (this rank's result; None where ``fn`` did not run), "rank0" (rank 0's
            result, picklable, on every rank) or "all" (every rank's, in rank order).
        same: ``(where, values)``: also raise on every rank, as :func:`check_same_on_all_ranks`
            does, if these values differ between ranks (checked after ``fn``'s errors).
        share: with ``result="own"``: return ``(own result, share(rank 0's result))``, the
            second picklable, on every rank; with ``result="all"``: return ``(own result,
            [share(each rank's result)])`` (a part of every rank's result, in rank order).
        small: the round's payload is usually a few KB ([Note: one-collective rounds]);
            None = when nothing but errors and ``same`` travels.
        all_of: also return whether ``all_of(result)`` is true on every rank: the return
            value becomes ``(what it would be, every_true)``.
        agree: also return whether ``agree(result)`` (an int in [0, 2**62)) is the same on every
            rank: the return value becomes ``(what it would be, every_true, agreed)`` (every_true
            is True without ``all_of``).

    With ``result`` "own" or "rank0" on a gloo group the round is one all-reduce of a fixed
    few bytes (plus a broadcast of rank 0's shared value), whatever the world size; only when
    a rank failed or ``same`` differs do the ranks then gather every rank's error or values to
    name them. See [Note: constant-size rounds].
    """
    assert result in ("own", "rank0", "all"), result
    value: Any = None
    error: BaseException | None = None
    if not only_rank0 or rank() == 0:
        try:
            value = fn(*args, **(kwargs or {}))
        except Exception as exc:  # noqa: BLE001 (re-raised below, on every rank)
            if not is_distributed():
                raise
            error = exc
    flag = error is None and (all_of is None or bool(all_of(value)))
    accord = 0 if error is not None or agree is None else int(agree(value))

    def out(answer: Any, every_true: bool, agreed: bool = True) -> Any:
        if agree is not None:
            return answer, every_true, agreed
        return answer if all_of is None else (answer, every_true)

    if not is_distributed():
        if share is not None:
            return out((value, ([share(value)] if result == "all" else share(value))), flag)
        return out([value] if result == "all" else value, flag)
    mine = None if same is None else {k: repr(v) for k, v in same[1].items()}
    if result != "all" and _cpu_collectives():
        ok, every_true, agreed = _status(error is not None, mine, flag, accord)
        if ok:  # nobody failed, same arguments: rank 0's shared value is all that travels
            if result == "rank0" or share is not None:
                shared = _broadcast((value if result == "rank0" else share(value)) if rank() == 0 else None)
                return out(shared if result == "rank0" else (value, shared), every_true, agreed)
            return out(value, every_true, agreed)
    # The replayed type: the error's own if listed, else the first listed base it has.
    failure = None if error is None else summary(error)
    shared = value if error is None and (result == "all" or (result == "rank0" and rank() == 0)) else None
    if share is not None and error is None and (rank() == 0 or result == "all"):
        shared = share(value)
    if small is None:
        small = result == "own" and share is None
    gathered = all_gather((failure, shared, mine, flag, accord), small=small)
    if error is not None:
        raise error
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
    if failed:
        raise replay(failed)
    if same is not None:
        _raise_if_different(same[0], [g[2] for g in gathered])
    every_true = all(g[3] for g in gathered)
    agreed = len({g[4] for g in gathered}) == 1
    if result == "all":
        every = [g[1] for g in gathered]
        return out(every if share is None else (value, every), every_true, agreed)
    if share is not None:
        return out((value, gathered[0][1]), every_true, agreed)
    return out(gathered[0][1] if result == "rank0" else value, every_true, agreed)


# [Note: constant-size rounds]
# A round whose outcome is "did anyone fail, do the arguments agree, is X true everywhere"
# needs no rank's payload: one all-reduce (MIN) of six int64s answers it, the same bytes on
# every rank at any world size (an all-gather of a fixed 4 KB buffer per rank is 64 MB per
# rank at 16,384 ranks). Only when a rank failed or the arguments differ, which every rank
# then knows alike, do the ranks gather every rank's error or arguments, to name them: the
# slow path is the error path. Measured by tools/bench/bench_scale.py (docs/benchmarks.md, "Scale").
def _status(failed: bool, same: dict[str, str] | None, flag: bool, accord: int = 0) -> tuple[bool, bool, bool]:
    """(nobody failed and ``same`` agrees everywhere, ``flag`` is true on every rank, ``accord``
    is the same on every rank): one all-reduce."""
    digest = hashlib.blake2b(repr(sorted((same or {}).items())).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") & ((1 << 62) - 1)
    values = [rank() if failed else world_size(), h, -h, int(flag), accord, -accord]
    status = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(status, op=dist.ReduceOp.MIN, group=group())
    first_failed, low, minus_high, every, low2, minus_high2 = (int(x) for x in status)
    return first_failed == world_size() and low == -minus_high, every == 1, low2 == -minus_high2


def summary(error: BaseException) -> tuple[str, str, int | None]:
    """What the other ranks need to replay ``error``: (type name, message, errno)."""
    code = error.errno if isinstance(error, OSError) and isinstance(error.errno, int) else None
    return _replay_name(error), str(error), code


def replay(failed: list[tuple[int, tuple[str, str, int | None]]]) -> Exception:
    """The exception a rank that did not fail raises for the failed ranks' summaries (rank order)."""
    first_rank, (type_name, message, code) = failed[0]
    replay = next((t for t in _REPLAYED if t.__name__ == type_name), RuntimeError)
    error = replay(f"{message} [raised on rank {first_rank}; {len(failed)} rank(s) failed]")
    if code is not None and isinstance(error, OSError):
        error.errno = code
    return error


def gather_reduce(local: Callable[[], Any], reduce: Callable[[list[Any]], Any], *, small: bool = False) -> Any:
    """``local()`` on every rank, ``reduce(every rank's value)`` on rank 0, its result on every rank.

    DCP's "write" round, with [Note: symmetric errors]: two collectives whose payload grows
    with the world size on rank 0 only (a gather, then a broadcast of the outcome), where
    :func:`one_round`'s all-gather would send every rank's value to every rank. ``reduce``
    runs only when every ``local`` succeeded; any error is raised on every rank (its own on
    the rank that raised it). Without a process group: ``reduce([local()])``.

    ``small``: the values are usually under ``_SMALL_RECORDS_BYTES``: one fixed-size gather
    ([Note: fixed-size gather]).
    """
    if not is_distributed():
        return reduce([local()])
    value, error = _attempt(local)
    mine = (None if error is None else summary(error), value)
    parts: list[Any] | None = [None] * world_size() if rank() == 0 else None
    if small and _cpu_collectives():
        buf = _pack(mine, _SMALL_RECORDS_BYTES)
        bufs = [torch.empty_like(buf) for _ in range(world_size())] if rank() == 0 else None
        dist.gather(buf, bufs, dst=_rank0(), group=group())
        resend: list[int] = []
        if bufs is not None and parts is not None:
            # every rank's buffer at once: one copy, one view of the lengths (16,384 ranks: ~0.1 s, not ~1 s)
            stacked = torch.stack(bufs)
            lengths = stacked[:, :8].contiguous().view(torch.int64).flatten().tolist()  # little-endian, as _pack
            raw = stacked.numpy().tobytes()
            width = stacked.shape[1]
            for r, n in enumerate(lengths):
                if n == -1:  # _TOO_BIG, read through a signed view
                    resend.append(r)
                else:
                    parts[r] = pickle.loads(raw[r * width + 8 : r * width + 8 + n])  # the peers' own pickles
        kind, payload = _broadcast(("resend", resend) if resend else _outcome(parts, reduce))
        if kind == "resend":  # the slow path: these ranks' values did not fit
            more: list[Any] | None = [None] * world_size() if rank() == 0 else None
            dist.gather_object(mine if rank() in payload else None, more, dst=_rank0(), group=group())
            if parts is not None and more is not None:
                for r in payload:
                    parts[r] = more[r]
            kind, payload = _broadcast(_outcome(parts, reduce))
    else:
        dist.gather_object(mine, parts, dst=_rank0(), group=group())
        kind, payload = _broadcast(_outcome(parts, reduce))
    if error is not None:
        raise error
    if kind == "failed":
        raise replay(payload)
    return payload


def _outcome(parts: list[Any] | None, reduce: Callable[[list[Any]], Any]) -> Any:
    """Rank 0: ("failed", [(rank, summary)]) or ("ok", reduce(values)); None on the other ranks."""
    if parts is None:
        return None
    failed = [(r, p[0]) for r, p in enumerate(parts) if p[0] is not None]
    if not failed:
        result, error = _attempt(lambda: reduce([p[1] for p in parts]))
        if error is None:
            return ("ok", result)
        failed = [(0, summary(error))]
    return ("failed", failed)


# [Note: fixed-size gather]
# torch's gather_object first all-gathers every rank's pickle size (one int64 per rank to EVERY
# rank: 128 KB per rank at 16,384 ranks, growing with the world), then gathers the pickles
# padded to the largest. A write round's values (a rank's file records) are a few hundred
# bytes, so they go in ONE gather of a fixed-size buffer: every rank sends the same bytes at any
# world size, rank 0 receives world x the buffer. A value that does not fit is marked; rank 0
# names those ranks in a broadcast (which the round needs anyway, for "resend"), and they alone
# send their value through torch's gather_object.
_SMALL_RECORDS_BYTES = 1 << 10


def _attempt(fn: Callable[[], Any]) -> tuple[Any, Exception | None]:
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 (re-raised by the caller, on every rank)
        return None, exc


def _rank0() -> int:
    """The global rank of the checkpoint group's rank 0 (the groups span every rank)."""
    pg = group()
    return 0 if pg is None else dist.get_global_rank(pg, 0)


def _replay_name(error: BaseException) -> str:
    if type(error) in _REPLAYED:
        return type(error).__name__
    return next((t.__name__ for t in _REPLAYED if isinstance(error, t)), type(error).__name__)


def check_same_on_all_ranks(where: str, values: dict[str, Any]) -> None:
    """ValueError on every rank if any argument in ``values`` differs between ranks.

    ``save(path=...)`` with a rank-dependent path (or step, extra ...) would otherwise commit
    rank 0's value for everyone without a word. One ``all_gather_object`` of the values'
    reprs; a no-op in one process.
    """
    if not is_distributed():
        return
    _raise_if_different(where, all_gather({k: repr(v) for k, v in values.items()}))


def _raise_if_different(where: str, gathered: list[dict[str, str]]) -> None:
    for key in gathered[0]:
        seen = {r: g[key] for r, g in enumerate(gathered) if g[key] != gathered[0][key]}
        if seen:
            other, value = next(iter(seen.items()))
            raise ValueError(
                f"{where}: {key} differs between ranks (rank 0: {gathered[0][key]}, rank {other}: {value}"
                f"{f', and {len(seen) - 1} more rank(s)' if len(seen) > 1 else ''}); every rank must pass the same "
                f"{key} (compute it on rank 0 and broadcast it, or from values all ranks share)"
            )
