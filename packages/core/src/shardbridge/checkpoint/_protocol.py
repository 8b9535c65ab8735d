"""How the ranks of a save coordinate: which rank sends what, in how many collective rounds.

[Note: save protocols]
~~~~~~~~~~~~~~~~~~~~~~
A save's storage (``storage/``: DCP's ``StorageWriter`` on a backend) does not know who plans or
how the ranks talk; a save protocol drives it exactly as ``dcp.save`` drives any storage writer
(``set_up_storage_writer``, ``prepare_global_plan``, ``write_data`` on every rank, ``finish`` on
rank 0), so the planning can be replaced without touching storage. Three protocols:

- :class:`~shardbridge.checkpoint._derived.Derived` (``PROTOCOL``): no plan round; every rank
  derives the global plan from the mesh and rank 0 derives every storage record from the file
  rule ([Note: the derived protocol] in ``_derived.py``); falls back to :class:`OwnRounds` for a
  save it cannot derive;
- :class:`DCPSave`: ``dcp.save`` itself with shardbridge's planner and writer, and DCP's own plan
  caching (``DefaultSavePlanner(enable_plan_caching=True)``, under a key per process group): a
  plan round (gather + scatter) and a write round (gather + broadcast), each two object
  collectives;
- :class:`OwnRounds`: the same two steps in shardbridge's collectives ([Note: one-collective
  rounds] in ``_dist.py``), the plan round skipped when no rank's local plan changed since the
  job's last save (each rank compares its plan in the save's argument round, which runs anyway).

Either way the save's errors are symmetric: every rank raises (the failing rank its own error,
the others a copy naming it), and the manifest is written by rank 0 inside the write round,
after every rank's files are durable.

[Note: scale]
~~~~~~~~~~~~~
What travels in one save and one load, per rank, as ``tools/bench/bench_scale.py`` counts it
(rank 0 of up to 16,384 simulated ranks; docs/benchmarks.md, "Scale"):

- save, argument round: one all-reduce of six int64s ("anyone failed, arguments equal, every
  plan unchanged, every rank's layout digest equal"; [Note: constant-size rounds] in
  ``_dist.py``) and a broadcast of rank 0's target: the same bytes on every rank at any world
  size;
- save, write round (:class:`~shardbridge.checkpoint._derived.Derived`): one fixed-size gather
  of each rank's file records (1 KiB; [Note: fixed-size gather] in ``_dist.py``) and a broadcast
  of the outcome. Rank 0 receives world x 1 KiB and derives the rest; its work is the distinct
  boxes ``.metadata`` must list, as tensor operations (no Python object per box);
- load of a derived save (the default): one all-reduce, each rank derives every storage record
  from the manifest ([Note: derived loads] in ``_derived.py``) and plans its own reads
  (``dcp.load(no_dist=True)``: a load, resharding or not, gathers no plans), one all-reduce: 96
  bytes per rank at any world size, no rank reads ``.metadata``;
- load of any other checkpoint (a save that fell back to the gathered rounds, an older
  shardbridge): as above, but rank 0 reads ``.metadata`` (restricted reader) and broadcasts it
  between the two all-reduces (each rank receives it once).

Still growing with the world size: the records themselves (one per distinct box, as DCP's
format requires: 272 MB of ``.metadata`` for Llama-3 405B with AdamW state at 16,384 ranks),
which rank 0 streams into ``.metadata`` at a save and every rank of a derived load computes
(tensor operations) to plan its reads; and the manifest's file records (one per file).

[Note: why this protocol]
~~~~~~~~~~~~~~~~~~~~~~~~~
``PROTOCOL`` is :class:`~shardbridge.checkpoint._derived.Derived`: at 4 real ranks it costs what
the gathered rounds cost (``tools/bench/bench_checkpoint.py``, 97 MB, 2026-11-28: 1.09x their
throughput by medians, 0.99x paired, 0.96x their CPU time; docs/benchmarks.md, "Trend": 0.98-1.48x
plain DCP's save at 4-16 processes after a job's first save), and from a few hundred ranks on
it is the only one whose rounds and per-rank bytes do not grow with the world size
(``tools/bench/bench_scale.py``; docs/benchmarks.md, "Scale"). It stays behind this seam only
while the benchmarks show it pays.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.state._chunks import SavePlanner
from shardbridge.checkpoint.storage._writer import Writer

__all__ = ["PROTOCOL", "PROTOCOLS", "DCPSave", "OwnRounds", "SaveProtocol"]


class SaveProtocol(Protocol):
    """A way to run DCP's save steps across the ranks. See [Note: save protocols]."""

    name: str

    def local(self, dcp_state: dict[str, Any]) -> tuple[Any, bool]:
        """In the save's argument round: (what this rank keeps for :meth:`save`, "my plan is unchanged")."""
        ...

    def save(self, dcp_state: dict[str, Any], writer: Writer, local: Any, unchanged: bool, derived: bool = False) -> None:
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

    def local(self, dcp_state: dict[str, Any]) -> tuple[Any, bool]:
        """Nothing ahead: DCP plans in its own round."""
        return None, False

    def digest(self, local: Any) -> int:
        """DCP plans in its own round: nothing to derive."""
        return 0

    def save(self, dcp_state: dict[str, Any], writer: Writer, local: Any, unchanged: bool, derived: bool = False) -> None:
        """One ``dcp.save``; its ``CheckpointException`` becomes the failing rank's error on every rank."""
        planner = SavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = f"shardbridge:{_key()}"  # DCP caches plans per key, process-wide
        try:
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
    return f"{_dist.rank()}/{_dist.world_size()}/{id(world)}"


@dataclass
class OwnRounds:
    """DCP's planner and the writer in shardbridge's collectives. See [Note: save protocols]."""

    name: str = "rounds"
    plans: dict[str, Any] | None = None
    """The last save's plans, per process: ``key``, ``local`` (this rank's local plan), ``central``
    (its part of the global plan), ``metadata`` (rank 0)."""

    def local(self, dcp_state: dict[str, Any]) -> tuple[Any, bool]:
        """This rank's local plan, and whether it equals the last save's (same process group)."""
        _, plan, unchanged = self.planned(dcp_state)
        return plan, unchanged

    def planned(self, dcp_state: dict[str, Any]) -> tuple[SavePlanner, SavePlan, bool]:
        """:meth:`local`, with the planner that made the plan (its ``state_dict`` is the flattened state)."""
        planner = SavePlanner()
        planner.set_up_planner(state_dict=dcp_state, storage_meta=None, is_coordinator=_dist.rank() == 0)
        plan = planner.create_local_plan()
        plans = self.plans or {}
        return planner, plan, plans.get("key") == _key() and plans.get("local") == plan

    def digest(self, local: Any) -> int:
        """The plan round gathers every plan: nothing to derive."""
        return 0

    def save(self, dcp_state: dict[str, Any], writer: Writer, local: Any, unchanged: bool, derived: bool = False) -> None:
        """The plan round (only when some rank's plan changed), then the write round."""
        central, metadata = self._global_plan(local, unchanged, writer)
        rank = _dist.rank()

        def write() -> list[WriteResult]:
            writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
            planner = SavePlanner()
            planner.set_up_planner(state_dict=dcp_state, storage_meta=writer.storage_meta(), is_coordinator=rank == 0)
            return writer.write_data(planner.finish_plan(central), planner).wait()

        def finish(parts: list[list[WriteResult]]) -> None:
            assert metadata is not None and len(parts) == _dist.world_size(), len(parts)
            writer.finish(copy.copy(metadata), parts)

        _dist.gather_reduce(write, finish)

    def _global_plan(self, local: SavePlan, unchanged: bool, writer: Writer) -> tuple[SavePlan, Metadata | None]:
        if unchanged and self.plans is not None:
            return self.plans["central"], self.plans["metadata"]
        self.plans = None  # a failed round leaves no half-updated cache behind

        kept: list[Metadata] = []  # rank 0's: the metadata never travels (see [Note: scale])

        def plan(every_local: list[SavePlan]) -> list[SavePlan]:
            central, metadata = SavePlanner().create_global_plan(every_local)
            kept.append(metadata)
            return writer.prepare_global_plan(central)  # each rank's file prefix

        central = _dist.gather_scatter(lambda: local, plan)
        metadata = kept[0] if kept else None
        self.plans = {"key": _key(), "local": local, "central": central, "metadata": metadata}
        return central, metadata


def _derived() -> SaveProtocol:
    from shardbridge.checkpoint._derived import Derived

    return Derived(fallback=OwnRounds())


PROTOCOLS: dict[str, Callable[[], SaveProtocol]] = {"dcp": DCPSave, "rounds": OwnRounds, "derived": _derived}
PROTOCOL: SaveProtocol = _derived()
"""The protocol every save uses. See [Note: why this protocol]."""
