"""A persistent pool of gloo worker processes for multi-process tests.

[Note: worker pool]

Spawning a process per test costs ~2 s of CPU per rank (``import torch``). Instead, one
``forkserver`` with torch preloaded forks ``world_size`` workers once per world size; each
worker initialises its gloo process group once and then runs task after task::

    pytest process                       forkserver (torch imported once)
      run_distributed(fn, world_size=4)     |
        |-- pipe --> worker rank 0 ---------+  init_process_group("gloo") once
        |-- pipe --> worker rank 1 ---------+  loop: recv task, run fn, barrier, send result
        |-- pipe --> worker rank 2 ---------+
        `-- pipe --> worker rank 3 ---------'

A task names its function by (module, file, qualname), so functions defined in test modules
work whatever pytest's import mode. A failure on any rank is reported with its rank and
traceback, and the pool is torn down (its ranks may be stuck in a collective) and rebuilt on
the next call. The process group timeout (30 s) turns a mismatched collective into an error on
the ranks; the per-call ``timeout`` turns anything else into an error in the caller. The barrier
after each task runs on a group of its own with a timeout of at least 300 s: one rank's longer
task (rank 0 alone computing an oracle, on a loaded machine) is not an error.

A pool is also rebuilt once its workers hold more than ``_MAX_GROUPS`` process groups. Each
DeviceMesh a task builds creates a gloo group per mesh dimension (plus flattened ones), and a
gloo group keeps its own connections and threads (about 20 threads and 33 file descriptors per
2-D mesh) for the life of the process. Destroying them after each task is not an option: torch
caches sharding plans keyed by mesh *value*, so a later task's equal mesh would be handed the
destroyed groups. Left alone, a few hundred tests made every worker run thousands of threads,
collectives slowed ~10x, and the suite crawled into 30 s collective timeouts on 2 cores.
"""

from __future__ import annotations

import atexit
import importlib
import importlib.util
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["DistributedTestFailure", "WorkerPool", "run_distributed", "shutdown_pools"]

_PG_TIMEOUT_S = 30.0
_AFTER_TASK_S = 300.0
"""The barrier after each task waits this long at least (or the collective timeout, if longer)."""
_MAX_GROUPS = 150  # ~20 meshes; see the module note
_ERROR_GRACE_S = 3.0
# A rank whose gloo peer went away fails with one of these: the cause is on the peer (its own error,
# or a collective timeout on a starved machine), so the pool waits for that rank's report (up to
# the collective timeout) instead of the 3 s grace, and the failure shows the cause, not only echoes.
_ECHOES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp"]


class DistributedTestFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message has each rank's traceback."""


@dataclass(frozen=True)
class _Task:
    module: str
    file: str | None
    qualname: str
    payload: bytes  # pickle of (args, kwargs), unpickled after the module is imported
    sys_path: tuple[str, ...]


def _import_function(task: _Task) -> Callable[..., Any]:
    for entry in task.sys_path:
        if entry not in sys.path:
            sys.path.append(entry)
    module = sys.modules.get(task.module)
    if module is None:
        try:
            module = importlib.import_module(task.module)
        except ImportError:
            if task.file is None:
                raise
            spec = importlib.util.spec_from_file_location(task.module, task.file)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            sys.modules[task.module] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in task.qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world_size: int, init_file: str, pg_timeout: float, conn: Connection) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=pg_timeout),
    )
    # The barrier after each task waits for the slowest rank's task (rank 0 computing an oracle
    # alone, on a loaded machine): on a group of its own, not under the collective timeout.
    after_task = dist.new_group(timeout=timedelta(seconds=max(pg_timeout, _AFTER_TASK_S)))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            break
        if task is None:
            break
        try:
            fn = _import_function(task)
            args, kwargs = pickle.loads(task.payload)
            result = fn(*args, **kwargs)
            dist.barrier(group=after_task)
            conn.send(("ok", pickle.dumps(result), len(dist.distributed_c10d._world.pg_map)))
        except BaseException:  # noqa: BLE001 - everything goes back to the caller
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


class WorkerPool:
    """``world_size`` gloo worker processes with an initialised default process group.

    Example:
        >>> pool = WorkerPool(2)  # doctest: +SKIP
        >>> pool.run(my_module_level_fn, (1,), {})  # doctest: +SKIP
        [..., ...]
    """

    def __init__(self, world_size: int, *, pg_timeout: float = _PG_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError(f"world_size({world_size}) must be >= 1")
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.groups = 1  # process groups held by the busiest worker after the last task
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        self._tmpdir = tempfile.TemporaryDirectory(prefix="shardbridge-pool-")
        init_file = os.path.join(self._tmpdir.name, "pg_init")
        self._conns: list[Connection] = []
        self._procs: list[Any] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker_main,
                args=(rank, world_size, init_file, pg_timeout, child),
                name=f"shardbridge-rank{rank}",
                daemon=True,
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)

    @property
    def alive(self) -> bool:
        """Whether every worker process is still running."""
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank and return the per-rank results.

        Raises:
            DistributedTestFailure: a rank raised, died, or did not answer within ``timeout``.
                The pool is closed in that case.
        """
        module = getattr(fn, "__module__", None)
        qualname = getattr(fn, "__qualname__", "")
        if module is None or "<locals>" in qualname or "<lambda>" in qualname:
            raise ValueError(
                f"run_distributed needs a module-level function, got {qualname or fn!r}; "
                "define it at the top level of the test module"
            )
        mod = sys.modules.get(module)
        task = _Task(
            module=module,
            file=getattr(mod, "__file__", None),
            qualname=qualname,
            payload=pickle.dumps((args, kwargs)),
            sys_path=tuple(sys.path),
        )
        for conn in self._conns:
            conn.send(task)
        return self._collect(qualname, timeout)

    def _collect(self, name: str, timeout: float) -> list[Any]:
        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if errors:
                echoes_only = all(any(e in error for e in _ECHOES) for error in errors.values())
                grace = self.pg_timeout + 10 if echoes_only else _ERROR_GRACE_S
                remaining = min(remaining, grace)
            if remaining <= 0:
                break
            ready = wait(list(pending) + list(sentinels), timeout=remaining)
            if not ready:
                break
            for obj in ready:
                if obj in pending:
                    rank = pending.pop(obj)
                    try:
                        status, value, *groups = obj.recv()
                    except EOFError:
                        errors[rank] = "worker process died (no result)"
                        continue
                    if status == "ok":
                        results[rank] = pickle.loads(value)
                        self.groups = max(self.groups, *groups)
                    else:
                        errors[rank] = value
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    code = self._procs[rank].exitcode
                    if rank not in results and rank not in errors:
                        errors[rank] = f"worker process died with exit code {code}"
                        pending = {c: r for c, r in pending.items() if r != rank}
        if not errors and not pending:
            return [results[r] for r in range(self.world_size)]
        self.close(force=True)
        lines = [f"{name} failed on {len(errors)} of {self.world_size} ranks"]
        if pending and errors:
            lines[0] += (
                f"; ranks {sorted(pending.values())} were still running {grace:.0f} s after the last "
                "failure (probably waiting in a collective the failed rank never reached)"
            )
        elif pending:
            lines[0] += (
                f"; ranks {sorted(pending.values())} did not answer within {timeout:.0f} s "
                "(a hang: a collective some ranks never reached?)"
            )
        for rank in sorted(errors):
            lines.append(f"--- rank {rank} ---\n{errors[rank].rstrip()}")
        raise DistributedTestFailure("\n".join(lines))

    def close(self, *, force: bool = False) -> None:
        """Stop the workers (politely unless ``force``)."""
        for conn in self._conns:
            if not force:
                try:
                    conn.send(None)
                except (BrokenPipeError, OSError):
                    pass
            conn.close()
        for proc in self._procs:
            if force:
                proc.kill()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._conns, self._procs = [], []
        self._tmpdir.cleanup()


_POOLS: dict[tuple[int, float], WorkerPool] = {}


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 4,
    timeout: float = 120.0,
    pg_timeout: float = _PG_TIMEOUT_S,
    **kwargs: Any,
) -> list[Any]:
    """Run a module-level function on ``world_size`` gloo ranks; return each rank's result.

    The default process group is initialised (gloo, CPU, 30 s collective timeout) and
    ``torch.get_num_threads() == 1`` on every rank. Pools are kept per world size for the
    life of the process, so a call costs milliseconds after the first.

    Args:
        fn: a module-level function (pickled by reference); it may build any DeviceMesh.
        *args: picklable positional arguments (e.g. ``str(tmp_path)``).
        world_size: number of ranks.
        timeout: seconds to wait for all ranks before failing the call.
        pg_timeout: collective timeout of the pool's process group (one pool per value).
        **kwargs: picklable keyword arguments.

    Returns:
        ``[result_of_rank_0, ..., result_of_rank_{world_size-1}]``; results must be picklable
        (return plain tensors, not DTensors).

    Raises:
        DistributedTestFailure: with each failing rank's traceback; the pool is rebuilt next call.

    Example:
        >>> def world(x):  # at module level
        ...     import torch.distributed as dist
        ...     return dist.get_rank() * x
        >>> run_distributed(world, 10, world_size=2)  # doctest: +SKIP
        [0, 10]
    """
    key = (world_size, pg_timeout)
    pool = _POOLS.get(key)
    if pool is None or not pool.alive or pool.groups > _MAX_GROUPS:
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[key] = WorkerPool(world_size, pg_timeout=pg_timeout)
    try:
        return pool.run(fn, args, kwargs, timeout)
    except DistributedTestFailure:
        _POOLS.pop(key, None)
        raise


def shutdown_pools() -> None:
    """Stop every pool (registered with atexit)."""
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


atexit.register(shutdown_pools)
