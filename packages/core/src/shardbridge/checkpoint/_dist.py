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

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "all_gather",
    "barrier",
    "broadcast_from_rank0",
    "check_same_on_all_ranks",
    "group",
    "is_distributed",
    "on_all_ranks",
    "one_round",
    "rank",
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


def all_gather(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` in one process)."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=group())
    return out


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


def broadcast_from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (a picklable object)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group())
    return box[0]


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
) -> Any:
    """:func:`on_all_ranks` with more riding on its one ``all_gather_object``.

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
            second picklable, on every rank.
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
    if not is_distributed():
        if share is not None:
            return value, share(value)
        return [value] if result == "all" else value
    # The replayed type: the error's own if listed, else the first listed base it has.
    summary = None if error is None else (_replay_name(error), str(error))
    shared = value if error is None and (result == "all" or (result == "rank0" and rank() == 0)) else None
    if share is not None and error is None and rank() == 0:
        shared = share(value)
    mine = None if same is None else {k: repr(v) for k, v in same[1].items()}
    gathered = all_gather((summary, shared, mine))
    if error is not None:
        raise error
    failed = [(r, g[0]) for r, g in enumerate(gathered) if g[0] is not None]
    if failed:
        first_rank, (type_name, message) = failed[0]
        replay = next((t for t in _REPLAYED if t.__name__ == type_name), RuntimeError)
        raise replay(f"{message} [raised on rank {first_rank}; {len(failed)} rank(s) failed]")
    if same is not None:
        _raise_if_different(same[0], [g[2] for g in gathered])
    if result == "all":
        return [g[1] for g in gathered]
    if share is not None:
        return value, gathered[0][1]
    return gathered[0][1] if result == "rank0" else value


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
