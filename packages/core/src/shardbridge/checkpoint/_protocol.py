"""How the ranks of a save coordinate: which rank sends what, in how many collective rounds.

[Note: save protocols]
~~~~~~~~~~~~~~~~~~~~~~
A save's storage (``storage/``: DCP's ``StorageWriter`` on a backend) does not know who plans or
how the ranks talk; a save protocol drives it exactly as ``dcp.save`` drives any storage writer
(``set_up_storage_writer``, ``prepare_global_plan``, ``write_data`` on every rank, ``finish`` on
rank 0), so the planning can be replaced without touching storage. ``save(protocol=...)`` picks
one (:data:`PROTOCOLS`):

- ``"derived"`` (the default, :class:`~shardbridge.checkpoint.derived.DerivedSave`): no plan
  round; every rank derives the global plan from the mesh and rank 0 derives every storage
  record from the file rule ([Note: the derived protocol] in ``derived/_save.py``); a save it
  cannot derive (not SPMD, a framework's own boxes) runs as ``"dcp"``;
- ``"dcp"`` (:class:`DCPSave`): ``dcp.save`` itself with shardbridge's planner and writer, and
  DCP's own plan caching (``DefaultSavePlanner(enable_plan_caching=True)``, under a key per
  process group): a plan round (gather + scatter) and a write round (gather + broadcast), each
  two object collectives.

Either way the save's errors are symmetric: every rank raises (the failing rank its own error,
the others a copy naming it), and the manifest is written by rank 0 inside the write round,
after every rank's files are durable. What each protocol sends per rank, measured from 8 to
16,384 ranks, is in docs/benchmarks.md ("Scale"), with why "derived" is the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.state._chunks import SavePlanner
from shardbridge.checkpoint.storage._writer import Writer

__all__ = ["DCPSave", "SaveProtocol"]


class SaveProtocol(Protocol):
    """A way to run DCP's save steps across the ranks. See [Note: save protocols]."""

    name: str

    def local(self, dcp_state: dict[str, Any]) -> Any:
        """In the save's argument round (an asynchronous save: in its writer thread, on the
        host snapshot): what this rank keeps for :meth:`save`. No collectives, no thread-local
        or device state (it may run on another thread than the caller's)."""
        ...

    def save(self, dcp_state: dict[str, Any], writer: Writer, local: Any, derived: bool = False) -> None:
        """Plan, write, ``.metadata`` and commit (``writer.finish`` on rank 0); raises on every rank.

        ``derived``: every rank's :meth:`digest` agreed and is not 0 (round 1).
        """
        ...

    def digest(self, local: Any) -> int:
        """What round 1 compares across ranks (0: this rank cannot derive the global plan)."""
        ...


@dataclass
class DCPSave:
    """``dcp.save`` with shardbridge's planner and writer. See [Note: save protocols]."""

    name: str = "dcp"

    def local(self, dcp_state: dict[str, Any]) -> Any:
        """Nothing ahead: DCP plans in its own round."""
        return None

    def digest(self, local: Any) -> int:
        """DCP plans in its own round: nothing to derive."""
        return 0

    def save(self, dcp_state: dict[str, Any], writer: Writer, local: Any, derived: bool = False) -> None:
        """One ``dcp.save``; its ``CheckpointException`` becomes the failing rank's error on every rank."""
        planner = SavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = f"shardbridge:{_key()}"  # DCP caches plans per key, process-wide
        try:
            with _dist.foreign():  # DCP's own rounds: see [Note: collective entry points] in _dist.py
                dcp.save(
                    dcp_state,
                    storage_writer=writer,
                    planner=planner,
                    process_group=_dist.group(),
                    no_dist=not _dist.is_distributed(),
                )
        except CheckpointException as exc:
            raise _symmetric(exc) from None


def _symmetric(exc: CheckpointException) -> BaseException:
    """The error of a ``dcp.save`` on this rank: its own if it failed, else the first failed rank's, replayed."""
    failures = sorted(exc.failures.items())
    mine = dict(failures).get(_dist.rank())
    if mine is not None:
        return mine[0] if isinstance(mine, tuple) else mine
    if not failures:
        return RuntimeError(str(exc))
    summaries = []
    for rank, failure in failures:
        cause = failure[0] if isinstance(failure, tuple) else failure
        summaries.append((rank, _dist.summary(cause)))
    return _dist.replay(summaries)


def _key() -> str:
    """The job's identity for plan caches: rank, world size and the default group (the same in the
    training thread and in an asynchronous save's writer thread; one save runs at a time)."""
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    return f"{_dist.rank()}/{_dist.world_size()}/{getattr(world, 'group_name', None)}"
