"""Parameters that never get a gradient: saved without optimizer state, resumed without it.

[Note: parameters without optimizer state] in ``_state.py``. The oracle is the uninterrupted
run: train 2 steps, save, load into a fresh model + AdamW, train 2 more, and every weight and
optimizer state is ``torch.equal`` to 4 steps in one go (the unused parameter has no state in
either). A checkpoint missing only some of a parameter's state keys, or all of them without
the manifest's record, is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from ckpt_helpers import assert_equal_states, full_state
from shardbridge import checkpoint as ck
from shardbridge.testing import run_distributed
from torch import nn

LAYOUT = {"dp_shard": 2, "tp": 2}


class _Net(nn.Module):
    """up (colwise) -> relu -> down (rowwise); ``unused`` is never in the forward (no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.unused = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _build(layout: dict | None, seed: int):
    torch.manual_seed(seed)
    model = _Net()
    dp_rank, dp_size = 0, 1
    if layout is not None:
        from shardbridge._mesh import ParallelDims
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        pm = ParallelDims(**layout).build_mesh("cpu")
        parallelize_module(model, pm["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=pm.fsdp_mesh)
        dp_rank, dp_size = pm["dp"].get_local_rank(), pm["dp"].size()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), dp_rank, dp_size


def _train(model, opt, steps: range, dp_rank: int, dp_size: int) -> None:
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))  # the global batch
        rows = x.shape[0] // dp_size
        model(x[dp_rank * rows : (dp_rank + 1) * rows]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _run(root: str, layout: dict | None, resume: bool):
    """4 steps uninterrupted, or 2 + save + load into a fresh model (other seed) + 2."""
    model, opt, dp_rank, dp_size = _build(layout, seed=0)
    if not resume:
        _train(model, opt, range(4), dp_rank, dp_size)
    else:
        _train(model, opt, range(2), dp_rank, dp_size)
        assert not opt.state[model.unused.weight]  # AdamW created no state for it
        ck.save(f"{root}/step-2", model=model, optimizer=opt, step=2)
        model, opt, dp_rank, dp_size = _build(layout, seed=1)
        ck.load(f"{root}/step-2", model=model, optimizer=opt, rng=False)
        assert not opt.state[model.unused.weight] and not opt.state[model.unused.bias]
        assert opt.state[model.up.weight]  # the others' state was loaded
        _train(model, opt, range(2, 4), dp_rank, dp_size)
    state = full_state(model, opt)
    return state if not dist.is_initialized() or dist.get_rank() == 0 else None


def _absent_record(path) -> list:
    return json.loads((path / "shardbridge.json").read_text())["layout"]["optim_state_absent"]


def test_resume_with_a_parameter_without_state_is_bit_exact_on_fsdp2_x_tp2(tmp_path):
    want = run_distributed(_run, str(tmp_path / "a"), LAYOUT, False, world_size=4)[0]
    got = run_distributed(_run, str(tmp_path / "b"), LAYOUT, True, world_size=4)[0]
    assert not [k for k in want if k.startswith("optim.state.unused.")]
    assert "optim.state.up.weight.exp_avg" in want
    assert_equal_states(got, want)
    assert _absent_record(tmp_path / "b" / "step-2") == ["unused.bias", "unused.weight"]


def test_resume_with_a_parameter_without_state_is_bit_exact_in_one_process(tmp_path):
    assert_equal_states(_run(str(tmp_path), None, True), _run(str(tmp_path / "u"), None, False))


def _saved(tmp_path, mutate=None):
    model, opt, _, _ = _build(None, seed=0)
    _train(model, opt, range(2), 0, 1)
    if mutate is not None:
        mutate(model, opt)
    ck.save(tmp_path / "ckpt", model=model, optimizer=opt, step=2)
    return tmp_path / "ckpt"


def test_partially_missing_state_is_refused_naming_the_key(tmp_path):
    def drop_exp_avg(model, opt):
        # up.weight keeps step and exp_avg_sq but lost exp_avg: not a parameter without state
        del opt.state[model.up.weight]["exp_avg"]

    path = _saved(tmp_path, drop_exp_avg)
    model, opt, _, _ = _build(None, seed=1)
    with pytest.raises(ValueError, match=r"'optim\.state\.up\.weight\.exp_avg'"):
        ck.load(path, model=model, optimizer=opt, rng=False)


def test_all_state_missing_without_the_manifest_record_is_refused(tmp_path, monkeypatch):
    """A checkpoint that lost a parameter's whole state after the save (nothing recorded)."""
    from shardbridge.checkpoint.state import _state

    monkeypatch.setattr(_state, "_stateless_params", lambda *a: [])  # save records nothing
    path = _saved(tmp_path)
    assert _absent_record(path) == []
    monkeypatch.undo()
    model, opt, _, _ = _build(None, seed=1)
    with pytest.raises(ValueError, match=r"'optim\.state\.unused\.(weight|bias)\.[a-z_]+'.*optim_state_absent"):
        ck.load(path, model=model, optimizer=opt, rng=False)
