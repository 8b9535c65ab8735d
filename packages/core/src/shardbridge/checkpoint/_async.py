"""Asynchronous saves: stage to host memory, write and commit in a background thread.

[Note: async save]
~~~~~~~~~~~~~~~~~~
``save(..., async_=True)`` splits a save in two::

    training thread (blocks)                  writer thread (background)
    0. wait for the save in flight, if any;
       raise its error
    1. check args, build the portable state
       (layout repair, fused splits, FP8 ->
       plain), STAGE it: copy every box to
       host memory (pinned on CUDA), capture
       the RNG states; one collective round
    2. rank 0 creates + locks the tmp dir;
       DCP's plan (a round only if it changed)
    3. start the writer, return AsyncSave ->  4. DCP's writer writes the snapshot (fsynced)
       training goes on and may change the    5. RNG files; hash every file
       model and optimizer                    6. rank 0 writes .metadata, the manifest, and
                                                 renames: the commit of [Note: atomic commit]
                                                 ([Note: save protocols] in _protocol.py)

The writer's collectives (the write results and file records, the commit's outcome) run on
a gloo group of its own, created at the first asynchronous save, so they never interleave
with the training thread's collectives (gloo matches collectives by order within a group).
The commit is the synchronous one: the manifest is written only after every rank's files
are fsynced and hashed, so a crash of the writer (or the process) at any point leaves what
a crashed synchronous save leaves: the previous checkpoint intact, the hidden tmp directory
deleted or restored by recovery, and :func:`latest` returns the last committed checkpoint.

At most one save is in flight per process: the next ``save`` (sync or async) first waits
for it (``if_busy="wait"``) or refuses (``if_busy="error"``: every rank raises if any rank
is still busy). A failure of the writer is kept and raised by the next ``save``, by
``AsyncSave.wait()`` or by :func:`wait`; it is the error a synchronous save would raise
(naming the checkpoint, the file and the cause). It is also logged when it happens, so an
error nobody waits for is not silent. The thread is not a daemon: a script that ends with
a save in flight exits once it is committed; call :func:`wait` before
``destroy_process_group``.

[Note: a bounded writer group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Creating the writer's gloo group is a rendezvous of every rank (listen, publish an address in
the store, connect to every peer). If a peer dies after publishing its address and before the
connection completes, gloo 2.13's ``Pair::waitUntilConnected`` waits forever, whatever the
group's timeout (seen in about 1 of 100 kill -9 trials of test_faults.py's 2-rank async loop
under load: the survivor never returned). So the group is created in a daemon thread that the
caller waits for up to the default group's timeout plus ``_GROUP_MARGIN_S``; past that, the
save raises RuntimeError (nothing was written: the previous checkpoint is intact) and later
asynchronous saves of the job refuse at once. The abandoned thread sleeps inside gloo and does
not keep the process alive.

Why a thread and not a process (torchtitan's ``async_with_pinned_mem``): the snapshot is
already in host memory, writing is I/O that releases the GIL, and a thread needs no second
copy into shared memory. The cost is the writer's Python work (DCP's per-item
serialisation, hashing) competing for the GIL with the training thread while it runs
(docs/benchmarks.md measures the blocking window).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from shardbridge._compat import group_timeout
from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.state._stage import Stager

__all__ = ["AsyncSave", "IfBusy", "bounded", "finish_previous", "settle", "stage_state", "start_async", "wait"]

logger = logging.getLogger("shardbridge.checkpoint")

IfBusy = Literal["wait", "error"]

_STAGER = Stager()
_STATE: dict[str, Any] = {"in_flight": None, "group": None, "group_of": None}


class AsyncSave:
    """The handle of a save running in the background (what ``save(..., async_=True)`` returns).

    Example:
        >>> pending = save(step_dir(root, 100), model=model, optimizer=opt, step=100,
        ...                async_=True)  # doctest: +SKIP
        >>> train_some_more()  # doctest: +SKIP
        >>> pending.wait()  # doctest: +SKIP
        PosixPath('/ckpt/step-00000100')
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        """The checkpoint directory this save commits."""
        self._finished = threading.Event()
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._finished.is_set()

    def wait(self) -> Path:
        """Block until the save is committed; its directory.

        Call on every rank (the ranks' writers finish together).

        Raises:
            Exception: the writer's error (as a synchronous save would raise it: naming
                the checkpoint, file and cause); the previous checkpoint is intact.
        """
        self._finished.wait()
        if _STATE["in_flight"] is self:
            _STATE["in_flight"] = None
        if self._error is not None:
            raise self._error
        return self.path

    def __repr__(self) -> str:
        status = "failed" if self._error is not None else "committed" if self.done() else "in flight"
        return f"AsyncSave({str(self.path)!r}, {status})"


def wait() -> Path | None:
    """Wait for this process's save in flight, if any; its directory (None if none was in flight).

    Call on every rank, e.g. before ``destroy_process_group`` or the end of training.

    Raises:
        Exception: the save's error, as :meth:`AsyncSave.wait`.

    Example:
        >>> wait() is None  # nothing in flight
        True
    """
    handle = _STATE["in_flight"]
    return None if handle is None else handle.wait()


def finish_previous(if_busy: IfBusy) -> None:
    """Before a save: wait for the save in flight (or refuse, on every rank); raise its error."""
    handle: AsyncSave | None = _STATE["in_flight"]
    if if_busy == "error":
        busy = handle is not None and not handle.done()
        anyone = any(_dist.all_gather(busy))  # every rank refuses together
        if anyone:
            where = str(handle.path) if handle is not None else "a checkpoint (on another rank)"
            raise RuntimeError(
                f"a save of {where!r} is still in flight and if_busy='error'; call its wait() (or "
                "shardbridge.checkpoint.wait()) first, or pass if_busy='wait'"
            )
    if handle is not None:
        try:
            handle.wait()
        except BaseException as exc:
            exc.add_note(
                "(the error of the previous asynchronous save, raised by the next save, which waited for it: that "
                "next save did not start; call save again)"
            )
            raise


def settle() -> None:
    """Before a load: wait for this process's save in flight to end, without raising its error.

    A load of the directory an ``overwrite=True`` save is replacing would otherwise read some
    files of each version. The save's error stays for the next ``save`` / ``wait``.
    """
    handle: AsyncSave | None = _STATE["in_flight"]
    if handle is not None:
        handle._finished.wait()


def stage_state(state: dict[str, Any]) -> dict[str, Any]:
    """A host-memory snapshot of ``state`` (see ``_stage.py``); no save may be in flight."""
    assert _STATE["in_flight"] is None or _STATE["in_flight"].done()
    return _STAGER.stage(state)


_GROUP_MARGIN_S = 10.0
"""How long past the job's timeout the writer group's creation may take before it is declared hung."""


def _writer_group() -> Any:
    """The writer thread's gloo group over every rank (created once per default group).

    See [Note: a bounded writer group]. Raises RuntimeError if the group cannot be made.
    """
    if not _dist.is_distributed():
        return None
    world = dist.group.WORLD
    if _STATE["group_of"] is world and _STATE["group"] is None:
        raise RuntimeError(
            "an earlier save(async_=True) could not create the checkpoint writer's process group (a rank died "
            "or stopped answering); this job cannot save asynchronously any more: restart it from latest()"
        )
    if _STATE["group"] is None or _STATE["group_of"] is not world:
        # A collective of every rank: every rank is in save(async_=True) at this point.
        timeout = group_timeout(world)
        _STATE["group"], _STATE["group_of"] = None, world
        what = "creating the checkpoint writer's gloo group (every rank joins it at its first save(async_=True))"
        try:
            with _dist.foreign():  # a rendezvous of every rank, behind a gate ([Note: collective entry points])
                _STATE["group"] = bounded(
                    lambda: dist.new_group(backend="gloo", timeout=timeout),
                    seconds=(timeout.total_seconds() if timeout is not None else 1800.0) + _GROUP_MARGIN_S,
                    what=what,
                )
        except RuntimeError as exc:
            if what in str(exc):
                raise
            # e.g. gloo's "Connection closed by peer": another rank died, or destroyed its process
            # group right after its own save(async_=True) returned, while this one still joined.
            raise RuntimeError(
                f"{what} failed: another rank died or destroyed its process group meanwhile ({exc}); this save "
                "did not start and the previous checkpoint is intact (call shardbridge.checkpoint.wait() on every "
                "rank before destroy_process_group)"
            ) from exc
    return _STATE["group"]


def _explained(exc: BaseException, final: Path, world_size: int) -> BaseException:
    """The writer's error, with what happened to the checkpoint when the error alone does not say."""
    if world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        return RuntimeError(
            f"the asynchronous save of {str(final)!r} failed: the process group was destroyed while it was in "
            f"flight ({type(exc).__name__}: {exc}); nothing was committed and the previous checkpoint is intact. "
            "Call shardbridge.checkpoint.wait() before destroy_process_group"
        )
    if isinstance(exc, (ValueError, OSError, NotImplementedError)) or str(final) in str(exc):
        return exc  # shardbridge's own errors name the checkpoint, the file and the cause already
    return RuntimeError(
        f"the asynchronous save of {str(final)!r} failed ({type(exc).__name__}: {exc}); it did not commit and the "
        "previous checkpoint is intact (a rank that died or left mid-save ends every rank's writer so)"
    )


def bounded(fn: Callable[[], Any], *, seconds: float, what: str) -> Any:
    """``fn()``, run in a daemon thread; RuntimeError naming ``what`` if it has not returned after ``seconds``.

    See [Note: a bounded writer group]. ``fn``'s own exception is re-raised. The thread of a
    call that timed out is abandoned (a daemon: it does not keep the process alive).

    Example:
        >>> bounded(lambda: 42, seconds=5, what="an answer")
        42
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 (re-raised by the caller's thread)
            box["error"] = exc

    thread = threading.Thread(target=run, name="shardbridge-bounded", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise RuntimeError(
            f"{what} did not finish within {seconds:.0f} s (the process group's timeout plus a margin): a rank "
            "probably died or stopped answering; the previous checkpoint is intact: restart the job from latest()"
        )
    if "error" in box:
        raise box["error"]
    return box["value"]


def start_async(job: Any, write: Callable[[Any], None]) -> AsyncSave:
    """Start ``write(job)`` in the writer thread, on the writer group; the handle."""
    group = _writer_group()
    _dist.barrier(last=True)  # no writer starts unless every rank got here: [Note: collective entry points]
    handle = AsyncSave(job.final)
    rank, world_size = _dist.rank(), _dist.world_size()

    def run() -> None:
        try:
            # Rank and world fixed now: see using_group (a destroyed group fails, never shrinks to one rank).
            with _dist.using_group(group, rank=rank, world_size=world_size), _dist.entry():
                write(job)
        except BaseException as exc:  # noqa: BLE001 (kept for wait(), logged now)
            handle._error = _explained(exc, job.final, world_size)
            logger.error("shardbridge.checkpoint: %s", handle._error)
        finally:
            handle._finished.set()

    _STATE["in_flight"] = handle
    threading.Thread(target=run, name="shardbridge-checkpoint-writer", daemon=False).start()
    return handle
