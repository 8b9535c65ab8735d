"""Tier 3: ``state_dicts=`` (a StateDictProvider) makes save/load right for DTensors whose
placements do not describe their local data.

The model: ``w`` (6, 3) is a ``[Shard(0)]`` DTensor on 2 ranks, but rank 0 holds rows 4..5
and rank 1 rows 0..3 (placements say rows 0..2 and 3..5), as Megatron-FSDP's uneven,
reordered shards do; ``b`` is a Replicate DTensor the placements describe (the provider
answers None for it)::

    rank   local rows   placements say   local_offsets
    0      4..5 (2)     0..2 (3)         (4, 0)
    1      0..3 (4)     3..5 (3)         (0, 0)

Oracles: the global tensors the ranks were cut from, torch's ``dcp_to_torch_save`` of the
checkpoint, and a plain single-process model loaded by the core without a provider.

Rank-local tensors (``mark_rank_local``, [Note: rank-local tensors]): ``v`` holds different
values on the 2 ranks under one name; save and load without a provider that takes it over
raise on every rank, and ``ByRank`` (``v`` stored as ``v.by_rank`` ``[2, 3]``, Shard(0) over
the ranks) round-trips it.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.distributed as dist
from shardbridge import checkpoint as ck
from shardbridge.testing import run_distributed
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

ROWS = {0: (4, 6), 1: (0, 4)}  # rank -> [start, stop) of the global rows it holds
SHAPE = (6, 3)


def _globals(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: torch.randn(shape, generator=g)
        for name, shape in (
            ("w", SHAPE),
            ("w.exp_avg", SHAPE),
            ("w.exp_avg_sq", SHAPE),
            ("b", (3,)),
            ("b.exp_avg", (3,)),
        )
    }


def _rows(t: torch.Tensor) -> torch.Tensor:
    start, stop = ROWS[dist.get_rank()]
    return t[start:stop].clone()


class _Model(nn.Module):
    def __init__(self, values: dict[str, torch.Tensor], mesh) -> None:
        super().__init__()
        self.w = nn.Parameter(_reordered(values["w"], mesh))
        self.b = nn.Parameter(DTensor.from_local(values["b"].clone(), mesh, [Replicate()]))


def _reordered(full: torch.Tensor, mesh) -> DTensor:
    # [Shard(0)] claims an even split; the local rows are ROWS[rank] instead.
    return DTensor.from_local(_rows(full), mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())


def _build(seed: int, lr: float):
    """The reordered model with Adam state (exp_avg a DTensor, exp_avg_sq a plain local shard)."""
    values = _globals(seed)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = _Model(values, mesh)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    opt.state[model.w] = {
        "step": torch.tensor(float(seed)),
        "exp_avg": _reordered(values["w.exp_avg"], mesh),
        "exp_avg_sq": _rows(values["w.exp_avg_sq"]),  # plain local tensor, as fused optimizers keep
    }
    opt.state[model.b] = {
        "step": torch.tensor(float(seed)),
        "exp_avg": DTensor.from_local(values["b.exp_avg"].clone(), mesh, [Replicate()]),
        "exp_avg_sq": torch.zeros(3),
    }
    return model, opt, values


class Reordered:
    """The provider: ``w``'s true offsets; torch-style flattened dicts; param groups restored."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}

    def state_dicts(self, model, optimizer, *, for_load):
        model_sd = dict(model.named_parameters())
        self.names = {id(p): n for n, p in model_sd.items()}
        if optimizer is None:
            return model_sd, None
        optim_sd = {}
        for p, state in optimizer.state.items():
            optim_sd.update({f"state.{self.names[id(p)]}.{k}": v for k, v in state.items()})
        for group in optimizer.param_groups:
            for p in group["params"]:
                optim_sd.update({f"param_groups.{self.names[id(p)]}.{h}": v for h, v in group.items() if h != "params"})
        return model_sd, optim_sd

    def local_offsets(self, fqn, param):
        return (ROWS[dist.get_rank()][0], 0) if fqn == "w" else None

    def load_state_dicts(self, model, optimizer, model_sd, optim_sd, *, strict):
        for group in optimizer.param_groups if optimizer is not None else ():
            for p in group["params"]:
                for h in group:
                    if h != "params":
                        group[h] = optim_sd[f"param_groups.{self.names[id(p)]}.{h}"]


class BadOffsets(Reordered):
    def local_offsets(self, fqn, param):
        return (5, 0) if fqn == "w" and dist.get_rank() == 1 else super().local_offsets(fqn, param)


def _save(path: str, provider: bool) -> None:
    model, opt, _ = _build(seed=1, lr=0.01)
    if provider:
        ck.save(path, model=model, optimizer=opt, step=3, state_dicts=Reordered())
    else:
        ck.save(path, model=model, step=3)  # the placements alone describe w


def _round_trip(path: str) -> bool:
    # Different seed and lr: every value must come from the checkpoint.
    model, opt, _ = _build(seed=2, lr=0.5)
    src = _globals(seed=1)
    state = ck.load(path, model=model, optimizer=opt, state_dicts=Reordered())
    w_state, b_state = opt.state[model.w], opt.state[model.b]
    return all(
        [
            state.step == 3,
            torch.equal(model.w.to_local(), _rows(src["w"])),
            torch.equal(w_state["exp_avg"].to_local(), _rows(src["w.exp_avg"])),
            torch.equal(w_state["exp_avg_sq"], _rows(src["w.exp_avg_sq"])),
            float(w_state["step"]) == 1.0,
            torch.equal(model.b.to_local(), src["b"]),
            torch.equal(b_state["exp_avg"].to_local(), src["b.exp_avg"]),
            opt.param_groups[0]["lr"] == 0.01,
        ]
    )


def _bad_offsets(path: str) -> str:
    model, opt, _ = _build(seed=1, lr=0.01)
    with pytest.raises(ValueError, match=r"local_offsets=\(5, 0\) from BadOffsets") as info:
        ck.save(path, model=model, optimizer=opt, state_dicts=BadOffsets())
    return str(info.value)


def _oracle(path, tmp_path) -> dict[str, torch.Tensor]:
    out = tmp_path / "oracle.pt"
    dcp_to_torch_save(path, out)
    raw = torch.load(out, weights_only=False)
    return {"w": raw["model"]["w"], "w.exp_avg": raw["optim"]["state.w.exp_avg"]}


def test_provider_round_trip_bit_exact(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    run_distributed(_save, path, True, world_size=2)
    src = _globals(seed=1)
    oracle = _oracle(path, tmp_path)
    assert torch.equal(oracle["w"], src["w"])
    assert torch.equal(oracle["w.exp_avg"], src["w.exp_avg"])
    assert run_distributed(_round_trip, path, world_size=2) == [True, True]
    # The core reads it into a plain model without any provider.
    plain = nn.Module()
    plain.w, plain.b = nn.Parameter(torch.zeros(SHAPE)), nn.Parameter(torch.zeros(3))
    assert ck.load(path, model=plain, rng=False).step == 3
    assert torch.equal(plain.w.detach(), src["w"]) and torch.equal(plain.b.detach(), src["b"])


def test_without_provider_the_placements_are_wrong(tmp_path) -> None:
    # Control: the default path trusts the placements; the save "succeeds" (rank 0 writes its
    # 2 rows under a 3-row box) and the checkpoint does not read back.
    path = str(tmp_path / "ckpt")
    run_distributed(_save, path, False, world_size=2)
    with pytest.raises(CheckpointException, match="mismatch sizes"):
        dcp_to_torch_save(path, tmp_path / "oracle.pt")


def test_provider_bad_offsets_raise_on_every_rank(tmp_path) -> None:
    messages = run_distributed(_bad_offsets, str(tmp_path / "ckpt"), world_size=2)
    assert "do not place the local tensor of shape (4, 3)" in messages[1]
    assert "raised on rank 1" in messages[0]
    assert not (tmp_path / "ckpt").exists()


def test_not_a_provider_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="state_dicts=dict is not a StateDictProvider"):
        ck.save(tmp_path / "x", model=nn.Linear(2, 2), state_dicts={})
    with pytest.raises(ValueError, match="is not a StateDictProvider"):
        ck.load(tmp_path / "x", model=nn.Linear(2, 2), state_dicts=object())


# --------------------------------------------------------------------------- rank-local tensors


def _by_rank_values() -> torch.Tensor:
    return torch.arange(6.0).reshape(2, 3) + 10  # row r: rank r's v


class ByRank:
    """Takes the rank-local ``v`` over: stored as ``v.by_rank`` [2, 3], row r = rank r's ``v``."""

    def __init__(self, mesh, leave_optim_state: bool = False) -> None:
        self.mesh, self.leave_optim_state = mesh, leave_optim_state

    def state_dicts(self, model, optimizer, *, for_load):
        # a view of v: DCP's load writes into v itself
        by_rank = DTensor.from_local(model.v.detach().unsqueeze(0), self.mesh, [Shard(0)], run_check=False)
        optim_sd = {"state.v.momentum_buffer": torch.zeros(3)} if self.leave_optim_state else None
        return {"v.by_rank": by_rank}, optim_sd

    def local_offsets(self, fqn, param):
        return None

    def load_state_dicts(self, model, optimizer, model_sd, optim_sd, *, strict):
        pass  # filled in place


def _rank_local(path: str) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp_shard",))
    model = nn.Module()
    model.v = nn.Parameter(_by_rank_values()[dist.get_rank()].clone())
    ck.mark_rank_local(model, ["v"], provider_hint="pass state_dicts=ByRank(mesh)")
    errors = {}
    for name, call in [
        ("save", lambda: ck.save(path, model=model)),
        ("optim", lambda: ck.save(path, model=model, optimizer=torch.optim.SGD([model.v]),
                                  state_dicts=ByRank(mesh, leave_optim_state=True))),
    ]:  # fmt: skip
        with pytest.raises(ValueError) as info:
            call()
        errors[name] = str(info.value)
    errors["nothing_written"] = str(os.path.exists(path))
    ck.save(path, model=model, state_dicts=ByRank(mesh))
    with pytest.raises(ValueError) as info:
        ck.load(path, model=model, rng=False)
    errors["load"] = str(info.value)
    with torch.no_grad():
        model.v.zero_()
    ck.load(path, model=model, state_dicts=ByRank(mesh), rng=False)
    errors["round_trip"] = str(torch.equal(model.v.detach(), _by_rank_values()[dist.get_rank()]))
    return errors


def test_rank_local_tensors_need_a_provider_on_every_rank(tmp_path) -> None:
    path = str(tmp_path / "ckpt")
    for got in run_distributed(_rank_local, path, world_size=2):
        own = (
            r"^torch's state dicts would store 'v' under the same name on every rank, but 'v' is rank-local .*"
            r"; pass state_dicts=ByRank\(mesh\)$"
        )
        assert re.search(own, got["save"]), got["save"]
        assert re.search(own, got["load"]), got["load"]
        assert re.search(r"^the state dicts of ByRank would store 'state\.v\.momentum_buffer' under", got["optim"])
        assert got["nothing_written"] == "False" and got["round_trip"] == "True"
    # both ranks' v are in the checkpoint (the default path would keep one)
    out = tmp_path / "oracle.pt"
    dcp_to_torch_save(path, out)
    assert torch.equal(torch.load(out, weights_only=False)["model"]["v.by_rank"], _by_rank_values())


def test_mark_rank_local_refuses_unknown_names_and_empty_hints() -> None:
    layer = nn.Linear(2, 2)
    unknown = r"\['weight0'\] are not parameters or buffers of Linear \(it has \['bias', 'weight'\]\)"
    with pytest.raises(ValueError, match=unknown):
        ck.mark_rank_local(layer, ["weight0"], provider_hint="pass state_dicts=P()")
    with pytest.raises(ValueError, match="provider_hint='' must be a non-empty string"):
        ck.mark_rank_local(layer, ["weight"], provider_hint="")
    assert not hasattr(layer, "_shardbridge_rank_local")  # nothing marked by a refused call


class Stacked:
    """A provider that stores two per-expert parameters ``e0`` / ``e1`` ``[3, 2]`` (experts 1 and
    0, as a rank of ep=2 with reversed order would) as ONE ``experts`` ``[2, 3, 2]`` of boxes,
    and their Adam ``exp_avg`` likewise."""

    def state_dicts(self, model, optimizer, *, for_load):
        def stack(e0, e1):  # e0 is global expert 1, e1 expert 0; views, so a load fills them
            return ck.LocalChunks((2, 3, 2), [((1, 0, 0), e0.unsqueeze(0)), ((0, 0, 0), e1.unsqueeze(0))])

        model_sd = {"experts": stack(model.e0.data, model.e1.data)}
        if optimizer is None:
            return model_sd, None
        s0, s1 = optimizer.state[model.e0], optimizer.state[model.e1]
        optim_sd = {"state.experts.exp_avg": stack(s0["exp_avg"], s1["exp_avg"])}
        optim_sd.update({f"param_groups.experts.{h}": v for h, v in optimizer.param_groups[0].items() if h != "params"})
        return model_sd, optim_sd

    def local_offsets(self, fqn, param):
        return None

    def load_state_dicts(self, model, optimizer, model_sd, optim_sd, *, strict):
        pass


def _experts_model(seed: int):
    g = torch.Generator().manual_seed(seed)
    model = nn.Module()
    model.e0, model.e1 = (nn.Parameter(torch.randn(3, 2, generator=g)) for _ in range(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for p in model.parameters():  # a state the values of which must survive (renamed exp_avg)
        opt.state[p] = {"exp_avg": torch.randn(3, 2, generator=g)}
    return model, opt


def test_provider_local_chunks_stack_parameters_into_one_tensor(tmp_path) -> None:
    path = tmp_path / "ckpt"
    model, opt = _experts_model(seed=1)
    ck.save(path, model=model, optimizer=opt, step=1, state_dicts=Stacked())
    # torch's reader sees one [2, 3, 2] tensor, expert 0 = e1, expert 1 = e0.
    dcp_to_torch_save(path, tmp_path / "oracle.pt")
    raw = torch.load(tmp_path / "oracle.pt", weights_only=True)
    assert torch.equal(raw["model"]["experts"], torch.stack([model.e1.detach(), model.e0.detach()]))
    want = torch.stack([opt.state[model.e1]["exp_avg"], opt.state[model.e0]["exp_avg"]])
    assert torch.equal(raw["optim"]["state.experts.exp_avg"], want)
    assert ck.inspect(path).layout["tensors"]["experts"]["stored_as"] == "boxes"
    # Loaded back through the provider into other values: every box filled in place.
    other, other_opt = _experts_model(seed=2)
    ck.load(path, model=other, optimizer=other_opt, state_dicts=Stacked(), rng=False)
    assert torch.equal(other.e0, model.e0) and torch.equal(other.e1, model.e1)
    assert torch.equal(other_opt.state[other.e0]["exp_avg"], opt.state[model.e0]["exp_avg"])
    # A model holding the stacked tensor itself reads it without any provider.
    plain = nn.Module()
    plain.experts = nn.Parameter(torch.zeros(2, 3, 2))
    ck.load(path, model=plain, rng=False)
    assert torch.equal(plain.experts.detach(), raw["model"]["experts"])
