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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["barrier", "broadcast_from_rank0", "check_same_on_all_ranks", "is_distributed", "on_all_ranks", "rank", "world_size"]

T = TypeVar("T")

# Exception types re-raised as themselves on the ranks that did not fail.
_REPLAYED = (ValueError, NotImplementedError, FileExistsError, FileNotFoundError)


def is_distributed() -> bool:
    """Whether a default process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the default group (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """World size of the default group (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def barrier() -> None:
    """Barrier on the default group; a no-op in one process."""
    if is_distributed():
        dist.barrier()


def broadcast_from_rank0(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (a picklable object)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_all_ranks(fn: Callable[..., T], *args: Any, only_rank0: bool = False, **kwargs: Any) -> T | None:
    """Run ``fn`` (on every rank, or on rank 0 only) and raise on every rank if any failed.

    See [Note: symmetric errors]. Returns ``fn``'s result (None on the ranks that did not
    run it when ``only_rank0``).
    """
    result: T | None = None
    error: BaseException | None = None
    if not only_rank0 or rank() == 0:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 (re-raised below, on every rank)
            if not is_distributed():
                raise
            error = exc
    if not is_distributed():
        return result
    summary = None if error is None else (type(error).__name__, str(error))
    summaries: list[Any] = [None] * world_size()
    dist.all_gather_object(summaries, summary)
    if error is not None:
        raise error
    failed = [(r, s) for r, s in enumerate(summaries) if s is not None]
    if failed:
        first_rank, (type_name, message) = failed[0]
        replay = next((t for t in _REPLAYED if t.__name__ == type_name), RuntimeError)
        raise replay(f"{message} [raised on rank {first_rank}; {len(failed)} rank(s) failed]")
    return result


def check_same_on_all_ranks(where: str, values: dict[str, Any]) -> None:
    """ValueError on every rank if any argument in ``values`` differs between ranks.

    ``save(path=...)`` with a rank-dependent path (or step, extra ...) would otherwise commit
    rank 0's value for everyone without a word. One ``all_gather_object`` of the values'
    reprs; a no-op in one process.
    """
    if not is_distributed():
        return
    mine = {k: repr(v) for k, v in values.items()}
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, mine)
    for key in values:
        seen = {r: g[key] for r, g in enumerate(gathered) if g[key] != gathered[0][key]}
        if seen:
            other, value = next(iter(seen.items()))
            raise ValueError(
                f"{where}: {key} differs between ranks (rank 0: {gathered[0][key]}, rank {other}: {value}"
                f"{f', and {len(seen) - 1} more rank(s)' if len(seen) > 1 else ''}); every rank must pass the same "
                f"{key} (compute it on rank 0 and broadcast it, or from values all ranks share)"
            )
