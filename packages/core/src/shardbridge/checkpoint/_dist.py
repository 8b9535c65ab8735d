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

[Note: collective entry points]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A step inside a round fails symmetrically; a rank that raises BETWEEN two collectives would
still leave the others waiting in the next one until the process group times out (30 min by
default; issue 38: rank 0 listed an unreachable S3 endpoint before ``load_latest``'s
broadcast). So every verb that several ranks enter together runs inside :func:`entry`, and
every collective of this module begins with a *gate*: the all-reduce of [Note: constant-size
rounds] that asks "did any rank fail?" (a round's own all-reduce; one more before a plain
transfer). A rank whose verb raises outside a round is taken by ``entry`` into the next gate
as failed: the others learn it there and raise a copy naming it, the failing rank its own
error. That gate is the others' next collective because every rank runs this module's
collectives in the same order, and ``entry`` joins one only while the ranks will meet at one
again: not after an error every rank raises, nor after a collective that itself failed, nor
inside another library's collectives (:func:`foreign`: DCP's, behind a gate of their own), nor
after a verb's last round (``last=True``). A verb that ends otherwise passes one closing gate,
so no rank returns while another raises. Bound: every rank raises at its next gate after the
failure (once its own current step ends), plus one gate (milliseconds), never the process
group's timeout.

The collectives run on the checkpoint group: the default group when it takes CPU tensors, else
a gloo side group of the checkpoint's own ([Note: the checkpoint group]); or on the group
:func:`using_group` sets for the calling thread: an asynchronous save's writer thread uses its
own gloo group, so that its collectives never interleave with the training thread's (see
[Note: async save] in ``_async.py``).

[Note: the checkpoint group]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The fixed-size rounds ([Note: one-collective rounds], [Note: constant-size rounds], [Note:
fixed-size gather]) move CPU tensors: they need a gloo backend. A default group with one
(``"gloo"``, ``"cpu:gloo,cuda:nccl"``) is the checkpoint group. One without
(``init_process_group("nccl")``) would leave torch's object collectives, whose bytes into every
rank grow with the world (1.24 MB per rank per save at 4,096 ranks, tools/bench/bench_scale.py).
So the checkpoint then makes a gloo group of every rank, its *side group*, and runs every
collective of this module on it: made once per default group at the first collective of the
job's first checkpoint call (every rank runs these collectives in the same order, so every rank
joins the rendezvous at the same one), reused by later calls, destroyed with the default group;
bounded (:func:`bounded`, [Note: a bounded writer group] in ``_async.py``): a rendezvous that
never completes raises naming it, and later calls refuse at once. The asynchronous writer's group
is made the same way (:func:`side_group`).
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

from shardbridge._compat import group_timeout

__all__ = [
    "all_gather",
    "barrier",
    "bounded",
    "entry",
    "foreign",
    "gather_reduce",
    "broadcast_from_rank0",
    "from_replica0",
    "group",
    "is_distributed",
    "on_all_ranks",
    "one_round",
    "rank",
    "replay",
    "side_group",
    "summary",
    "takes",
    "tell",
    "using_group",
    "world_size",
]

T = TypeVar("T")
_THREAD = threading.local()


def group() -> Any:
    """The process group this thread's checkpoint collectives use (None = the default group).

    The thread's own (:func:`using_group`), else the default group when it takes CPU tensors,
    else the side group ([Note: the checkpoint group]; made by the first call).
    """
    pg = getattr(_THREAD, "group", None)
    if pg is not None or not is_distributed() or takes(None):
        return pg
    return side_group("checkpoint", first="its first checkpoint call", lost="checkpoint calls")


_SIDE: dict[str, Any] = {"of": None}
"""The default group these side groups belong to (``"of"``), and each side group by purpose
(None: making it failed). Holding ``"of"`` keeps it alive, so ``is`` never matches a new group."""
_GROUP_MARGIN_S = 10.0
"""How long past the job's timeout making a side group may take before it is declared hung."""


def side_state(purpose: str) -> int:
    """This default group's side group for ``purpose``: 0 not made yet, 1 made (getting it is no
    collective), 2 making it failed (:func:`side_group` raises at once)."""
    if _SIDE["of"] is not dist.group.WORLD or purpose not in _SIDE:
        return 0
    return 1 if _SIDE[purpose] is not None else 2


def side_group(purpose: str, *, first: str, lost: str) -> Any:
    """A gloo group over every rank for ``purpose``, made once per default group (every rank must call).

    See [Note: the checkpoint group]. ``first``: when every rank makes it ("its first
    save(async_=True)"); ``lost``: what the job cannot do once making it failed. Raises
    RuntimeError naming the group if it cannot be made, and at once on later calls.
    """
    world = dist.group.WORLD
    if _SIDE["of"] is not world:
        _SIDE.clear()
        _SIDE["of"] = world
    what = f"creating the checkpoint's {purpose} gloo group (every rank joins it at {first})"
    if purpose in _SIDE:
        if _SIDE[purpose] is None:
            raise RuntimeError(
                f"{what} failed earlier (a rank died or stopped answering); this job cannot make {lost} any "
                "more: restart it from latest()"
            )
        return _SIDE[purpose]
    _SIDE[purpose] = None
    timeout = group_timeout(world)
    try:
        _SIDE[purpose] = bounded(
            lambda: dist.new_group(backend="gloo", timeout=timeout),
            seconds=(timeout.total_seconds() if timeout is not None else 1800.0) + _GROUP_MARGIN_S,
            what=what,
        )
    except RuntimeError as exc:
        if what in str(exc):
            raise
        # e.g. gloo's "Connection closed by peer": another rank died, or destroyed its process
        # group right after its own call returned, while this one still joined.
        raise RuntimeError(
            f"{what} failed: another rank died or destroyed its process group meanwhile ({exc}); nothing was "
            "written and the previous checkpoint is intact (call shardbridge.checkpoint.wait() on every rank "
            "before destroy_process_group)"
        ) from exc
    return _SIDE[purpose]


def bounded(fn: Callable[[], Any], *, seconds: float, what: str) -> Any:
    """``fn()``, run in a daemon thread; RuntimeError naming ``what`` if it has not returned after ``seconds``.

    See [Note: a bounded writer group] in ``_async.py``. ``fn``'s own exception is re-raised. The
    thread of a call that timed out is abandoned (a daemon: it does not keep the process alive).

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
# group is NCCL alone checkpoints on a gloo side group: [Note: the checkpoint group]).
_SMALL_GATHER_BYTES = 4 << 10
"""Per rank, for all-gathers (the buffer is world_size times this on every rank)."""
_SMALL_BROADCAST_BYTES = 4 << 10
"""Into every rank, per broadcast: a save's target (~220 bytes), a round's outcome (~20 bytes),
``load_latest``'s path; more takes the fallback (64 KiB until 2026-11-28: 131 KB per rank per save)."""
_TOO_BIG = (1 << 64) - 1


def _cpu_collectives() -> bool:
    """Whether the checkpoint group takes CPU tensors (a gloo backend, alone or beside NCCL)."""
    return takes(group())


def takes(pg: Any, device: str = "cpu") -> bool:
    """Whether ``pg`` (None: the default group) has a backend for ``device`` tensors (CPU: gloo)."""
    try:
        backend = str(dist.get_backend(pg)).lower()
    except (RuntimeError, ValueError):
        return False
    devices = dict(pair.split(":", 1) for pair in backend.split(",") if ":" in pair)  # "cpu:gloo,cuda:nccl"
    able = {"cpu": ("gloo",), "cuda": ("nccl", "gloo")}.get(device, ())
    return (devices.get(device) if devices else backend) in able


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
    """Every rank's picklable ``obj``, in rank order (``[obj]`` in one process), behind a gate.

    ``small``: the payloads are usually a few KB: one collective ([Note: one-collective rounds]).
    """
    if not is_distributed():
        return [obj]
    with _round():
        _gate(None)
        return _all_gather(obj, small=small)


def _all_gather(obj: Any, *, small: bool = False) -> list[Any]:
    """:func:`all_gather` without its gate (inside a round, after the gate)."""
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
_REPLAYED = (ValueError, TypeError, NotImplementedError, FileExistsError, FileNotFoundError, PermissionError, OSError)


def is_distributed() -> bool:
    """Whether a default process group with more than one rank is initialised (or fixed for this thread)."""
    return world_size() > 1


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


def barrier(*, last: bool = False) -> None:
    """A gate on the checkpoint group (a barrier that raises on every rank if one joins it failed).

    ``last``: as :func:`one_round`'s.
    """
    if is_distributed():
        with _round(last):
            _gate(None)


@contextmanager
def entry() -> Iterator[None]:
    """Run a verb several ranks enter together: an error on one rank raises on every rank.

    See [Note: collective entry points]. Nested uses and one process: plain.
    """
    if getattr(_THREAD, "meet", None) is not None or not is_distributed():
        yield
        return
    _THREAD.meet = True
    try:
        yield
        if _THREAD.meet:  # the verb's last collective was not its last round: leave together
            barrier()
    except Exception as exc:
        tell(exc)
        raise
    finally:
        _THREAD.meet = None


def tell(error: BaseException) -> None:
    """Take this rank, failed with ``error`` outside a round, into the next gate now (once).

    For cleanup that must wait until every rank knows (rank 0 deleting the files the others
    may still be writing); :func:`entry` does it at the latest. See [Note: collective entry points].
    """
    if not getattr(_THREAD, "meet", None) or not isinstance(error, Exception):
        return
    _THREAD.meet = False  # the others are (or will be) in the next gate
    try:
        _gate(error)
    except Exception as told:  # noqa: BLE001 (the rank's own error is what it raises)
        if told is not error:
            error.add_note(f"(telling the other ranks failed too: {type(told).__name__}: {told})")


@contextmanager
def foreign() -> Iterator[None]:
    """Another library's collectives (DCP's) run inside the block, behind a gate; :func:`entry`
    never joins a gate while they run (their own steps must be symmetric)."""
    barrier()
    meet = getattr(_THREAD, "meet", None)
    if meet:
        _THREAD.meet = False
    yield
    if meet:
        _THREAD.meet = True


@contextmanager
def _round(last: bool = False) -> Iterator[None]:
    """One collective of this module, for :func:`entry`: after an error (every rank raises, or the
    collective itself failed), or after a verb's ``last`` round, the ranks meet at no gate again."""
    try:
        yield
    except BaseException:
        if getattr(_THREAD, "meet", None):
            _THREAD.meet = False
        raise
    if last and getattr(_THREAD, "meet", None):
        _THREAD.meet = False


def _gate(error: BaseException | None) -> None:
    """Every rank: raise on every rank if any rank failed (``error``: this rank's, raised again)."""
    if _cpu_collectives():
        if _status(error is not None, None, True)[0]:
            _raise_failed(error)
        return
    # The first collective of one_round on such a group: (failure, shared, same, flag, accord)
    _raise_any(error, [g[0] for g in _all_gather((None if error is None else summary(error), None, None, True, 0))])


def _raise_failed(error: BaseException | None) -> None:
    """After a gate that saw a failure: every rank's failure gathered, raised on every rank."""
    _raise_any(error, _all_gather(None if error is None else summary(error), small=True))


def _raise_any(error: BaseException | None, failures: list[Any]) -> None:
    """Raise this rank's ``error``, else a copy of the failed ranks' (``failures``: a summary or None per rank)."""
    if error is not None:
        raise error
    failed = [(r, f) for r, f in enumerate(failures) if f is not None]
    if failed:
        raise replay(failed)


def broadcast_from_rank0(obj: T, *, large: bool = False) -> T:
    """Rank 0's ``obj`` on every rank (a picklable object).

    ``large``: usually more than the one-collective buffer holds (a ``.metadata``): torch's object
    broadcast directly, so the round is the same collective whatever the size (not one that falls
    back to a second when the object outgrows the buffer).
    """
    if not is_distributed():
        return obj
    with _round():
        _gate(None)
        if large:
            box = [obj]
            dist.broadcast_object_list(box, src=_rank0(), group=group())
            return box[0]
        return _broadcast(obj)


def from_replica0(tensors: list[torch.Tensor], obj: T, *, src: int, pg: Any, boxes: list[Any]) -> T:
    """Behind a gate, global rank ``src``'s ``tensors`` (in place) and ``obj`` on every rank of ``pg``
    (this rank's group of replicas; every rank calls, each with its own group).

    ``boxes``: what each rank holds (keys, local boxes): ``src``'s are sent first and compared; a
    replica holding other boxes raises on every rank, naming the first key, before any tensor is
    sent (it would otherwise take another rank's bytes, or pair the broadcasts wrongly)."""
    with _round():
        _gate(None)
        theirs = [boxes]
        dist.broadcast_object_list(theirs, src=src, group=pg)
        differ = next((f"{a[0]!r}: {a[1]} on rank {src}, {b[1]} here" for a, b in zip(theirs[0], boxes) if a != b), None)
        if differ is None and len(theirs[0]) != len(boxes):
            differ = f"{len(theirs[0])} entries on rank {src}, {len(boxes)} here"
        _gate(None if differ is None else ValueError(
            f"reading once under replication: this rank does not hold what its reader holds ({differ}); "
            "load with every rank reading: please report this layout"))  # fmt: skip
        for tensor in tensors:
            whole = tensor.contiguous()  # broadcast wants one block: a strided view is sent as a copy
            dist.broadcast(whole, src=src, group=pg)
            if whole is not tensor:
                tensor.copy_(whole)
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=pg)
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
    all_of: Callable[[Any], bool] | None = None,
    agree: Callable[[Any], int] | None = None,
    last: bool = False,
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
        same: ``(where, values)``: also raise on every rank, naming both values, if these values
            differ between ranks (checked after ``fn``'s errors).
        share: with ``result="own"``: return ``(own result, share(rank 0's result))``, the
            second picklable, on every rank; with ``result="all"``: return ``(own result,
            [share(each rank's result)])`` (a part of every rank's result, in rank order).
        all_of: also return whether ``all_of(result)`` is true on every rank: the return
            value becomes ``(what it would be, every_true)``.
        agree: also return whether ``agree(result)`` (an int in [0, 2**62)) is the same on every
            rank: the return value becomes ``(what it would be, every_true, agreed)`` (every_true
            is True without ``all_of``).
        last: the verb's last round ([Note: collective entry points]): nothing after it may fail.

    With ``result`` "own" or "rank0" on a gloo group the round is one all-reduce of a fixed
    few bytes (plus a broadcast of rank 0's shared value), whatever the world size; only when
    a rank failed or ``same`` differs do the ranks then gather every rank's error or values to
    name them. See [Note: constant-size rounds].
    """
    assert result in ("own", "rank0", "all"), result

    def step() -> tuple[Any, bool, int, Any]:  # everything this rank computes, under one try
        value = fn(*args, **(kwargs or {})) if not only_rank0 or rank() == 0 else None
        shared = None
        if result == "all" or rank() == 0:
            shared = share(value) if share is not None else value if result != "own" else None
        return value, all_of is None or bool(all_of(value)), 0 if agree is None else int(agree(value)), shared

    mine, error = _attempt(step)
    if error is not None and not is_distributed():
        raise error
    value, flag, accord, shared = (None, False, 0, None) if mine is None else mine

    def out(answer: Any, every_true: bool, agreed: bool = True) -> Any:
        if agree is not None:
            return answer, every_true, agreed
        return answer if all_of is None else (answer, every_true)

    if not is_distributed():
        if share is not None:
            return out((value, [shared] if result == "all" else shared), flag)
        return out([value] if result == "all" else value, flag)
    same_values = None if same is None else {k: repr(v) for k, v in same[1].items()}
    with _round(last):
        if _cpu_collectives():  # the gate: see [Note: collective entry points]
            failed, same_ok, every_true, agreed = _status(error is not None, same_values, flag, accord)
            if failed:
                _raise_failed(error)
            if same_ok and result != "all":  # nobody failed, same arguments: rank 0's shared value is all that travels
                if result == "rank0" or share is not None:
                    got = _broadcast(shared if rank() == 0 else None)
                    return out(got if result == "rank0" else (value, got), every_true, agreed)
                return out(value, every_true, agreed)
        failure = None if error is None else summary(error)
        small = result == "own" and share is None  # only errors and ``same`` travel: [Note: one-collective rounds]
        gathered = _all_gather((failure, shared, same_values, flag, accord), small=small)
        _raise_any(error, [g[0] for g in gathered])
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
def _status(failed: bool, same: dict[str, str] | None, flag: bool, accord: int = 0) -> tuple[bool, bool, bool, bool]:
    """(some rank failed, ``same`` agrees everywhere, ``flag`` is true on every rank, ``accord``
    is the same on every rank): one all-reduce."""
    digest = hashlib.blake2b(repr(sorted((same or {}).items())).encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little") & ((1 << 62) - 1)
    values = [rank() if failed else world_size(), h, -h, int(flag), accord, -accord]
    status = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(status, op=dist.ReduceOp.MIN, group=group())
    first_failed, low, minus_high, every, low2, minus_high2 = (int(x) for x in status)
    return first_failed != world_size(), low == -minus_high, every == 1, low2 == -minus_high2


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


def gather_reduce(
    local: Callable[[], Any], reduce: Callable[[list[Any]], Any], *, small: bool = False, last: bool = False
) -> Any:
    """``local()`` on every rank, ``reduce(every rank's value)`` on rank 0, its result on every rank.

    DCP's "write" round, with [Note: symmetric errors]: a gate (every rank's ``local`` failed or
    not), then two collectives whose payload grows with the world size on rank 0 only (a
    gather, then a broadcast of the outcome), where
    :func:`one_round`'s all-gather would send every rank's value to every rank. ``reduce``
    runs only when every ``local`` succeeded; any error is raised on every rank (its own on
    the rank that raised it). Without a process group: ``reduce([local()])``.

    ``small``: the values are usually under ``_SMALL_RECORDS_BYTES``: one fixed-size gather
    ([Note: fixed-size gather]). ``last``: as :func:`one_round`'s.
    """
    if not is_distributed():
        return reduce([local()])
    value, error = _attempt(local)
    with _round(last):
        _gate(error)  # see [Note: collective entry points]
        return _gather_reduce((None, value), reduce, small=small)


def _gather_reduce(mine: tuple[None, Any], reduce: Callable[[list[Any]], Any], *, small: bool) -> Any:
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
    if kind == "failed":
        raise replay(payload)
    return payload


def _outcome(parts: list[Any] | None, reduce: Callable[[list[Any]], Any]) -> Any:
    """Rank 0: ("failed", [(0, summary)]) or ("ok", reduce(values)); None on the other ranks."""
    if parts is None:
        return None
    result, error = _attempt(lambda: reduce([p[1] for p in parts]))
    return ("ok", result) if error is None else ("failed", [(0, summary(error))])


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
