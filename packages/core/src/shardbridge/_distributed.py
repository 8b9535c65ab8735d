"""Joining the job (this process's rank from its launcher's environment, then the process group) and leaving it.

[Note: launcher environments]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
torch's ``env://`` rendezvous (2.13) reads ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``. torchrun sets them for every process it starts (with ``LOCAL_RANK`` and
``GROUP_RANK``, the node), and so do ``accelerate launch`` and ``shardbridge launch``, which
start their workers through torchrun. SLURM's ``srun`` starts every task itself and sets its own
names, which neither torch nor Accelerate (1.15: it also reads MPI's ``PMI_*`` /
``OMPI_COMM_WORLD_*``) reads. :meth:`DistributedEnv.from_environ` reads either, the first
source present in this order::

    source    present when        rank           world size     local rank      node
    torchrun  RANK is set         RANK           WORLD_SIZE     LOCAL_RANK      GROUP_RANK
    slurm     SLURM_PROCID is set SLURM_PROCID   SLURM_NTASKS   SLURM_LOCALID   SLURM_NODEID

    both: MASTER_ADDR (the host of rank 0) and MASTER_PORT (a free TCP port there)

torchrun's names come first: under ``srun torchrun ...`` (one SLURM task per node, torchrun
starting that node's processes) both are set, and there ``RANK`` is the process's rank while
``SLURM_PROCID`` is the node's. SLURM sets no ``MASTER_ADDR`` / ``MASTER_PORT``; the job script
exports them (the first host of ``scontrol show hostnames "$SLURM_JOB_NODELIST"``, any free
port). A missing or malformed variable is a ValueError naming it and the fix, before any
connection is tried (torch's own error names one variable at a time, after a rendezvous
timeout for a wrong host). :func:`init_distributed` then exports the SLURM values under
torchrun's names (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``), so that every library reading
those (Accelerate's state, ``env://``) agrees, and joins the process group.

Global ranks are what the launcher assigns: torchrun and srun (block distribution, the default)
number the processes of node 0 first, so node ``n`` of ``k`` processes holds ranks
``n*k .. n*k + k-1``. With the mesh's row-major rank order ([Note: mesh axes] in ``_mesh.py``)
the innermost axes (``tp``, then ``cp``, ``dp_shard``) stay inside a node as long as their
product divides the processes per node, and ``dp_replicate`` (outermost) spans nodes: HSDP
replicates across nodes and shards inside one.

[Note: gloo threads at exit]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A gloo process group runs its collectives on two worker threads of its own (torch 2.13's
``ProcessGroupGloo::runLoop``, thread name :data:`~shardbridge._compat.GLOO_WORKER_THREAD`).
When a collective is done, its worker marks it complete (the caller's ``wait()`` returns) and
only then drops the work's tensors. If the caller has dropped its Python object of such a tensor
in between, torch has kept that object alive for the tensor, and the worker's drop releases it:
it takes the GIL. A thread that takes the GIL while the interpreter finalizes is ended by CPython
(``pthread_exit``); the forced unwind runs into torch's ``noexcept`` ``~AsyncWork`` and ends in
``std::terminate``: the process aborts (SIGABRT) after its last line, printing only
``terminate called without an active exception``. The worker's stack in the core file::

    std::terminate <- __gxx_personality_v0 <- _Unwind_ForcedUnwind <- pthread_exit
    <- PyThread_exit_thread <- take_gil <- PyEval_AcquireThread <- pybind11::gil_scoped_acquire
    <- ConcretePyInterpreterVTable::decref <- c10::TensorImpl::decref_pyobject
    <- ProcessGroupGloo::AsyncWork::~AsyncWork <- ProcessGroupGloo::runLoop

It happens when the worker comes late: it asked for the GIL in the last milliseconds before the
interpreter finalizes (torch's ``Py_IsInitialized()`` check passed, the GIL came after), because it
was preempted or the main thread held the GIL. On the loaded 2-core CI machine it hit one
4-process gloo job in each of three full runs (README's ``train_core.py``, the Megatron-FSDP
example); in a ``train_core.py`` run about 100 of each rank's collectives end with the worker
dropping a Python object, the last one 30-500 ms before the process exits.

``destroy_process_group()`` does not prevent it: it unregisters the groups, but a gloo group's
worker threads stop only when the group object is freed, and torch keeps the groups referenced
until the process ends (in ``train_core.py``: the root DeviceMesh's ``_pg_registry`` holds eight of
its nine groups, FSDP2's mesh info the ninth, and the mesh outlives the script's own references);
torch 2.13's gloo backend has no ``shutdown`` or ``abort`` that stops them, and pytorch/pytorch#179291
(an atexit ``destroy_process_group`` in torch) was abandoned.

So shardbridge waits for them: at exit (an ``atexit`` handler registered when shardbridge is
imported, so after Python joined the non-daemon threads such as an asynchronous checkpoint's
writer, and after the handlers registered later), :func:`wait_for_gloo_workers` releases the GIL
until no gloo worker thread is runnable or making progress (Linux: each worker's state and CPU time
in ``/proc/self/task``; elsewhere it returns at once). A worker waiting for the GIL takes it during
that wait and finishes; one preempted after its collective is runnable, so the wait goes on. It
costs a few milliseconds when the workers are idle, and gives up after ``timeout`` seconds rather
than hold the exit. It cannot cover a collective still in flight when the process exits (its worker
sleeps in the transport until a peer answers): end every rank after the same last collective
(a ``dist.barrier()`` before ``destroy_process_group()``). Regression test:
``tests/test_distributed.py::test_gloo_worker_late_at_exit``; reproducer and before/after counts:
docs/testing.md ("Resolved flakes").
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from shardbridge._compat import GLOO_WORKER_THREAD

__all__ = ["DistributedEnv", "init_distributed", "wait_for_gloo_workers"]

Source = Literal["torchrun", "slurm"]

# source -> the variable that says it is present, then field -> variable (None: not given by it).
_SOURCES: dict[Source, dict[str, str | None]] = {
    "torchrun": {
        "rank": "RANK", "world_size": "WORLD_SIZE", "local_rank": "LOCAL_RANK", "node_rank": "GROUP_RANK",
    },
    "slurm": {
        "rank": "SLURM_PROCID", "world_size": "SLURM_NTASKS", "local_rank": "SLURM_LOCALID", "node_rank": "SLURM_NODEID",
    },
}  # fmt: skip
_REQUIRED: dict[Source, tuple[str, ...]] = {
    "torchrun": ("rank", "world_size"),  # LOCAL_RANK / GROUP_RANK: a plain process given RANK may lack them
    "slurm": ("rank", "world_size", "local_rank", "node_rank"),  # srun sets all four for every task
}
_MASTER_HINT = {
    "torchrun": "set MASTER_ADDR (the host of rank 0) and MASTER_PORT (a free TCP port on it), as torchrun does",
    "slurm": (
        'export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1) and MASTER_PORT=29500 '
        "(any free port) in the job script, before srun"
    ),
}


@dataclass(frozen=True, kw_only=True)
class DistributedEnv:
    """Where this process sits in the job, as its launcher told it. See [Note: launcher environments].

    Example:
        >>> env = DistributedEnv.from_environ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
        ...                                    "SLURM_NODEID": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"})
        >>> env.rank, env.world_size, env.local_rank, env.node_rank, env.source
        (3, 4, 1, 1, 'slurm')
    """

    rank: int
    """Global rank, 0 .. world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int | None
    """Rank among the processes of this node (the GPU index); None when the launcher did not say."""
    node_rank: int | None
    """Index of this node (machine); None when the launcher did not say."""
    master_addr: str
    """Host of rank 0, where the rendezvous store listens."""
    master_port: int
    """TCP port of the rendezvous store."""
    source: Source
    """Which launcher's variables these are: "torchrun" (also ``accelerate launch``, ``shardbridge launch``,
    or RANK / WORLD_SIZE set by hand) or "slurm" (``srun``)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistributedEnv:
        """Read the launcher's variables (``os.environ`` by default). See [Note: launcher environments].

        Raises:
            ValueError: no launcher's variables, or one missing or malformed; the message names
                the variable, its value and the fix.
        """
        env = os.environ if environ is None else environ
        source = next((s for s, names in _SOURCES.items() if names["rank"] in env), None)
        if source is None:
            present = sorted(n for n in ("WORLD_SIZE", "SLURM_NTASKS") if n in env)
            also = f" ({', '.join(present)} is set, but not the rank beside it)" if present else ""
            raise ValueError(
                f"no launcher environment: neither RANK (torchrun, accelerate launch, shardbridge launch) nor "
                f"SLURM_PROCID (srun) is set{also}; start the processes with one of them, or set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT"
            )
        names = _SOURCES[source]
        values: dict[str, int | None] = {}
        for field, name in names.items():
            if name is None or name not in env:
                if field in _REQUIRED[source]:
                    raise ValueError(
                        f"{names['rank']}={env[names['rank']]!r} is set ({source}) but {name} is not; set {name}"
                        + (" (srun sets it for every task: start the processes with srun)" if source == "slurm" else "")
                    )
                values[field] = None
                continue
            values[field] = _non_negative_int(name, env[name])
        rank, world_size = values["rank"], values["world_size"]
        assert rank is not None and world_size is not None
        if world_size < 1 or rank >= world_size:
            raise ValueError(
                f"{names['rank']}={rank} must be below {names['world_size']}={world_size} (and the world size >= 1); "
                "the launcher's variables disagree"
            )
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name, "").strip():
                raise ValueError(f"{name} is not set ({source} rank {rank} of {world_size}); {_MASTER_HINT[source]}")
        port = _non_negative_int("MASTER_PORT", env["MASTER_PORT"])
        if not 1 <= port <= 65535:
            raise ValueError(f"MASTER_PORT={port} must be a TCP port in 1..65535")
        return cls(
            rank=rank,
            world_size=world_size,
            local_rank=values["local_rank"],
            node_rank=values["node_rank"],
            master_addr=env["MASTER_ADDR"].strip(),
            master_port=port,
            source=source,
        )

    def torchrun_names(self) -> dict[str, str]:
        """This environment under torchrun's variable names (what :func:`init_distributed` exports)."""
        out = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": str(self.master_port)}  # fmt: skip
        if self.local_rank is not None:
            out["LOCAL_RANK"] = str(self.local_rank)
        if self.node_rank is not None:
            out["GROUP_RANK"] = str(self.node_rank)
        return out


def _non_negative_int(name: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"{name}={value!r} must be an int >= 0")
    return number


def init_distributed(backend: str | None = None, *, timeout: timedelta | None = None) -> DistributedEnv:
    """Join the job's default process group, from torchrun's or SLURM's variables.

    Reads :meth:`DistributedEnv.from_environ`, exports SLURM's values under torchrun's names
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``; torchrun's own are left as they
    are), selects the GPU ``local_rank`` when CUDA is available, and calls
    ``torch.distributed.init_process_group`` with ``init_method="env://"``. Call once per
    process, before :meth:`ParallelDims.build_mesh <shardbridge.ParallelDims.build_mesh>`.

    Args:
        backend: torch's backend ("gloo", "nccl", "cpu:gloo,cuda:nccl"); None = torch's default
            (gloo, plus nccl where CUDA is available).
        timeout: the process group's collective timeout; None = torch's default.

    Returns:
        The environment the process group was built from.

    Raises:
        ValueError: a launcher variable missing or malformed (naming it and the fix); a local
            rank with no GPU of that index on a CUDA machine.
        RuntimeError: the default process group is already initialised with another rank or
            world size than the environment says.

    Example:
        >>> env = init_distributed()  # doctest: +SKIP
        >>> pm = ParallelDims(dp_replicate=env.world_size // 2, tp=2).build_mesh("cpu")  # doctest: +SKIP
    """
    import torch
    import torch.distributed as dist

    env = DistributedEnv.from_environ()
    if dist.is_initialized():
        got = (dist.get_rank(), dist.get_world_size())
        if got != (env.rank, env.world_size):
            raise RuntimeError(
                f"the default process group is already initialised as rank {got[0]} of {got[1]}, but the "
                f"{env.source} environment says rank {env.rank} of {env.world_size}; initialise it once"
            )
        return env
    if env.source != "torchrun":
        os.environ.update(env.torchrun_names())
    if torch.cuda.is_available() and env.local_rank is not None:
        gpus = torch.cuda.device_count()
        if env.local_rank >= gpus:
            raise ValueError(
                f"{_SOURCES[env.source]['local_rank']}={env.local_rank}, but this node has {gpus} GPU(s); start at "
                f"most {gpus} process(es) per node"
            )
        torch.cuda.set_device(env.local_rank)
    kwargs = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size, **kwargs)
    return env


_TASKS = "/proc/self/task"
_EXIT_TIMEOUT_S = 10.0
"""How long the exit waits for busy gloo workers at most ([Note: gloo threads at exit])."""


def _gloo_workers() -> dict[str, tuple[str, str]]:
    """Thread id -> (scheduler state, CPU-time record) of this process's gloo worker threads (Linux)."""
    out: dict[str, tuple[str, str]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER_THREAD:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]  # the name in (...) may hold spaces
            try:
                with open(f"{_TASKS}/{tid}/schedstat") as f:
                    progress = f.read().strip()  # ns on CPU, ns runnable, time slices
            except OSError:  # a kernel without schedstats: the context switches say the same
                with open(f"{_TASKS}/{tid}/status") as f:
                    progress = " ".join(line for line in f if "ctxt_switches" in line)
        except OSError:  # the thread ended meanwhile
            continue
        out[tid] = (state, progress)
    return out


def wait_for_gloo_workers(timeout: float = _EXIT_TIMEOUT_S, *, window: float = 0.005) -> bool:
    """Release the GIL until this process's gloo worker threads are idle; whether they became so in time.

    Idle: every worker sleeps (scheduler state ``S``) and used no CPU over two GIL-free windows of
    ``window`` seconds in a row. See [Note: gloo threads at exit]: shardbridge calls it at
    interpreter exit, so that no worker takes the GIL while the interpreter finalizes. Linux only
    (``/proc/self/task``); elsewhere, and in a process without gloo groups, True at once.

    Args:
        timeout: seconds to wait at most for busy workers.
        window: seconds of each GIL-free wait between two looks.

    Returns:
        True when every worker was idle (or there is none), False after ``timeout``.

    Example:
        >>> wait_for_gloo_workers()  # no gloo process group in this process
        True
    """
    before = _gloo_workers()
    if not before:
        return True
    deadline = time.monotonic() + timeout
    quiet = 0
    while True:
        time.sleep(window)  # GIL released: a worker waiting for it takes it now
        now = _gloo_workers()
        idle = all(state == "S" for state, _ in now.values())
        quiet = quiet + 1 if idle and all(before.get(tid) == rec for tid, rec in now.items()) else 0
        if quiet >= 2:
            return True
        if time.monotonic() > deadline:
            return False
        before = now


atexit.register(wait_for_gloo_workers)
