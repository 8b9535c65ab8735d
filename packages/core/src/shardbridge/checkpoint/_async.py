"""Asynchronous saves: stage to host memory, write and commit in a background thread.

[Note: async save]
~~~~~~~~~~~~~~~~~~
``save(..., async_=True)`` splits a save in two::

    training thread (blocks)                  writer thread (background)
    0. wait for the save in flight, if any;
       raise its error
    1. check args, build the portable state
       (layout repair, fused splits, FP8 ->
       plain), STAGE what only optimizer.step
       does not change: copy those boxes to
       host memory (pinned on CUDA), capture
       the RNG states; one collective round
    2. in the same round, rank 0 creates +
       locks the tmp dir
    3. start the writer, return AsyncSave ->  4. copy the optimizer's parameters and state
       training goes on (forward, backward);     to host memory ([Note: background staging]);
       the optimizer's next step() waits for     then step() may run
       the copy                               5. the protocol's local step on the snapshot
                                                 (one constant-size round: can every rank
                                                 derive the plan?); DCP's writer writes the
                                                 snapshot (fsynced)
                                              6. RNG files; hash every file
                                              7. rank 0 writes .metadata, the manifest, and
                                                 renames: the commit of [Note: atomic commit]
                                                 ([Note: save protocols] in _protocol.py)

The writer's collectives (the protocol's local round, the write results and file records, the
commit's outcome) run on a gloo group of its own, created at the first asynchronous save, so
they never interleave with the training thread's collectives (gloo matches collectives by order
within a group). Step 1's round also agrees on that group's state (not made yet, made, failed
earlier) on every rank: later saves get it with no collective, and ranks that disagree (its
making failed on some ranks only) all raise, never some waiting in a group others never joined.
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
Creating the writer's gloo group (or the checkpoint's side group of an NCCL-only job: [Note:
the checkpoint group] in ``_dist.py``, made the same way by ``_dist.side_group``) is a
rendezvous of every rank (listen, publish an address in the store, connect to every peer). If a peer dies after publishing its address and before the
connection completes, gloo 2.13's ``Pair::waitUntilConnected`` waits forever, whatever the
group's timeout (seen in about 1 of 100 kill -9 trials of test_faults.py's 2-rank async loop
under load: the survivor never returned). So the group is created in a daemon thread that the
caller waits for up to the default group's timeout plus ``_dist._GROUP_MARGIN_S``; past that,
the save raises RuntimeError (nothing was written: the previous checkpoint is intact) and later
calls that need that group refuse at once. The abandoned thread sleeps inside gloo and does
not keep the process alive.

[Note: background staging]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Copying the whole state to host memory was most of the time an asynchronous save blocked (a
full memcpy of parameters and optimizer state: 0.22x of a synchronous save at 1 GB). Between
two optimizer steps nothing changes the optimizer's parameters and state in place: forward and
backward read them (FSDP2's all-gathers and mixed-precision casts copy) and write gradients,
which are not saved. So the copies of every tensor whose storage is a parameter of the
``optimizer`` passed to ``save``, or one of its state tensors, are made by the writer thread
before it writes, and the save puts a pre-hook on that optimizer's ``step`` which waits for the
copies (``AsyncSave.staged()``; removed by the next ``save`` or ``wait``). Everything else (buffers, which a forward
may update; parameters the optimizer does not hold; the tensors the portable state builds) is
copied before ``save`` returns, as before. An in-place change of a deferred tensor by anything
but ``step`` before its copy is caught by the tensor's version counter, and the save fails
naming the tensor (never a silently mixed snapshot); code that changes them outside ``step``
calls ``staged()`` first. A model-only save (no ``optimizer``) stages everything before it
returns. torch's ``dcp.async_save`` leaves the same wait to its caller (its staging future);
here the optimizer's hook makes it automatic.

The host buffers (pinned on CUDA) are kept from one save to the next, so only the first save
pays their page faults. They belong to the model that was saved (a :class:`Stager` per model,
held through a weak reference to the model): they go when the model goes, and two models saved
in turn (a policy and a reference model) each keep their own instead of reallocating the
other's at every save.

Why a thread and not a process (torchtitan's ``async_with_pinned_mem``): the snapshot is
already in host memory, writing is I/O that releases the GIL, and a thread needs no second
copy into shared memory. The cost is the writer's Python work (DCP's per-item
serialisation, hashing) competing for the GIL with the training thread while it runs
(docs/benchmarks.md measures the blocking window).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist

from shardbridge.checkpoint import _dist
from shardbridge.checkpoint.state._stage import Pending, Stager, storages

__all__ = ["AsyncSave", "IfBusy", "finish_previous", "settle", "stage_state", "start_async", "wait", "writer_group_state"]

logger = logging.getLogger("shardbridge.checkpoint")

IfBusy = Literal["wait", "error"]

_STAGERS: weakref.WeakKeyDictionary[Any, Stager] = weakref.WeakKeyDictionary()
"""The staging buffers of each model saved asynchronously ([Note: background staging])."""
_STATE: dict[str, Any] = {"in_flight": None, "hooks": []}


def _unhook() -> None:
    """Remove the step hooks of staged saves, on the training thread (never while a step iterates them)."""
    hooks = _STATE["hooks"]
    while hooks and hooks[0][0].is_set():
        hooks.pop(0)[1].remove()


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
        self._staged = threading.Event()
        """Set by the writer thread once the snapshot is whole (the job's ``Pending.done``)."""
        self._error: BaseException | None = None

    def done(self) -> bool:
        """Whether the save has finished (committed or failed); never blocks."""
        return self._finished.is_set()

    def staged(self) -> None:
        """Block until the snapshot is in host memory: the optimizer's parameters and state may
        change from then on ([Note: background staging]). ``optimizer.step()`` waits so by itself."""
        self._staged.wait()

    def wait(self) -> Path:
        """Block until the save is committed; its directory.

        Call on every rank (the ranks' writers finish together).

        Raises:
            Exception: the writer's error (as a synchronous save would raise it: naming
                the checkpoint, file and cause); the previous checkpoint is intact.
        """
        self._finished.wait()
        _unhook()
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
    _unhook()
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


def stage_state(state: dict[str, Any], model: Any, optimizer: Any = None) -> tuple[dict[str, Any], Pending]:
    """A host-memory snapshot of ``state`` (see ``_stage.py``) in ``model``'s buffers, the copies of
    ``optimizer``'s parameters and state left pending ([Note: background staging]); no save may be
    in flight."""
    assert _STATE["in_flight"] is None or _STATE["in_flight"].done()
    later = set()
    if optimizer is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        later = storages([*params, *(v for p in params for v in optimizer.state.get(p, {}).values())])
    stager = _STAGERS.get(model)
    if stager is None:
        stager = _STAGERS[model] = Stager()
    return stager.stage(state, later)


def writer_group_state() -> int:
    """What save's argument round compares for an asynchronous save: 1 the writer group is not made
    yet, 2 it is, 3 making it failed earlier ([Note: a bounded writer group])."""
    return 1 + _dist.side_state("writer")


def _writer_group(agreed: bool) -> Any:
    """The writer thread's gloo group over every rank (a side group: [Note: the checkpoint group] in ``_dist.py``).

    ``agreed``: every rank's :func:`writer_group_state` is the same (the argument round). See
    [Note: a bounded writer group]. Raises RuntimeError if the group cannot be made.
    """
    if not _dist.is_distributed():
        return None
    if not agreed:  # every rank knows it: every rank raises
        raise RuntimeError(
            "the checkpoint's writer gloo group exists on some ranks only: making it failed on the others at an "
            "earlier save(async_=True) (a rank died or stopped answering); this job cannot make asynchronous saves "
            "any more: restart it from latest()"
        )
    if _dist.side_state("writer") == 1:  # made on every rank: no collective
        return _dist.side_group("writer", first="its first save(async_=True)", lost="asynchronous saves")
    # A collective of every rank: every rank is in save(async_=True) at this point, behind a gate
    # ([Note: collective entry points]).
    with _dist.foreign():
        return _dist.side_group("writer", first="its first save(async_=True)", lost="asynchronous saves")


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


def start_async(job: Any, write: Callable[[Any], None], optimizer: Any = None, *, group_agreed: bool) -> AsyncSave:
    """Start ``write(job)`` in the writer thread, on the writer group; the handle.

    ``write`` runs ``job.pending`` first; ``optimizer.step()`` waits for it ([Note: background staging]).
    ``group_agreed``: the argument round found :func:`writer_group_state` the same on every rank.
    """
    group = _writer_group(group_agreed)
    _dist.barrier(last=True)  # no writer starts unless every rank got here: [Note: collective entry points]
    handle = AsyncSave(job.final)
    handle._staged = job.pending.done
    rank, world_size = _dist.rank(), _dist.world_size()
    if optimizer is not None:
        done = job.pending.done

        def before_step(*_: Any) -> None:
            done.wait()

        _STATE["hooks"].append((done, optimizer.register_step_pre_hook(before_step)))

    def run() -> None:
        try:
            # Rank and world fixed now: see using_group (a destroyed group fails, never shrinks to one rank).
            with _dist.using_group(group, rank=rank, world_size=world_size), _dist.entry():
                write(job)
        except BaseException as exc:  # noqa: BLE001 (kept for wait(), logged now)
            handle._error = _explained(exc, job.final, world_size)
            logger.error("shardbridge.checkpoint: %s", handle._error)
        finally:
            job.pending.done.set()
            handle._finished.set()

    _STATE["in_flight"] = handle
    threading.Thread(target=run, name="shardbridge-checkpoint-writer", daemon=False).start()
    return handle
