"""Small models, layouts and oracles shared by the checkpoint tests (not a test module).

Models are built identically on every rank (same seed), parallelized with torch's own
``parallelize_module`` + ``fully_shard`` over a :class:`~shardbridge.ParallelDims` mesh, and
given optimizer state by one AdamW step on rank-dependent random local gradients (no forward:
shapes need not chain, so uneven shapes are free).
"""

from __future__ import annotations

import zlib

import torch
from shardbridge._fused import FusedSpec, fused_params, register_fused, shard_fused, split_fused
from shardbridge._mesh import ParallelDims
from shardbridge.adapters import component_fqn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

# Names of the layouts every round-trip test uses (4 ranks), and None = one process.
LAYOUTS: dict[str, dict[str, int] | None] = {
    "fsdp4": {"dp_shard": 4},
    "fsdp2_tp2": {"dp_shard": 2, "tp": 2},
    "hsdp2_tp2": {"dp_replicate": 2, "dp_shard": 1, "tp": 2},
    "tp4": {"dp_shard": 1, "tp": 4},
    "single": None,
}

SWIGLU = FusedSpec.swiglu(4)  # gate_up: 8 rows = [gate(4); up(4)]


class Mlp(nn.Module):
    """Uneven shapes: ``up`` 9 rows (colwise), ``down`` rowwise, ``head`` 5 rows, a norm."""

    def __init__(self, *, fused: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(6, 9)
        self.down = nn.Linear(8, 6, bias=False)
        self.head = nn.Linear(6, 5)
        self.norm = nn.LayerNorm(6)
        if fused:
            self.gate_up = nn.Linear(6, SWIGLU.total, bias=False)
            register_fused(self.gate_up, "weight", SWIGLU)


def build(layout: dict[str, int] | None, *, fused: bool = False, seed: int = 0, lr: float = 0.01, ac: bool = False):
    """Model and AdamW (one step taken) in ``layout`` (None = plain, one process).

    ``ac``: every child module in torch's activation-checkpoint wrapper, applied between TP and
    FSDP as torchtitan does (each parameter's name gains ``._checkpoint_wrapped_module``).
    """
    torch.manual_seed(seed)
    model = Mlp(fused=fused)
    if layout is not None:
        pm = ParallelDims(**layout).build_mesh("cpu")
        if pm.dims.tp > 1:
            if fused:
                # plain [gate; up] -> Shard(0) DTensor, rank j holds [gate_j; up_j]
                w = shard_fused(model.gate_up.weight.detach(), SWIGLU, pm["tp"])
                model.gate_up.weight = nn.Parameter(w)
            plan = {"up": ColwiseParallel(), "down": RowwiseParallel(), "head": ColwiseParallel()}
            if fused:
                plan["gate_up"] = ColwiseParallel()
            parallelize_module(model, pm["tp"], plan)
        if ac:
            for name, child in list(model.named_children()):
                setattr(model, name, checkpoint_wrapper(child))
        fully_shard(model, mesh=pm.fsdp_mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    step(model, opt, seed=seed + 1)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, *, seed: int) -> None:
    """One AdamW step on random local gradients.

    Different for every shard, equal on ranks that hold replicas of the same shard (their
    coordinates on the non-Replicate mesh axes agree), as real training keeps them.
    """
    for fqn, p in model.named_parameters():
        if isinstance(p, DTensor):
            coords = [c for c, pl in zip(p.device_mesh.get_coordinate(), p.placements) if not isinstance(pl, Replicate)]
            gen = torch.Generator().manual_seed(zlib.crc32(repr((seed, fqn, coords)).encode()))
            local = torch.randn(p.to_local().shape, generator=gen)
            p.grad = DTensor.from_local(
                local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(), run_check=False
            )
        else:
            gen = torch.Generator().manual_seed(zlib.crc32(repr((seed, fqn)).encode()))
            p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _tp_size(t: torch.Tensor) -> int:
    if not isinstance(t, DTensor) or t.device_mesh.mesh_dim_names is None:
        return 1
    return max(
        [
            s
            for n, s, p in zip(t.device_mesh.mesh_dim_names, t.device_mesh.shape, t.placements)
            if n == "tp" and type(p) is Shard
        ]
        or [1]
    )


def full_state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    """Every tensor as a full plain tensor, named as in the checkpoint (fused params split, no
    activation-checkpoint wrapper in the names).

    The oracle: ``DTensor.full_tensor()`` and ``split_fused`` (independent of
    shardbridge.checkpoint). A collective: call on every rank.
    """
    fused = fused_params(model)
    out: dict[str, torch.Tensor] = {}

    def add(prefix: str, fqn: str, suffix: str, value: torch.Tensor, param: torch.Tensor) -> None:
        # clone(): full_tensor() of a DTensor on a 1-rank mesh dim can alias the live tensor
        full = (value.full_tensor() if isinstance(value, DTensor) else value.detach()).clone()
        spec = fused.get(fqn)
        fqn = fqn.replace("._checkpoint_wrapped_module", "")
        if spec is not None and full.shape == param.shape:
            for name, part in split_fused(full, spec, _tp_size(param)).items():
                out[f"{prefix}{component_fqn(fqn, name)}{suffix}"] = part.clone()
        elif spec is not None:
            for name in spec.names:
                out[f"{prefix}{component_fqn(fqn, name)}{suffix}"] = full
        else:
            out[f"{prefix}{fqn}{suffix}"] = full

    params = dict(model.named_parameters())
    for fqn, p in params.items():
        add("model.", fqn, "", p, p)
    for fqn, buf in model.named_buffers():
        add("model.", fqn, "", buf, buf)
    if opt is not None:
        names = {id(p): fqn for fqn, p in params.items()}
        for p, state in opt.state.items():
            for key, value in state.items():
                add("optim.state.", names[id(p)], f".{key}", value, p)
    return out


def assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Same keys, bit-exact values (torch.equal)."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"values differ for {bad}"


def rank0(results: list) -> object:
    """The result of rank 0 (``run_distributed`` returns one per rank)."""
    return results[0]


def save_losing_a_file_of_rank_1(env: dict[str, str], root: str, protocol: str, how: str):
    """One rank of a 2-rank save whose rank 1 loses its data file right after writing it ("missing":
    removed; "short": one byte cut): what rank 0 sees of a directory that is not the one rank 1
    wrote into. Returns (the save's error or "saved", host, ``latest(root)``, what ``root`` holds)."""
    import socket

    import torch.distributed as dist
    from shardbridge import checkpoint as ck
    from shardbridge.checkpoint.storage import _writer
    from shardbridge.checkpoint.storage._location import locate
    from shardbridge.testing._s3 import use_server

    if env:
        use_server(env)
    model, opt = build({"dp_shard": 2})
    real_write = _writer.Writer.write_data

    def write_then_lose(self, plan, planner):
        done = real_write(self, plan, planner)
        if dist.get_rank() == 1:
            path = self.backend.join(self.target.data, "__1_0.distcp")
            if how == "missing":
                self.backend.remove(path)
            else:
                self.backend.write_bytes(path, self.backend.read_bytes(path)[:-1])
        return done

    _writer.Writer.write_data = write_then_lose
    try:
        ck.save(f"{root}/step-00000001", model=model, optimizer=opt, step=1, protocol=protocol)
        outcome = "saved"
    except (ValueError, OSError) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        _writer.Writer.write_data = real_write
    dist.barrier()
    where = locate(root)
    return outcome, socket.gethostname(), ck.latest(root), sorted(where.backend.listing(where.path))


def without_strides(described: dict) -> dict:
    """``state_dict_metadata`` with each entry's ``TensorProperties.strides`` (torch >= 2.15) cleared.

    torch 2.15's DCP writer records the strides of the local tensor of the first rank that writes
    an entry (only its legacy ShardedTensor reads them back); the derived protocol renders None
    there. Everything else of ``.metadata`` is compared as it is (docs/testing.md, torch versions)."""
    import dataclasses

    out = {}
    for key, entry in described.items():
        props = getattr(entry, "properties", None)
        if getattr(props, "strides", None) is not None:
            entry = dataclasses.replace(entry, properties=dataclasses.replace(props, strides=None))
        out[key] = entry
    return out
