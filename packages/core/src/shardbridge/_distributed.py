"""Joining the job: this process's rank from its launcher's environment, then the process group.

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
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

__all__ = ["DistributedEnv", "init_distributed"]

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
